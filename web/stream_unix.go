package web

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// A parent process serves its event stream to its child workers on a unix socket that only
// its own user can use; the children follow it with a StreamClient over UnixSocketClient.

// UnixSocketClient returns an HTTP client that dials the unix socket at path whatever host a
// request's URL names (e.g. "http://parent/events"), with no overall timeout and no proxy.
func UnixSocketClient(path string) *http.Client {
	var d net.Dialer
	return &http.Client{Transport: &http.Transport{
		Proxy: nil,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "unix", path)
		},
		MaxIdleConns:    2,
		IdleConnTimeout: time.Minute,
	}}
}

// maxUnixPath is the longest socket path Linux binds (sun_path holds 108 bytes with its NUL).
const maxUnixPath = 107

// ListenUnix listens on a unix socket at path that only the process's user can connect to:
// the socket is bound in a fresh directory of mode 0700 beside path, set to mode 0600 (so
// the umask does not matter), and only then linked at path, so that no one else can connect
// in between. A socket file at path with nothing listening (left by a process that died) is
// removed first; one that is still served is refused, and so is any other kind of file,
// which is never removed. Closing the listener removes the socket file, unless another
// socket has replaced it since. The directory holding path should be writable by its owner
// only: whoever can write it can replace the socket.
func ListenUnix(path string) (net.Listener, error) {
	if path == "" {
		return nil, errors.New("listen on unix socket: empty path")
	}
	dir := filepath.Dir(path)
	private, err := os.MkdirTemp(dir, ".s")
	if err != nil {
		return nil, fmt.Errorf("listen on unix socket %s: %w", path, err)
	}
	defer os.RemoveAll(private)
	bound := filepath.Join(private, "s")
	if len(path) > maxUnixPath || len(bound) > maxUnixPath {
		return nil, fmt.Errorf("listen on unix socket %s: too long: the path, and the %d-byte one the socket is bound at first, must be at most %d bytes",
			path, len(bound), maxUnixPath)
	}
	if err := removeStaleSocket(path); err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: bound, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on unix socket %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false) // the name it was bound at is gone once linked at path
	fail := func(err error) (net.Listener, error) {
		_ = ln.Close()
		return nil, fmt.Errorf("listen on unix socket %s: %w", path, err)
	}
	if err := os.Chmod(bound, 0o600); err != nil {
		return fail(err)
	}
	// A link, not a rename: it fails rather than replace whatever appeared at path meanwhile.
	if err := os.Link(bound, path); err != nil {
		return fail(err)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		return fail(err)
	}
	return &unixListener{UnixListener: ln, path: path, file: fi}, nil
}

// removeStaleSocket removes a socket file at path that nothing listens on, and refuses any
// other file there.
func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("listen on unix socket %s: %w", path, err)
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("listen on unix socket %s: a file that is not a socket is there (%s); it is not removed", path, fi.Mode().Type())
	}
	conn, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		_ = conn.Close()
		return fmt.Errorf("listen on unix socket %s: another process is listening on it", path)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("listen on unix socket %s: cannot tell whether the socket there is stale: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("listen on unix socket %s: remove the stale socket: %w", path, err)
	}
	return nil
}

// unixListener removes its socket file when it is closed.
type unixListener struct {
	*net.UnixListener
	path string
	file os.FileInfo
	once sync.Once
}

// Addr is the socket's path.
func (l *unixListener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

// Close stops listening and removes the socket file, unless another socket replaced it.
func (l *unixListener) Close() error {
	err := l.UnixListener.Close()
	l.once.Do(func() {
		if fi, statErr := os.Lstat(l.path); statErr == nil && os.SameFile(fi, l.file) {
			_ = os.Remove(l.path)
		}
	})
	return err
}
