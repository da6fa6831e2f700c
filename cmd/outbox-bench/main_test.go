package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"

	"fusion/outbox/internal/pgcluster"
	"fusion/outbox/internal/pgtest"
)

// These tests run every case at tiny sizes on the test harness's PostgreSQL: they keep the
// benchmark compiling and check that what it reports is computed, not assumed. The figures
// themselves mean nothing here (the test cluster is not durable).

func TestMain(m *testing.M) {
	drainWaitBase = 3 * time.Minute // a deadline to give up at, not a measure: generous for a busy machine
	pgtest.Main(m)
}

// testEnv gives each case fresh migrated databases from the test harness.
func testEnv(t *testing.T) *Env {
	t.Helper()
	cfg, err := pgx.ParseConfig(pgtest.NewDB(t).URL)
	require.NoError(t, err)
	h, err := newHeader(ctxT(t), cfg)
	require.NoError(t, err)
	return &Env{header: h, logf: t.Logf, newDB: func(ctx context.Context, _ string) (*DB, error) {
		return existingDB(ctx, pgtest.NewDB(t).URL)
	}}
}

// ctxT bounds a case: generously, since it only says when to give up, and a busy machine runs
// a case many times slower than an idle one.
func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

var headerKeys = []string{"bench", "lib", "lib_version", "driver", "go", "pg"}

// line prints v as the program does and parses it back, checking the header comes first.
func line(t *testing.T, v any, bench string) map[string]any {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, printLine(&buf, v))
	require.Equal(t, 1, strings.Count(buf.String(), "\n"), "one JSON line")
	dec := json.NewDecoder(bytes.NewReader(buf.Bytes()))
	_, err := dec.Token() // {
	require.NoError(t, err)
	for _, want := range headerKeys {
		key, err := dec.Token()
		require.NoError(t, err)
		require.Equal(t, want, key)
		_, err = dec.Token()
		require.NoError(t, err)
	}
	var m map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &m))
	require.Equal(t, bench, m["bench"])
	require.Equal(t, "outbox", m["lib"])
	require.NotEmpty(t, m["lib_version"])
	require.True(t, strings.HasPrefix(m["driver"].(string), "pgx/v5 v5."), m["driver"])
	require.NotEmpty(t, m["pg"])
	return m
}

func num(t *testing.T, m map[string]any, key string) float64 {
	t.Helper()
	v, ok := m[key].(float64)
	require.True(t, ok, "field %s missing or not a number: %v", key, m[key])
	return v
}

func TestWrite(t *testing.T) {
	t.Parallel()
	for _, mailbox := range []string{mailboxExcluded, mailboxIncluded} {
		r, err := runWrite(ctxT(t), testEnv(t), writeOpts{writers: 2, events: 40, projects: 2, mailbox: mailbox, notify: true})
		require.NoError(t, err)
		m := line(t, r, "write")
		for _, side := range []string{"baseline", "outbox"} {
			s := m[side].(map[string]any)
			require.EqualValues(t, 40, num(t, s, "tx"), side)
			require.Zero(t, num(t, s, "errors"), side)
			require.Positive(t, num(t, s, "tx_per_s"), side)
		}
		require.Positive(t, num(t, m, "outbox_vs_baseline"))
		require.Equal(t, "*", m["writer_grants"])
	}
}

