package faultsuite

import (
	"context"
	"fmt"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
)

// TestChildWorkersFollowTheirParent runs an engine process (an observer serving its stream on
// a unix socket) and two child workers on real processes and a real PostgreSQL:
//   - worker 1 is SIGKILLed mid-stream and restarted: it resumes from its saved position;
//   - the parent is SIGKILLed and restarted under both live workers: they reconnect to the new
//     process and resume;
//   - worker 2 is stopped (SIGSTOP) while a second writer deletes more: the parent's cursor
//     and worker 1 still reach the head with worker 2 frozen, so a stalled child holds up
//     neither its sibling nor its parent's acknowledgements; resumed, worker 2 catches up.
//
// Each worker must end with every event of both projects, in order, with no gap and no
// writer-owned side effect.
func TestChildWorkersFollowTheirParent(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	dir := t.TempDir()
	projects := []string{"alpha", "beta"}
	const perProject = 150
	host := testhost.New(pool, testhost.Options{})
	var first, second []string
	for _, p := range projects {
		ids, err := host.CreateMany(ctx, p, "t", perProject)
		require.NoError(t, err)
		for i, id := range ids {
			if i < perProject*2/3 {
				first = append(first, p+"/"+id)
			} else {
				second = append(second, p+"/"+id)
			}
		}
	}
	require.NoError(t, testhost.NewSettings(pool, "node-e").Set(ctx, "outbox.consumer_id", "engine"))

	socket := filepath.Join(dir, "engine.sock")
	parent := &proc{name: "engine", role: "observer", args: roleArgs{Name: "engine", DSN: db.URL, Scope: "node-e",
		Projects: projects, Log: filepath.Join(dir, "engine.log"), ChildSocket: socket}}
	newWorker := func(name string) *proc {
		return &proc{name: name, role: "child", args: roleArgs{Name: name, Socket: socket,
			Positions: filepath.Join(dir, name+".pos"), Log: filepath.Join(dir, name+".log")}}
	}
	w1, w2 := newWorker("worker-1"), newWorker("worker-2")
	writer := func(name string, tasks []string) *proc {
		return &proc{name: name, role: "writer", args: roleArgs{Name: name, DSN: db.URL, Scope: "writers",
			Projects: projects, Tasks: tasks, Rate: 60, Log: filepath.Join(dir, name+".log")}}
	}
	writer1, writer2 := writer("writer-1", first), writer("writer-2", second)
	all := []*proc{parent, w1, w2, writer1, writer2}
	t.Cleanup(func() {
		for _, p := range all {
			if p.cmd != nil {
				p.signal(syscall.SIGCONT)
				p.signal(syscall.SIGKILL)
			}
		}
	})
	parent.start(t)
	w1.start(t)
	w2.start(t)
	writer1.start(t)

	waitApplied := func(p *proc, n int) {
		t.Helper()
		require.NoError(t, testhost.WaitFor(ctx, time.Minute, fmt.Sprintf("%s to apply %d events", p.name, n), func() (bool, error) {
			s, err := readWorkerLog(p.args.Log)
			return s.applied >= n, err
		}))
	}

	waitApplied(w1, 30)
	w1.kill(t)
	w1.start(t)
	t.Log("worker-1 SIGKILLed mid-stream and restarted")

	waitApplied(w2, 90)
	parent.kill(t)
	parent.start(t)
	t.Log("the parent SIGKILLed and restarted under both live workers")

	waitDone(ctx, t, writer1)
	w2.signal(syscall.SIGSTOP)
	writer2.start(t)
	waitDone(ctx, t, writer2)
	require.NoError(t, waitCaughtUp(ctx, pool, []string{"engine"}, len(projects)),
		"the parent's acknowledgements waited for a stalled child")
	require.NoError(t, waitWorkerCaughtUp(ctx, pool, w1.args.Positions, "engine", projects),
		"a stalled child held up its sibling")
	t.Log("with worker-2 frozen, the parent's cursor and worker-1 reached the head")
	w2.signal(syscall.SIGCONT)
	require.NoError(t, waitWorkerCaughtUp(ctx, pool, w2.args.Positions, "engine", projects))

	for _, p := range []*proc{writer1, writer2, w1, w2, parent} {
		p.stop(t)
	}
	for _, w := range []*proc{w1, w2} {
		s, err := readWorkerLog(w.args.Log)
		require.NoError(t, err)
		t.Logf("%s: applied=%d redelivered=%d resets=%d gaps=%d", w.name, s.applied, s.redelivered, s.resets, s.gaps)
		require.Zero(t, s.gaps, "%s skipped events", w.name)
		require.Zero(t, s.fenceViolations, "%s performed a writer-owned side effect", w.name)
		require.Zero(t, s.resets, "%s was reset: nothing it needed was pruned or too far behind", w.name)
		require.Equal(t, perProject*len(projects), s.applied, "%s did not apply every event once", w.name)
	}
}

// waitDone waits until a writer has deleted its whole list.
func waitDone(ctx context.Context, t *testing.T, w *proc) {
	t.Helper()
	require.NoError(t, testhost.WaitFor(ctx, 2*time.Minute, w.name+" to finish", func() (bool, error) { return w.isDone(), nil }))
}
