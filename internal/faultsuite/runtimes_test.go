package faultsuite

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
)

// TestRuntimesFollowTheProjectManager runs an engine process whose project manager adds and
// removes per-project runtimes while it runs (outbox.ProjectRuntimes), on a real PostgreSQL:
//   - beta's runtime, removed and added again after a writer deleted more of beta's tasks, gets
//     them from the identity's durable cursor, where the first runtime stopped;
//   - alpha's runtime, removed and added again at once, goes on with no gap or repeat;
//   - each runtime gets its own project's events only.
//
// (A project the identity never observed before starts at its head, reconciled, as any new
// cursor does: runtimes are added here before the first deletion.)
func TestRuntimesFollowTheProjectManager(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	dir := t.TempDir()
	projects := []string{"alpha", "beta"}
	const perProject = 60
	host := testhost.New(pool, testhost.Options{})
	tasks := map[string][]string{}
	for _, p := range projects {
		ids, err := host.CreateMany(ctx, p, "t", perProject)
		require.NoError(t, err)
		for _, id := range ids {
			tasks[p] = append(tasks[p], p+"/"+id)
		}
	}
	require.NoError(t, testhost.NewSettings(pool, "node-r").Set(ctx, "outbox.consumer_id", "engine"))
	engine := &proc{name: "engine", role: "runtimes", args: roleArgs{Name: "engine", DSN: db.URL, Scope: "node-r",
		Projects: projects, Log: filepath.Join(dir, "engine.log")}}
	writers := 0
	write := func(list ...[]string) {
		t.Helper()
		var all []string
		for _, l := range list {
			all = append(all, l...)
		}
		writers++
		name := fmt.Sprintf("writer-%d", writers)
		w := &proc{name: name, role: "writer", args: roleArgs{Name: name, DSN: db.URL, Scope: "writers",
			Projects: projects, Tasks: all, Rate: 100, Log: filepath.Join(dir, name+".log")}}
		w.start(t)
		waitDone(ctx, t, w)
		w.stop(t)
	}
	t.Cleanup(func() {
		if engine.cmd != nil {
			engine.signal(syscall.SIGKILL)
		}
	})
	engine.start(t)
	command := func(line string) {
		t.Helper()
		verb, project, _ := strings.Cut(line, " ")
		want := map[string]string{"add": "added ", "remove": "removed "}[verb] + project
		_, err := fmt.Fprintln(engine.stdin, line)
		require.NoError(t, err)
		select {
		case got := <-engine.answers:
			require.Equal(t, want, got)
		case <-ctx.Done():
			t.Fatalf("the engine did not answer %q", line)
		}
	}
	logOf := func(p string) string { return engine.args.Log + "." + p }
	applied := func(p string) ([]testhost.ApplyRecord, error) { return readApplied(logOf(p)) }
	waitApplied := func(p string, n int) {
		t.Helper()
		err := testhost.WaitFor(ctx, time.Minute, fmt.Sprintf("%s's runtime to apply %d events", p, n), func() (bool, error) {
			got, err := applied(p)
			return len(got) >= n, err
		})
		if err != nil {
			b, _ := os.ReadFile(filepath.Join(dir, "engine.stderr"))
			t.Fatalf("%v; the engine's log ends:\n%s", err, b[max(0, len(b)-6000):])
		}
	}

	command("add alpha")
	command("add beta")
	write(tasks["alpha"][:20], tasks["beta"][:20])
	waitApplied("alpha", 20)
	waitApplied("beta", 20)
	command("remove beta")
	t.Log("beta's runtime removed at 20")
	write(tasks["beta"][20:40], tasks["alpha"][20:40])
	waitApplied("alpha", 40) // beta's were committed before, and ticked by now
	got, err := applied("beta")
	require.NoError(t, err)
	require.Len(t, got, 20, "beta's removed runtime still got events")
	command("add beta")
	t.Log("beta's runtime added again after 20 more of its events were written")
	waitApplied("beta", 40)
	command("remove alpha")
	command("add alpha")
	write(tasks["alpha"][40:], tasks["beta"][40:])
	waitApplied("alpha", perProject)
	waitApplied("beta", perProject)
	engine.stop(t)

	for _, p := range projects {
		got, err := applied(p)
		require.NoError(t, err)
		require.Len(t, got, perProject, "%s's runtime applied each event once", p)
		for i, r := range got {
			require.Equal(t, p, r.Project, "an event of %s crossed into %s's runtime", r.Project, p)
			require.Equal(t, int64(i+1), r.Sequence, "%s's runtime applied out of order", p)
		}
	}
}

// readApplied reads the applied and duplicate records of an apply log (none when it does not
// exist yet); a duplicate fails the caller's count check.
func readApplied(path string) ([]testhost.ApplyRecord, error) {
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []testhost.ApplyRecord
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r testhost.ApplyRecord
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		switch r.Kind {
		case "applied", "duplicate":
			out = append(out, r)
		case "fence-violated":
			return nil, fmt.Errorf("%s: a runtime performed a writer-owned side effect for %s", path, r.EventID)
		}
	}
	return out, sc.Err()
}