// With -grants the writer role holds its projects one by one, not '*', and every delete of
// the outbox side still records its event.
func TestWriteWithProjectsGrantedOneByOne(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	env := testEnv(t)
	r, err := runWrite(ctx, env, writeOpts{writers: 2, events: 40, projects: 2, mailbox: mailboxExcluded, notify: true, grants: 50})
	require.NoError(t, err)
	m := line(t, r, "write")
	require.Equal(t, "50", m["writer_grants"])
	for _, side := range []string{"baseline", "outbox"} {
		s := m[side].(map[string]any)
		require.EqualValues(t, 40, num(t, s, "tx"), side)
		require.Zero(t, num(t, s, "errors"), side)
	}
	for _, bad := range []int{-1, 1} {
		_, err := runWrite(ctx, env, writeOpts{writers: 2, events: 40, projects: 2, mailbox: mailboxExcluded, grants: bad})
		require.Error(t, err, "grants %d", bad)
	}

	// What the role holds afterwards: the 50 projects, not '*'.
	db, err := env.NewDB(ctx, "grants")
	require.NoError(t, err)
	admin, err := db.Pool(ctx, 1, nil)
	require.NoError(t, err)
	defer admin.Close()
	writer, err := db.WriterPool(ctx, 1, nil)
	require.NoError(t, err)
	defer writer.Close()
	require.NoError(t, grantOneByOne(ctx, admin, writer, 2, 50))
	var n, every int
	require.NoError(t, writer.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE project_id = '*') FROM lifecycle_project_access
		WHERE role_name = current_user`).Scan(&n, &every))
	require.Equal(t, 50, n)
	require.Zero(t, every)
}

// The host's deletes and the consumers run as the roles the README prescribes, which row-level
// security and column privileges bind: not as the superuser that sets the case up.
func TestComponentPoolsRunAsBoundRoles(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	env := testEnv(t)
	require.Equal(t, componentRoles, env.Header("write").Roles)
	db, err := env.NewDB(ctx, "roles")
	require.NoError(t, err)
	for name, open := range map[string]func(context.Context, int32, pgx.QueryTracer) (*pgxpool.Pool, error){
		"writer": db.WriterPool, "consumer": db.ConsumerPool, "operator": db.OperatorPool,
	} {
		pool, err := open(ctx, 1, nil)
		require.NoError(t, err, name)
		var user string
		var super, bypass bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT current_user, rolsuper, rolbypassrls FROM pg_roles WHERE rolname = current_user`).
			Scan(&user, &super, &bypass), name)
		require.Contains(t, user, name, name)
		require.False(t, super, name)
		require.False(t, bypass, name)
		pool.Close()
	}
	// The writer may insert into the event log but not read the consumers' cursors.
	writer, err := db.WriterPool(ctx, 1, nil)
	require.NoError(t, err)
	defer writer.Close()
	_, err = writer.Exec(ctx, `SELECT 1 FROM lifecycle_consumer_cursors`)
	require.ErrorContains(t, err, "permission denied")
}

// requireBacklog checks how a line says its backlog was written.
func requireBacklog(t *testing.T, m map[string]any, kind string, perTx int) {
	t.Helper()
	require.Equal(t, kind, m["backlog"])
	require.EqualValues(t, perTx, num(t, m, "prewrite_per_tx"))
	if kind == backlogUnsequenced {
		require.Equal(t, prewriteHost, m["prewrite"])
		require.Positive(t, num(t, m, "prewrite_writers"))
	} else {
		require.Equal(t, prewriteBulk, m["prewrite"])
	}
	require.Positive(t, num(t, m, "prewrite_seconds"))
}

func TestSequence(t *testing.T) {
	t.Parallel()
	for _, perTx := range []int{1, 7} {
		b := defaultBacklog()
		b.perTx, b.writers = perTx, 3
		r, err := runSequence(ctxT(t), testEnv(t), sequenceOpts{events: 601, projects: 2, backlog: b})
		require.NoError(t, err)
		m := line(t, r, "sequence")
		require.EqualValues(t, 601, num(t, m, "numbered"))
		require.Positive(t, num(t, m, "numbering_events_per_s"))
		requireBacklog(t, m, backlogUnsequenced, perTx)
		require.EqualValues(t, -1, num(t, m, "copy_floor_rows_per_s"), "no floor for a backlog in several projects")
	}
	r, err := runSequence(ctxT(t), testEnv(t), sequenceOpts{events: 601, projects: 1, backlog: defaultBacklog()})
	require.NoError(t, err)
	m := line(t, r, "sequence")
	require.EqualValues(t, 601, num(t, m, "numbered"))
	require.Positive(t, num(t, m, "copy_floor_rows_per_s"))
	require.InDelta(t, num(t, m, "numbering_events_per_s")/num(t, m, "copy_floor_rows_per_s"), num(t, m, "vs_copy_floor"), 0.01)
}

