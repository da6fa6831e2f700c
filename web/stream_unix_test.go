package web_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/web"
)

func TestListenUnix(t *testing.T) {
	t.Parallel()
	dir := shortTempDir(t)
	path := filepath.Join(dir, "parent.sock")
	ln, err := web.ListenUnix(path)
	require.NoError(t, err)
	fi, err := os.Lstat(path)
	require.NoError(t, err)
	require.NotZero(t, fi.Mode()&os.ModeSocket)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "only the owner may connect, whatever the umask")
	require.Equal(t, path, ln.Addr().String())
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "hello") })}
	go func() { _ = srv.Serve(ln) }()
	resp, err := web.UnixSocketClient(path).Get("http://any-host/whatever")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, "hello", string(body), "the client dials the socket whatever the URL's host")

	// A socket that is served is not taken over.
	_, err = web.ListenUnix(path)
	require.ErrorContains(t, err, "another process is listening")
	require.NoError(t, srv.Close())
	_, err = os.Lstat(path)
	require.True(t, errors.Is(err, os.ErrNotExist), "the closed listener removed its socket: %v", err)

	// A stale socket (its process died without removing it) is replaced.
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	stale.SetUnlinkOnClose(false)
	require.NoError(t, stale.Close())
	fi, err = os.Lstat(path)
	require.NoError(t, err, "the stale socket file is there")
	require.NotZero(t, fi.Mode()&os.ModeSocket)
	ln, err = web.ListenUnix(path)
	require.NoError(t, err, "a stale socket is replaced")
	fi, err = os.Lstat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	require.NoError(t, ln.Close())

	// Anything else at the path is refused and left alone.
	file := filepath.Join(dir, "not-a-socket")
	require.NoError(t, os.WriteFile(file, []byte("keep me"), 0o644))
	_, err = web.ListenUnix(file)
	require.ErrorContains(t, err, "not a socket")
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	require.Equal(t, "keep me", string(b), "the file is intact")
	_, err = web.ListenUnix(dir)
	require.ErrorContains(t, err, "not a socket")

	_, err = web.ListenUnix(filepath.Join(dir, strings.Repeat("x", 120)))
	require.ErrorContains(t, err, "too long")

	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "nothing left behind but the regular file: %v", entries)
}

func TestFilePositions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	path := filepath.Join(dir, "position")
	positions := web.FilePositions(path)
	got, err := positions.Load(ctx)
	require.NoError(t, err)
	require.Empty(t, got, "nothing handled yet")

	for _, pos := range []string{"1.82f7302c.3.7", "1.82f7302c.4.7", strings.Repeat("9", web.MaxStreamPosition)} {
		require.NoError(t, positions.Save(ctx, pos))
		got, err = positions.Load(ctx)
		require.NoError(t, err)
		require.Equal(t, pos, got)
	}
	require.NoError(t, positions.Save(ctx, "1.82f7302c.5.7"))
	for _, bad := range []string{strings.Repeat("9", web.MaxStreamPosition+1), "1.a\n", "1.a\r", "1\x00", "1\x7f", "\xff", "1.\u0085"} {
		err := positions.Save(ctx, bad)
		var verr *outbox.ValidationError
		require.ErrorAs(t, err, &verr, "%.20q", bad)
		require.Less(t, len(err.Error()), 200, "the error does not repeat the position")
		got, err = positions.Load(ctx)
		require.NoError(t, err)
		require.Equal(t, "1.82f7302c.5.7", got, "a refused position leaves the saved one")
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "no temporary file is left: %v", entries)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())

	// A file that does not hold a position is an error, not a fresh start.
	require.NoError(t, os.WriteFile(path, []byte("1.82f7302c.5.7\n"), 0o600))
	_, err = positions.Load(ctx)
	require.ErrorContains(t, err, "control character")
	require.NoError(t, os.WriteFile(path, []byte(strings.Repeat("9", web.MaxStreamPosition+1)), 0o600))
	_, err = positions.Load(ctx)
	require.ErrorContains(t, err, "longer than")

	// A directory that is not there: Save fails and leaves nothing.
	require.Error(t, web.FilePositions(filepath.Join(dir, "missing", "position")).Save(ctx, "1.a.1"))
}

// shortTempDir is a temporary directory with a short path: a socket's path is limited to 107
// bytes, which t.TempDir's can come close to.
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "oc")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}
