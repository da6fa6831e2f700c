package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox"
	"fusion/outbox/example/taskstore/schema"
	"fusion/outbox/internal/pgcluster"
	"fusion/outbox/internal/testhost"
)

const (
	tasksPerProject = 300
	writeRate       = 20 // deletes per second
	poisonTask      = "beta/t-150"
)

var projects = []string{"alpha", "beta"}

// observerSpec is one observer process and its persisted identity.
type observerSpec struct {
	name     string // process label, and the consumer ID stored in its settings
	scope    string // settings scope of its node
	logPath  string
	extra    []string
	proc     *child
	consumer string
}

func runDemo(ctx context.Context, linger time.Duration) (int, error) {
	started := time.Now()
	say("starting a throwaway PostgreSQL (initdb, pg_ctl, a unix socket in a private directory)")
	cluster, err := pgcluster.Start(ctx, pgcluster.Options{})
	if err != nil {
		return 1, err
	}
	defer cluster.Stop()
	dir, err := os.MkdirTemp("", "outbox-demo-")
	if err != nil {
		return 1, err
	}
	defer os.RemoveAll(dir)

	if err := createDatabase(ctx, cluster.DSN("postgres"), "demo"); err != nil {
		return 1, err
	}
	dsn := cluster.DSN("demo")
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return 1, err
	}
	defer pool.Close()
	if _, err := outbox.Migrate(ctx, pool); err != nil {
		return 1, err
	}
	if err := schema.Migrate(ctx, pool); err != nil {
		return 1, err
	}
	say("applied the outbox migrations (version %d) and the task store's own schema", outbox.SchemaVersion)

	host := testhost.New(pool, testhost.Options{Actor: "demo"})
	for _, p := range projects {
		if _, err := host.CreateMany(ctx, p, "t", tasksPerProject); err != nil {
			return 1, err
		}
	}
	observers := []*observerSpec{
		{name: "dashboard", scope: "dashboard-node", consumer: "dashboard"},
		{name: "engine-eu", scope: "engine-node", consumer: "engine-eu",
			extra: []string{"-poison", poisonTask, "-fixed", filepath.Join(dir, "listener-fixed")}},
	}
	for _, o := range observers {
		if err := testhost.NewSettings(pool, o.scope).Set(ctx, "outbox.consumer_id", o.consumer); err != nil {
			return 1, err
		}
		o.logPath = filepath.Join(dir, o.name+".applied.jsonl")
	}
	say("created %d tasks in projects %s; persisted identities: dashboard-node -> dashboard, engine-node -> engine-eu; the writer node has none",
		tasksPerProject*len(projects), strings.Join(projects, ", "))

	addr, err := freePort()
	if err != nil {
		return 1, err
	}
	observers[0].extra = []string{"-http", addr}
	startObserver := func(o *observerSpec) error {
		args := append([]string{"observer", "-dsn", dsn, "-scope", o.scope, "-applied-log", o.logPath}, o.extra...)
		c, err := startChild(o.name, dir, args...)
		if err != nil {
			return err
		}
		o.proc = c
		readyCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		return c.waitReady(readyCtx)
	}
	socket := filepath.Join(dir, "engine-eu.sock")
	observers[1].extra = append(observers[1].extra, "-child-socket", socket)
	for _, o := range observers {
		if err := startObserver(o); err != nil {
			return 1, err
		}
	}
	// engine-eu's child worker: no database, no identity; its parent feeds it over a unix
	// socket and it keeps its own position in a file.
	worker := &observerSpec{name: "worker-eu", consumer: "engine-eu/worker", logPath: filepath.Join(dir, "worker-eu.applied.jsonl")}
	startWorker := func() error {
		c, err := startChild(worker.name, dir, "worker", "-socket", socket, "-positions", filepath.Join(dir, "worker-eu.pos"),
			"-applied-log", worker.logPath)
		if err != nil {
			return err
		}
		worker.proc = c
		readyCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		return c.waitReady(readyCtx)
	}
	if err := startWorker(); err != nil {
		return 1, err
	}
	say("engine-eu serves its stream to a child worker over %s (a socket only this user can open)", socket)
	defer func() {
		if worker.proc != nil && worker.proc.cmd.ProcessState == nil {
			worker.proc.kill()
		}
	}()
	defer func() {
		for _, o := range observers {
			if o.proc != nil && o.proc.cmd.ProcessState == nil {
				o.proc.kill()
			}
		}
	}()

	seen := newStreamSeen()
	sseCtx, stopSSE := context.WithCancel(ctx)
	defer stopSSE()
	sseDone := make(chan error, 1)
	go func() {
		sseDone <- followStream(sseCtx, "http://"+addr+"/events", filepath.Join(dir, "viewer.pos"), seen)
	}()
	say("a remote viewer follows http://%s/events with web.StreamClient (server-sent events; it resumes with Last-Event-ID)", addr)
	say("operations page: http://%s/ops/ (served by the dashboard while the demo runs; its buttons work from this machine only)", addr)

	writer, err := startChild("writer", dir, "writer", "-dsn", dsn, "-scope", "writer-node",
		"-count", fmt.Sprint(tasksPerProject), "-rate", fmt.Sprint(writeRate))
	if err != nil {
		return 1, err
	}
	readyCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = writer.waitReady(readyCtx)
	cancel()
	if err != nil {
		return 1, err
	}
	admin := outbox.NewAdmin(pool, outbox.AdminOptions{Audit: host})

	// Fault: kill the dashboard mid-stream, leave it down a moment, start it again.
	if err := testhost.WaitFor(ctx, 60*time.Second, "the dashboard to get a third of the way", func() (bool, error) {
		return ackedAtLeast(ctx, admin, "dashboard", tasksPerProject*len(projects)/3)
	}); err != nil {
		return 1, err
	}
	say("SIGKILL dashboard (pid %d): no shutdown, acknowledgements in flight are lost", observers[0].proc.cmd.Process.Pid)
	observers[0].proc.kill()
	select {
	case <-time.After(2 * time.Second):
	case <-ctx.Done():
		return 1, ctx.Err()
	}
	say("restarting dashboard with the same persisted identity; it waits out the dead process's lease, then resumes from its cursor")
	if err := startObserver(observers[0]); err != nil {
		return 1, err
	}

	// Fault: kill engine-eu's child worker mid-stream and start it again; it resumes from the
	// position it saved.
	if err := testhost.WaitFor(ctx, 60*time.Second, "the worker to get halfway", func() (bool, error) {
		r, err := readAppliedLog(worker.logPath)
		return len(r.applied) >= tasksPerProject*len(projects)/2, err
	}); err != nil {
		return 1, err
	}
	say("SIGKILL engine-eu's child worker (pid %d)", worker.proc.cmd.Process.Pid)
	worker.proc.kill()
	if err := startWorker(); err != nil {
		return 1, err
	}
	say("restarted the worker: it reconnects to engine-eu with its saved position")

	if err := testhost.WaitFor(ctx, 90*time.Second, "the poison event to be parked", func() (bool, error) {
		dl, err := admin.DeadLetters(ctx, outbox.StatusFilter{ConsumerID: "engine-eu"})
		return len(dl) == 1, err
	}); err != nil {
		return 1, err
	}
	dl, _ := admin.DeadLetters(ctx, outbox.StatusFilter{ConsumerID: "engine-eu"})
	say("engine-eu parked %s (sequence %d of %s) as a dead letter after %d attempts (%s); its stream moved on",
		dl[0].EventID, dl[0].Sequence, dl[0].ProjectID, dl[0].Attempts, dl[0].LastFailureClass)

	if err := <-writer.exit; err != nil {
		return 1, fmt.Errorf("writer: %w", err)
	}
	say("writer finished")

	if err := os.WriteFile(filepath.Join(dir, "listener-fixed"), nil, 0o644); err != nil {
		return 1, err
	}
	if _, err := admin.RequestReplay(ctx, outbox.ReplayRequest{ProjectID: dl[0].ProjectID, ConsumerID: "engine-eu", Sequence: dl[0].Sequence,
		Operator: outbox.Operator{Actor: "demo", Reason: "DEMO-1"}}); err != nil {
		return 1, err
	}
	say("the listener is fixed; an operator requested a replay of the dead letter (actor demo, reason DEMO-1)")

	if err := testhost.WaitFor(ctx, 90*time.Second, "every consumer to catch up", func() (bool, error) {
		st, err := admin.Status(ctx, outbox.StatusFilter{})
		if err != nil {
			return false, err
		}
		open, err := admin.DeadLetters(ctx, outbox.StatusFilter{})
		if err != nil || len(open) > 0 {
			return false, err
		}
		for _, s := range st {
			if s.LagEvents > 0 || s.Head < tasksPerProject {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		return 1, err
	}
	if err := testhost.WaitFor(ctx, 30*time.Second, "the child worker to apply every deletion", func() (bool, error) {
		r, err := readAppliedLog(worker.logPath)
		return len(r.applied) >= tasksPerProject*len(projects), err
	}); err != nil {
		say("%v", err)
	}
	if err := testhost.WaitFor(ctx, 10*time.Second, "the event-stream client to see every deletion", func() (bool, error) {
		n, _, _, _, _ := seen.snapshot()
		return n >= tasksPerProject*len(projects), nil
	}); err != nil {
		say("%v", err)
	}
	if linger > 0 {
		say("lingering %s: the operations page stays up at http://%s/ops/", linger, addr)
		select {
		case <-time.After(linger):
		case <-ctx.Done():
			return 1, ctx.Err()
		}
	}
	stopSSE()
	if err := <-sseDone; err != nil {
		return 1, fmt.Errorf("remote viewer: %w", err)
	}
	printMetrics(ctx, "http://"+addr+"/metrics", observers[0])
	for _, o := range append([]*observerSpec{worker}, observers...) {
		stopCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
		err := o.proc.stop(stopCtx)
		cancel()
		if err != nil {
			return 1, fmt.Errorf("stop %s: %w", o.name, err)
		}
	}
	return report(ctx, pool, admin, append(observers, worker), seen, time.Since(started))
}

func createDatabase(ctx context.Context, adminDSN, name string) error {
	conn, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	return err
}

func ackedAtLeast(ctx context.Context, admin *outbox.Admin, consumer string, n int) (bool, error) {
	st, err := admin.Status(ctx, outbox.StatusFilter{ConsumerID: consumer})
	if err != nil {
		return false, err
	}
	var total int64
	for _, s := range st {
		if s.Cursor != nil {
			total += *s.Cursor
		}
	}
	return total >= int64(n), nil
}

// consumerReport is what one observer's own log and the database say about it.
type consumerReport struct {
	name       string
	applied    map[string]bool
	perProject map[string]int // events first applied, by project
	duplicates int
	inOrder    bool
	parked     int
	replayed   int
	lag        int64
	lost       int
}

func report(ctx context.Context, pool *pgxpool.Pool, admin *outbox.Admin, observers []*observerSpec, seen *streamSeen, elapsed time.Duration) (int, error) {
	// Every event a writer recorded is in the log, numbered or not; the stream numbered before
	// schema 18 is empty in a database the demo created.
	rows, err := pool.Query(ctx, `SELECT lifecycle_event_id(task_id, deleted_at) FROM lifecycle_event_log`)
	if err != nil {
		return 1, err
	}
	written, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 1, err
	}
	var deleted int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE deleted_at IS NOT NULL`).Scan(&deleted); err != nil {
		return 1, err
	}
	if deleted != len(written) {
		return 1, fmt.Errorf("%d tasks deleted but %d events written", deleted, len(written))
	}
	status, err := admin.Status(ctx, outbox.StatusFilter{})
	if err != nil {
		return 1, err
	}
	var reports []consumerReport
	lostTotal := 0
	for _, o := range observers {
		r, err := readAppliedLog(o.logPath)
		if err != nil {
			return 1, err
		}
		r.name = o.consumer
		for _, id := range written {
			if !r.applied[id] {
				r.lost++
			}
		}
		for _, s := range status {
			if s.ConsumerID == o.consumer {
				r.lag += s.LagEvents
			}
		}
		if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE parked_at IS NOT NULL), count(*) FILTER (WHERE state = 'resolved' AND replay_requested_at IS NOT NULL)
			FROM lifecycle_consumer_deliveries WHERE consumer_id = $1`, o.consumer).Scan(&r.parked, &r.replayed); err != nil {
			return 1, err
		}
		lostTotal += r.lost
		reports = append(reports, r)
	}
	var audits int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM run_audit WHERE action LIKE 'lifecycle-observation:%'`).Scan(&audits); err != nil {
		return 1, err
	}

	fmt.Println()
	tw := tabwriter.NewWriter(os.Stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CONSUMER\tOBSERVED\tDUPLICATES SUPPRESSED\tDEAD LETTERS (PARKED/REPLAYED)\tLAG\tIN SEQUENCE ORDER\tLOST")
	var observed []string
	for _, r := range reports {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d/%d\t%d\t%t\t%d\n", r.name, len(r.applied), r.duplicates, r.parked, r.replayed, r.lag, r.inOrder, r.lost)
		observed = append(observed, fmt.Sprintf("%s:%d", r.name, len(r.applied)))
	}
	_ = tw.Flush()
	streamed, dups, gaps, resets, conns := seen.snapshot()
	fmt.Printf("\nrun-audit rows written by observers: %d (poisoned + replayed)\n", audits)
	fmt.Printf("event stream: the remote viewer saw %d deletions over %d connections (it resumed across the dashboard's SIGKILL): duplicates %d, gaps %d, resets %d\n",
		streamed, conns, dups, gaps, resets)
	fmt.Printf("demo: written=%d observed=%s lost=%d (%s)\n", len(written), strings.Join(observed, ","), lostTotal, elapsed.Round(time.Second))
	if lostTotal > 0 {
		return 1, errLost
	}
	if dups > 0 || gaps > 0 {
		return 1, errors.New("the event stream repeated or skipped events")
	}
	for _, r := range reports {
		if !r.inOrder {
			return 1, errors.New("an observer applied events out of sequence order")
		}
	}
	return 0, nil
}

// readAppliedLog reads an observer's log: what it applied, what it suppressed as duplicates,
// and whether first applications came in sequence order per project (a replayed dead letter
// is the one legitimate exception).
func readAppliedLog(path string) (consumerReport, error) {
	r := consumerReport{applied: map[string]bool{}, perProject: map[string]int{}, inOrder: true}
	f, err := os.Open(path)
	if err != nil {
		return r, err
	}
	defer f.Close()
	last := map[string]int64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var l testhost.ApplyRecord
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return r, fmt.Errorf("%s: %w", path, err)
		}
		switch l.Kind {
		case "duplicate":
			r.duplicates++
			continue
		case "fence-violated":
			return r, fmt.Errorf("%s: an observer performed a writer-owned side effect for %s", path, l.EventID)
		case "applied":
		default:
			continue // fence-refused: the fence held
		}
		if !r.applied[l.EventID] {
			r.perProject[l.Project]++
		}
		r.applied[l.EventID] = true
		if !l.Replay {
			if l.Sequence <= last[l.Project] {
				r.inOrder = false
			}
			last[l.Project] = l.Sequence
		}
	}
	return r, sc.Err()
}

// printMetrics shows the dashboard's lag and dead-letter gauges and its dispatch counters as
// Prometheus serves them. The counters are the serving process's, since it started: the
// dashboard was killed and restarted, so beside each one goes the demo's own count of what the
// dashboard applied in that project across all its processes, from its applied log.
func printMetrics(ctx context.Context, url string, dashboard *observerSpec) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		say("metrics unavailable: %v", err)
		return
	}
	defer resp.Body.Close()
	applied, err := readAppliedLog(dashboard.logPath)
	if err != nil {
		say("metrics: %v", err)
		return
	}
	lines, err := metricsExcerpt(resp.Body, dashboard.consumer, applied.perProject)
	if err != nil {
		say("metrics: %v", err)
		return
	}
	say("from the dashboard's /metrics (its counters count since this dashboard process started, i.e. since the restart; beside each, the demo's own count over every dashboard process):")
	for _, l := range lines {
		fmt.Println("    " + l)
	}
}

// metricsExcerpt picks the lag, dead-letter and dispatch lines out of a /metrics body, and
// marks each of consumer's delivered counters with what the demo counted for its project
// (appliedByProject) over all of consumer's processes.
func metricsExcerpt(body io.Reader, consumer string, appliedByProject map[string]int) ([]string, error) {
	var out []string
	sc := bufio.NewScanner(body)
	for sc.Scan() {
		line := sc.Text()
		for _, name := range []string{"outbox_consumer_lag_events{", "outbox_dead_letters_outstanding{", "outbox_events_dispatched_total{"} {
			if !strings.HasPrefix(line, name) {
				continue
			}
			if name == "outbox_events_dispatched_total{" && metricLabel(line, "consumer") == consumer {
				if metricLabel(line, "outcome") == "delivered" {
					line += fmt.Sprintf("   (this process; %s applied %d in %s over all its processes)",
						consumer, appliedByProject[metricLabel(line, "project")], metricLabel(line, "project"))
				} else {
					line += "   (this process)"
				}
			}
			out = append(out, line)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read metrics: %w", err)
	}
	return out, nil
}

// metricLabel is a label's value in a line of the Prometheus text format, "" without it.
func metricLabel(line, label string) string {
	_, rest, ok := strings.Cut(line, "{"+label+`="`)
	if !ok {
		_, rest, ok = strings.Cut(line, ","+label+`="`)
	}
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, `"`)
	return v
}