func TestDrain(t *testing.T) {
	t.Parallel()
	for _, b := range []backlogOpts{
		{kind: backlogUnsequenced, perTx: 1, writers: 4},
		{kind: backlogUnsequenced, perTx: 50, writers: 2},
		{kind: backlogSequenced, perTx: 1, writers: 1},
	} {
		r, err := runDrain(ctxT(t), testEnv(t), drainOpts{events: 1500, batch: 1000, poll: time.Second, backlog: b})
		require.NoError(t, err)
		m := line(t, r, "drain")
		perTx := b.perTx
		if b.kind == backlogSequenced {
			perTx = 0
		}
		requireBacklog(t, m, b.kind, perTx)
		require.EqualValues(t, 1500, num(t, m, "received"), b)
		require.Zero(t, num(t, m, "duplicates"), b)
		require.Zero(t, num(t, m, "missing"), b)
		require.Nil(t, m["timed_out"], b)
		require.Positive(t, num(t, m, "cursor_durable_seconds"), b)
		require.Positive(t, num(t, m, "peak_rss_mb"), b)
		requirePhaseCPU(t, m, 1500)
	}
}

// requirePhaseCPU checks a drain's or fanout's CPU figures against each other: the test's
// server runs on this machine, so its CPU is measured (not -1; a short run's can be 0, as
// /proc counts in ticks of 10ms).
func requirePhaseCPU(t *testing.T, m map[string]any, deliveries float64) {
	t.Helper()
	client, server, elapsed := num(t, m, "client_cpu_seconds"), num(t, m, "server_cpu_seconds"), num(t, m, "seconds")
	require.GreaterOrEqual(t, server, 0.0)
	perDelivery, busy := (client+server)*1e6/deliveries, (client+server)/elapsed
	require.InDelta(t, perDelivery, num(t, m, "cpu_us_per_delivery"), 0.05*perDelivery+1)
	require.InDelta(t, busy, num(t, m, "cpus_busy"), 0.05*busy+0.01)
}

func TestFanout(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{backlogUnsequenced, backlogSequenced} {
		b := defaultBacklog()
		b.kind = kind
		r, err := runFanout(ctxT(t), testEnv(t), fanoutOpts{consumers: 3, events: 500, backlog: b})
		require.NoError(t, err)
		m := line(t, r, "fanout")
		require.Equal(t, kind, m["backlog"])
		require.EqualValues(t, 1500, num(t, m, "received_total"), kind)
		require.Zero(t, num(t, m, "duplicates"), kind)
		require.Zero(t, num(t, m, "missing"), kind)
		requirePhaseCPU(t, m, 1500)
	}
}

// statsEnv runs cases on a throwaway cluster of their own started as the bench starts its
// own (pg_stat_statements loaded, see clusterOptions), without the durable settings.
func statsEnv(t *testing.T) *Env {
	t.Helper()
	ctx := ctxT(t)
	c, err := pgcluster.Start(ctx, clusterOptions(false))
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("start a cluster with pg_stat_statements: %v", err)
		}
		t.Skipf("no throwaway cluster: %v", err)
	}
	t.Cleanup(c.Stop)
	env, err := NewServerEnv(ctx, c.URL("postgres"), t.Logf)
	require.NoError(t, err)
	return env
}

// sustainedSmall is a short sustained run; the figures mean nothing, the counts must hold.
var sustainedSmall = sustainedOpts{writers: 4, consumers: 2, projects: 3, seconds: 0.4, tasks: 20000, mailbox: mailboxIncluded}

func requireSustained(t *testing.T, m map[string]any) {
	t.Helper()
	tx := num(t, m, "tx")
	require.Positive(t, tx)
	require.EqualValues(t, 2*tx, num(t, m, "received"), "every committed delete reached both consumers")
	require.Zero(t, num(t, m, "missing"))
	require.Zero(t, num(t, m, "duplicates"))
	require.Zero(t, num(t, m, "errors"))
	require.Nil(t, m["unexpected"])
	require.Nil(t, m["timed_out"])
	require.Nil(t, m["tasks_exhausted"])
	for _, k := range []string{"baseline_tx", "baseline_tx_per_s", "tx_per_s", "ratio", "lag_p50_ms", "lag_p99_ms", "delete_p50_ms", "baseline_delete_p50_ms"} {
		require.Positive(t, num(t, m, k), k)
	}
	require.GreaterOrEqual(t, num(t, m, "lag_p99_ms"), num(t, m, "lag_p50_ms"))
	require.Contains(t, m, "load_1m")
}

// growWindow runs a case with a window of first seconds, doubled up to 8 times first until
// seen finds in its line the figures that need the window to hold an event: the window is real
// time, and on a busy machine a short one can end before the consumers' first scan, tick or
// read (a 400ms sustained run once counted no sequencer call). It returns the last
// line; the caller's assertions fail on it if the longest window held none either.
func growWindow(t *testing.T, first float64, run func(seconds float64) map[string]any, seen func(map[string]any) bool) map[string]any {
	t.Helper()
	for seconds := first; ; seconds *= 2 {
		m := run(seconds)
		if seen(m) || seconds >= 8*first {
			return m
		}
		t.Logf("a %gs window held too little on this machine; doubling it", seconds)
	}
}

