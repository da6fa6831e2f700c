// Command outbox-demo is the module's main job, run by `make demo`. On a throwaway PostgreSQL
// it runs real OS processes: a writer deleting tasks in two projects, and two observers with
// persisted identities on two nodes: a dashboard serving the event stream over HTTP, which a
// remote viewer follows with the module's stream client, and an engine feeding a child worker
// over a unix socket. Mid-stream it SIGKILLs the dashboard and the child worker and restarts
// them, and the engine's listener fails on one event until the event is parked as a dead
// letter; the demo then "fixes" the listener and replays it. At the end it checks, from the
// database and from each observer's and the worker's own log, that every deletion was
// observed, and prints a summary. It exits non-zero if anything was lost.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"fusion/outbox"
	"fusion/outbox/web"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "child" {
		if err := runChild(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			os.Exit(1)
		}
		return
	}
	linger := flag.Duration("linger", 0, "keep the dashboard and its operations page up this long after the run, before the summary")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	code, err := runDemo(ctx, *linger)
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

// streamSeen is what the demo's remote viewer saw on the dashboard's event stream.
type streamSeen struct {
	mu          sync.Mutex
	events      int
	duplicates  int
	gaps        int64
	resets      int
	connections func() int64
	last        map[string]int64 // per project: the last sequence seen
	afterReset  map[string]bool  // the next event of the project starts afresh
}

func newStreamSeen() *streamSeen {
	return &streamSeen{last: map[string]int64{}, afterReset: map[string]bool{}, connections: func() int64 { return 0 }}
}

func (s *streamSeen) snapshot() (events, duplicates int, gaps int64, resets, connections int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.events, s.duplicates, s.gaps, s.resets, int(s.connections())
}

// followStream follows the dashboard's event stream over HTTP with the module's client, as a
// node that needs no cursor of its own would (a viewer): when the stream ends (the dashboard
// was killed) the client reconnects with the last position it handled, backing off, and the
// stream resumes where it left off. The viewer checks every project's sequence for duplicates
// and gaps.
func followStream(ctx context.Context, url, positions string, seen *streamSeen) error {
	c, err := web.NewStreamClient(web.StreamClientOptions{URL: url, Positions: web.FilePositions(positions),
		MinBackoff: 100 * time.Millisecond, MaxBackoff: time.Second}, seen)
	if err != nil {
		return err
	}
	seen.mu.Lock()
	seen.connections = func() int64 { return c.Stats().Connects }
	seen.mu.Unlock()
	if err := c.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// HandleObserved implements web.StreamHandler.
func (s *streamSeen) HandleObserved(_ context.Context, ev outbox.ObservedEvent) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.events++
	last := s.last[ev.ProjectID] // the viewer started before the first deletion
	switch {
	case s.afterReset[ev.ProjectID]:
		delete(s.afterReset, ev.ProjectID)
	case ev.Sequence <= last:
		s.duplicates++
		return nil
	case ev.Sequence > last+1:
		s.gaps += ev.Sequence - last - 1
	}
	s.last[ev.ProjectID] = ev.Sequence
	return nil
}

// HandleReset implements web.StreamHandler.
func (s *streamSeen) HandleReset(_ context.Context, r web.SSEReset) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.resets++
	for _, p := range r.Projects {
		s.afterReset[p] = true
	}
	return nil
}

var errLost = errors.New("deletions were lost")
