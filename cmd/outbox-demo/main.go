// Command outbox-demo is the module's main job, run by `make demo`. On a throwaway PostgreSQL
// it runs real OS processes: a writer deleting tasks in two projects and two observers with
// persisted identities (one serving the SSE stream). Mid-stream it SIGKILLs an observer and
// restarts it, and one observer's listener fails on one event until the event is parked as a
// dead letter; the demo then "fixes" the listener and replays it. At the end it checks, from
// the database and from each observer's own log, that every deletion was observed, and prints
// a summary. It exits non-zero if anything was lost.
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "child" {
		if err := runChild(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			os.Exit(1)
		}
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	code, err := runDemo(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

func say(format string, args ...any) {
	fmt.Printf("%s [demo] %s\n", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

// child is one running process of the demo.
type child struct {
	name  string
	args  []string
	dir   string
	cmd   *exec.Cmd
	ready chan struct{}
	exit  chan error
}

func startChild(name, dir string, args ...string) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	c := &child{name: name, args: args, dir: dir, ready: make(chan struct{}), exit: make(chan error, 1)}
	c.cmd = exec.Command(exe, append([]string{"child"}, args...)...)
	logFile, err := os.OpenFile(filepath.Join(dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	c.cmd.Stderr = logFile
	out, err := c.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := c.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		readyOnce := sync.Once{}
		for sc.Scan() {
			line := sc.Text()
			if strings.HasPrefix(line, "ready") {
				readyOnce.Do(func() { close(c.ready) })
			}
			fmt.Printf("%s [%s] %s\n", time.Now().Format("15:04:05.000"), name, line)
		}
		c.exit <- c.cmd.Wait()
		_ = logFile.Close()
	}()
	return c, nil
}

func (c *child) waitReady(ctx context.Context) error {
	select {
	case <-c.ready:
		return nil
	case err := <-c.exit:
		c.exit <- err
		return fmt.Errorf("%s exited before it was ready (%v); see %s", c.name, err, filepath.Join(c.dir, c.name+".log"))
	case <-ctx.Done():
		return fmt.Errorf("%s not ready: %w", c.name, ctx.Err())
	}
}

// kill sends SIGKILL and reaps the process.
func (c *child) kill() {
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	<-c.exit
}

// stop asks for a graceful stop (the fx app stops, the consumer flushes and releases).
func (c *child) stop(ctx context.Context) error {
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-c.exit:
		return err
	case <-ctx.Done():
		_ = c.cmd.Process.Kill()
		return fmt.Errorf("%s did not stop in time", c.name)
	}
}

func freePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// sseClient reads the dashboard's event stream like a browser's EventSource: it reconnects
// when the stream ends (the dashboard was killed) and counts the events it sees.
func sseClient(ctx context.Context, url string, received *atomic.Int64) {
	for ctx.Err() == nil {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			sc := bufio.NewScanner(resp.Body)
			for sc.Scan() {
				if strings.HasPrefix(sc.Text(), "data: ") {
					received.Add(1)
				}
			}
			_ = resp.Body.Close()
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

var errLost = errors.New("deletions were lost")