// sustainedLine runs the sustained case (sustainedSmall, its window grown as growWindow does
// until seen finds what it needs in the line, and both phases committed deletes) and checks
// the counts.
func sustainedLine(t *testing.T, env *Env, seen func(map[string]any) bool) map[string]any {
	t.Helper()
	m := growWindow(t, sustainedSmall.seconds, func(seconds float64) map[string]any {
		o := sustainedSmall
		o.seconds = seconds
		r, err := runSustained(ctxT(t), env, o)
		require.NoError(t, err)
		return line(t, r, "sustained")
	}, func(m map[string]any) bool { return num(t, m, "tx") > 0 && num(t, m, "baseline_tx") > 0 && seen(m) })
	requireSustained(t, m)
	return m
}

// TestSustainedOneProcess runs the consumers on one shared pool: the line says so, and the
// counts hold as with a pool each (requireSustained: nothing missing or duplicated).
func TestSustainedOneProcess(t *testing.T) {
	t.Parallel()
	env := testEnv(t)
	m := growWindow(t, sustainedSmall.seconds, func(seconds float64) map[string]any {
		o := sustainedSmall
		o.seconds, o.oneProcess = seconds, true
		r, err := runSustained(ctxT(t), env, o)
		require.NoError(t, err)
		return line(t, r, "sustained")
	}, func(m map[string]any) bool { return num(t, m, "tx") > 0 && num(t, m, "baseline_tx") > 0 })
	requireSustained(t, m)
	require.Equal(t, true, m["one_process"])
}

func TestSustainedWithStatStatements(t *testing.T) {
	t.Parallel()
	m := sustainedLine(t, statsEnv(t), func(m map[string]any) bool {
		return num(t, m, "numbering_calls") > 0 && num(t, m, "server_cpu_seconds") > 0 && num(t, m, "numbering_share") > 0
	})
	require.Equal(t, "pg_stat_statements total_exec_time / server CPU", m["numbering_share_source"])
	require.Positive(t, num(t, m, "numbering_calls"))
	require.Positive(t, num(t, m, "numbering_exec_ms"))
	require.Positive(t, num(t, m, "server_cpu_seconds"))
	require.Positive(t, num(t, m, "numbering_share"))
	require.GreaterOrEqual(t, num(t, m, "numbering_lock_wait_ms"), 0.0)
	require.LessOrEqual(t, num(t, m, "numbering_share_less_lock_wait"), num(t, m, "numbering_share"))
}

// TestSustainedWithoutStatStatements runs on the test harness's server, which does not load
// the extension: the share is -1 and the line says why.
func TestSustainedWithoutStatStatements(t *testing.T) {
	t.Parallel()
	m := sustainedLine(t, testEnv(t), func(map[string]any) bool { return true })
	require.EqualValues(t, -1, num(t, m, "numbering_share"))
	require.EqualValues(t, -1, num(t, m, "numbering_share_less_lock_wait"))
	require.Contains(t, m["numbering_share_source"], "unavailable")
}

// TestStandbyCurve runs the standby case small on a throwaway cluster of its own (the case
// starts a streaming standby of it): a run without consumers, then two consumers of one
// process (-one-process) reading from the primary and from the standby, each delivered every
// committed delete once.
func TestStandbyCurve(t *testing.T) {
	t.Parallel()
	c, err := pgcluster.Start(ctxT(t), clusterOptions(false))
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("start a cluster: %v", err)
		}
		t.Skipf("no throwaway cluster: %v", err)
	}
	t.Cleanup(c.Stop)
	env, err := NewServerEnv(ctxT(t), c.URL("postgres"), t.Logf)
	require.NoError(t, err)
	env.cluster = c
	var lines []map[string]any
	o := standbyOpts{consumers: "2", rate: 100, writers: 2, projects: 2, seconds: 1, rounds: 1, oneProcess: true}
	require.NoError(t, runStandbyCurve(ctxT(t), env, o, func(v any) error {
		lines = append(lines, line(t, v, "standby"))
		return nil
	}))
	require.Len(t, lines, 3)
	require.Equal(t, "none", lines[0]["read_from"])
	require.EqualValues(t, 0, num(t, lines[0], "consumers"))
	require.Nil(t, lines[0]["cpu_vs_no_consumers"])
	from := map[string]bool{}
	for _, m := range lines {
		require.Positive(t, num(t, m, "tx"))
		require.Zero(t, num(t, m, "errors"))
		require.Nil(t, m["timed_out"])
		if m["read_from"] == "none" {
			continue
		}
		from[m["read_from"].(string)] = true
		require.EqualValues(t, 2, num(t, m, "consumers"))
		require.Equal(t, true, m["one_process"])
		require.Equal(t, 2*num(t, m, "tx"), num(t, m, "received"), "every committed delete was delivered to each")
		require.Zero(t, num(t, m, "missing"))
		require.Zero(t, num(t, m, "duplicates"))
		require.Positive(t, num(t, m, "scans"))
		require.Positive(t, num(t, m, "primary_consumer_statements"))
		require.Positive(t, num(t, m, "lag_p99_ms"))
		require.Equal(t, "pg_stat_statements, the consumer role's top-level statements", m["statements_source"])
	}
	require.Equal(t, map[string]bool{"primary": true, "standby": true}, from)
}

// scaleLines runs the scale case and returns its lines by curve.
func scaleLines(t *testing.T, env *Env, o scaleOpts) map[string][]map[string]any {
	t.Helper()
	out := map[string][]map[string]any{}
	require.NoError(t, runScale(ctxT(t), env, o, func(v any) error {
		m := line(t, v, "scale")
		out[m["curve"].(string)] = append(out[m["curve"].(string)], m)
		return nil
	}))
	return out
}

// idleSeen says whether every idle point of lines counted the consumers' statements: the idle
// window is real time, and a busy machine can hold a consumer's next statement past its end.
func idleSeen(lines map[string][]map[string]any) bool {
	for _, curve := range []string{curveIdleConsumers, curveIdleProjects} {
		for _, m := range lines[curve] {
			if v, _ := m["client_statements_per_s"].(float64); v <= 0 {
				return false
			}
		}
	}
	return true
}

// scaleLinesGrowing is scaleLines with the idle window grown as growWindow does until every
// idle point counted the consumers' statements.
func scaleLinesGrowing(t *testing.T, env *Env, o scaleOpts) map[string][]map[string]any {
	t.Helper()
	var lines map[string][]map[string]any
	growWindow(t, o.window.Seconds(), func(seconds float64) map[string]any {
		o.window = time.Duration(seconds * float64(time.Second))
		lines = scaleLines(t, env, o)
		return nil
	}, func(map[string]any) bool { return idleSeen(lines) })
	return lines
}

func TestScale(t *testing.T) {
	t.Parallel()
	o := scaleOpts{curves: strings.Join(allCurves, ","), consumers: "1,2", projects: "1,3", backlogs: "400,500:10,100000",
		maxBacklog: 1000, prewriteWriters: 2, window: 1500 * time.Millisecond}
	lines := scaleLinesGrowing(t, statsEnv(t), o)
	for curve, xs := range map[string][]float64{curveIdleConsumers: {1, 2}, curveIdleProjects: {1, 3}} {
		require.Len(t, lines[curve], 2, curve)
		for i, m := range lines[curve] {
			require.EqualValues(t, xs[i], num(t, m, "x"), curve)
			require.Equal(t, "pg_stat_statements", m["source"], curve)
			require.Equal(t, "statements_per_s", m["y_name"], curve)
			require.Equal(t, num(t, m, "statements_per_s"), num(t, m, "y"), curve)
			for _, k := range []string{"statements_per_s", "statements_with_nested_per_s", "client_statements_per_s", "window_seconds", "start_seconds"} {
				require.Positive(t, num(t, m, k), "%s %s", curve, k)
			}
			require.Zero(t, num(t, m, "ticks"), "%s: an idle ticker stores no tick", curve)
		}
	}
	drains := lines[curveDrainBacklog]
	require.Len(t, drains, 2, "the 100000 backlog is over -max-backlog")
	for i, want := range []struct{ events, perTx int }{{400, 1}, {500, 10}} {
		m := drains[i]
		require.EqualValues(t, want.events, num(t, m, "x"))
		require.Equal(t, "events_per_s", m["y_name"])
		require.Positive(t, num(t, m, "y"))
		requireBacklog(t, m, backlogUnsequenced, want.perTx)
		require.EqualValues(t, want.events, num(t, m, "received"))
		require.Zero(t, num(t, m, "missing"))
		require.Zero(t, num(t, m, "duplicates"))
	}
}

// TestScaleWithoutStatStatements: the idle curves fall back to pg_stat_database and say so.
func TestScaleWithoutStatStatements(t *testing.T) {
	t.Parallel()
	o := scaleOpts{curves: curveIdleConsumers, consumers: "2", prewriteWriters: 1, window: 1500 * time.Millisecond}
	m := scaleLinesGrowing(t, testEnv(t), o)[curveIdleConsumers][0]
	require.Equal(t, "pg_stat_database", m["source"])
	require.Equal(t, "xacts_per_s", m["y_name"])
	require.EqualValues(t, -1, num(t, m, "statements_per_s"))
	require.GreaterOrEqual(t, num(t, m, "y"), 0.0)
	require.Positive(t, num(t, m, "client_statements_per_s"))
}

// TestLatency runs on the harness's server and on one with pg_stat_statements, where the line
// also says what the ticks and reads cost while the writers sent.
func TestLatency(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		env   func(*testing.T) *Env
		stats bool
	}{{"harness", testEnv, false}, {"pg_stat_statements", statsEnv, true}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			env := c.env(t)
			var sent float64
			// Scans, ticks and reads are counted while the writers send.
			m := growWindow(t, 0.5, func(seconds float64) map[string]any {
				r, err := runLatency(ctxT(t), env, latencyOpts{rate: 200, seconds: seconds, writers: 2})
				require.NoError(t, err)
				sent = 200 * seconds
				return line(t, r, "latency")
			}, func(m map[string]any) bool {
				return num(t, m, "scans_per_s") > 0 && num(t, m, "events_per_scan") > 0 && (!c.stats || num(t, m, "numbering_calls") > 0)
			})
			require.EqualValues(t, sent, num(t, m, "sent"))
			require.EqualValues(t, sent, num(t, m, "received"))
			require.Zero(t, num(t, m, "errors"))
			require.Zero(t, num(t, m, "duplicates"))
			require.Zero(t, num(t, m, "missing"))
			require.Positive(t, num(t, m, "p50_ms"))
			// The cycle: scans happened, and their period is the sending time over their count.
			scans := num(t, m, "scans_per_s")
			require.Positive(t, scans)
			require.InDelta(t, 1000/scans, num(t, m, "scan_period_ms"), 0.01*1000/scans+0.01)
			require.Positive(t, num(t, m, "events_per_scan"))
			if c.stats {
				require.Positive(t, num(t, m, "numbering_calls"))
				require.Positive(t, num(t, m, "numbering_exec_mean_ms"))
			}
		})
	}
}

// TestOOO: whichever transaction is held open, every event committed meanwhile is delivered,
// in order. The hold is shorter than the deletes take, as it was on a loaded machine when 4
// of 20 deletes committed after the release: the other transaction stays open until every
// delete committed.
func TestOOO(t *testing.T) {
	t.Parallel()
	for _, c := range []string{oooOutboxTx, oooUnrelatedTx} {
		r, err := runOOO(ctxT(t), testEnv(t), oooOpts{hold: time.Millisecond, events: 20, writers: 2}, c)
		require.NoError(t, err)
		m := line(t, r, "ooo")
		events := num(t, m, "events")
		require.Equal(t, num(t, m, "received"), events, c)
		require.Zero(t, num(t, m, "duplicates"), c)
		require.Zero(t, num(t, m, "missing"), c)
		require.Equal(t, true, m["in_seq_order"], c)
		require.EqualValues(t, 20, num(t, m, "committed_while_held"), c)
	}
}

// TestLongTx runs the longtx case short, held and as its control: the line has both windows
// and their ratios, every committed event arrived, and with -hold the unrelated transaction's
// xid was still open when the sending ended (and without it there was none).
func TestLongTx(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		env   func(*testing.T) *Env
		hold  bool
		stats bool
	}{{"held_pg_stat_statements", statsEnv, true, true}, {"control_harness", testEnv, false, false}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r, err := runLongTx(ctxT(t), c.env(t), longTxOpts{rate: 200, seconds: 3, window: 1, writers: 4, hold: c.hold})
			require.NoError(t, err)
			m := line(t, r, "longtx")
			require.Equal(t, c.hold, m["hold"])
			// A busy machine may leave deletes behind the schedule: they are counted, not sent.
			sent := num(t, m, "sent")
			require.Positive(t, sent)
			require.EqualValues(t, 600, sent+num(t, m, "behind_schedule"))
			require.GreaterOrEqual(t, num(t, m, "sending_seconds"), 3.0)
			require.Zero(t, num(t, m, "errors"))
			require.Equal(t, sent, num(t, m, "received"))
			require.Zero(t, num(t, m, "missing"))
			require.Zero(t, num(t, m, "duplicates"))
			require.Nil(t, m["unexpected"])
			require.Nil(t, m["timed_out"])
			require.Contains(t, m, "load_1m")
			require.Contains(t, m, "load_1m_end")
			require.EqualValues(t, 1, num(t, m, "window_seconds"))
			for _, k := range []string{"first_minute", "last_minute"} {
				w, ok := m[k].(map[string]any)
				require.True(t, ok, "%s is an object: %v", k, m[k])
				for _, f := range []string{"from_s", "seconds", "events", "events_per_s", "p50_ms", "p99_ms", "max_ms",
					"server_cpu_seconds", "server_cpu_us_per_delete", "scans_per_s", "numbering_calls", "numbering_exec_mean_ms"} {
					num(t, w, f)
				}
				require.GreaterOrEqual(t, num(t, w, "p99_ms"), num(t, w, "p50_ms"), k)
				// The harness's server runs on this machine: its CPU is read, not -1.
				require.GreaterOrEqual(t, num(t, w, "server_cpu_seconds"), 0.0, k)
				if c.stats {
					require.GreaterOrEqual(t, num(t, w, "numbering_calls"), 0.0, k)
				} else {
					require.EqualValues(t, -1, num(t, w, "numbering_calls"), k)
				}
			}
			first, last := m["first_minute"].(map[string]any), m["last_minute"].(map[string]any)
			require.Zero(t, num(t, first, "from_s"))
			require.GreaterOrEqual(t, num(t, last, "from_s"), 2.0, "the last window starts -window before the end")
			require.LessOrEqual(t, num(t, first, "events")+num(t, last, "events"), sent)
			num(t, m, "last_over_first_p99")
			num(t, m, "last_over_first_cpu")
			if c.stats {
				require.Equal(t, "pg_stat_statements", m["numbering_source"])
			} else {
				require.Contains(t, m["numbering_source"], "unavailable")
			}
			if c.hold {
				require.Positive(t, num(t, m, "held_xid"))
				require.Equal(t, true, m["held_open_at_end"], "the unrelated transaction was still open when the sending ended")
				require.Positive(t, num(t, m, "held_xid_age"), "the deletes took xids after the held one")
				require.GreaterOrEqual(t, num(t, m, "held_seconds"), 3.0)
			} else {
				require.Zero(t, num(t, m, "held_xid"))
				require.Equal(t, false, m["held_open_at_end"])
				require.EqualValues(t, -1, num(t, m, "held_xid_age"))
			}
		})
	}
	_, err := runLongTx(ctxT(t), testEnv(t), longTxOpts{rate: 200, seconds: 3, window: 2, writers: 2, hold: true})
	require.Error(t, err, "windows longer than half the run overlap")
}

func TestReconcile(t *testing.T) {
	t.Parallel()
	r, err := runReconcile(ctxT(t), testEnv(t), reconcileOpts{tasks: 500})
	require.NoError(t, err)
	require.EqualValues(t, 500, num(t, line(t, r, "reconcile"), "live_cached"))
}

func TestLimits(t *testing.T) {
	t.Parallel()
	r, err := runLimits(ctxT(t), testEnv(t), limitsOpts{writers: "1,2", events: "20,20", readEvents: 2500, page: 1000})
	require.NoError(t, err)
	m := line(t, r, "limits")
	require.Len(t, m["delete"], 2)
	for _, d := range m["delete"].([]any) {
		for _, side := range []string{"bare", "plus_insert", "plus_outbox_row"} {
			s := d.(map[string]any)[side].(map[string]any)
			require.EqualValues(t, 20, num(t, s, "tx"), side)
			require.Zero(t, num(t, s, "errors"), side)
		}
	}
	require.Positive(t, num(t, m, "read_rows_per_s"))
	require.Positive(t, num(t, m, "read_commit_rows_per_s"))
}

func TestRetention(t *testing.T) {
	t.Parallel()
	r, err := runRetention(ctxT(t), testEnv(t), retentionOpts{rows: 6000, writers: 2, tasks: 5000, before: 100 * time.Millisecond})
	require.NoError(t, err)
	m := line(t, r, "retention")
	require.EqualValues(t, 6000, num(t, m, "pruned"))
	require.EqualValues(t, 2, num(t, m, "batches"))
	require.Zero(t, num(t, m, "delete_errors"))
}

// TestCommandLine runs a case the way a user does, through -dsn, which creates (and drops)
// its own database on the server.
func TestCommandLine(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	err := run([]string{"-dsn", pgtest.AdminURL(t), "reconcile", "-tasks", "50"}, &out, io.Discard)
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(out.Bytes(), &m))
	require.Equal(t, "reconcile", m["bench"])
	require.EqualValues(t, 50, m["live_cached"])

	require.Error(t, run([]string{"-dsn", pgtest.AdminURL(t), "nosuchcase"}, io.Discard, io.Discard))
}

// The bench's databases are owned, with the module's objects, by a role that is not a
// superuser, as a deployment's schema owner is: the ticker runs as that owner, and the
// row-level security the tables force on it is then in the figures. The roles go with the
// database.
func TestServerEnvDatabasesHaveAnOwnerThatIsNotASuperuser(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	env := statsEnv(t)
	db, err := env.NewDB(ctx, "owner")
	require.NoError(t, err)
	watcher, err := env.NewDB(ctx, "owner_watch") // roles are the cluster's: seen from another database
	require.NoError(t, err)
	defer watcher.Drop()
	admin, err := watcher.Pool(ctx, 1, nil)
	require.NoError(t, err)
	defer admin.Close()

	pool, err := db.Pool(ctx, 1, nil)
	require.NoError(t, err)
	var tableOwner, tickerOwner string
	var super, bypass bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT r.rolname, r.rolsuper, r.rolbypassrls FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
		WHERE c.oid = 'lifecycle_event_log'::regclass`).Scan(&tableOwner, &super, &bypass))
	require.NoError(t, pool.QueryRow(ctx, `SELECT proowner::regrole::text FROM pg_proc
		WHERE oid = 'lifecycle_outbox_tick(text)'::regprocedure`).Scan(&tickerOwner))
	pool.Close()
	require.Equal(t, db.owner.name, tableOwner)
	require.Equal(t, tableOwner, tickerOwner, "the ticker runs as the owner")
	require.False(t, super)
	require.False(t, bypass)

	roles := []string{db.owner.name, db.writer.name, db.consumer.name, db.operator.name}
	const count = `SELECT count(*) FROM pg_roles WHERE rolname = ANY ($1)`
	var n int
	require.NoError(t, admin.QueryRow(ctx, count, roles).Scan(&n))
	require.Equal(t, len(roles), n)
	db.Drop()
	require.NoError(t, admin.QueryRow(ctx, count, roles).Scan(&n))
	require.Zero(t, n, "the database's roles were dropped with it")
}

// TestWarningsTo: a run's writers and consumers report warnings on stderr, and nothing below them.
func TestWarningsTo(t *testing.T) {
	var buf bytes.Buffer
	log := warningsTo(&buf)
	log.Info("scan done")
	log.Warn("consumer step failed; retrying on the next scan", zap.String("step", "sequence"))
	require.NoError(t, log.Sync())
	out := buf.String()
	require.NotContains(t, out, "scan done")
	require.Contains(t, out, "consumer step failed")
	require.Contains(t, out, `"step": "sequence"`)
}

// TestSince: a phase's server CPU never goes below zero. A process that ended just after the
// phase began once subtracted all its past from the phase (a fanout line read -42.5 µs of CPU
// per delivery); now only the processes running at the end count, each from when the phase began
// or from its start.
func TestSince(t *testing.T) {
	before := map[int]int64{1: 10, 2: 50, 4: 30}
	now := map[int]int64{1: 15, 2: 3, 3: 7} // 2 is a new process under a reused ID; 4 exited
	require.Equal(t, time.Duration(5+3+7)*clockTick, since(before, now))
	require.Zero(t, since(before, map[int]int64{}))
}
