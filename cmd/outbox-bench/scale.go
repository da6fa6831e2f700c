package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox"
)

// The scale curves, one JSON line per point.
const (
	curveIdleConsumers = "idle_statements_vs_consumers"
	curveIdleProjects  = "idle_statements_vs_projects"
	curveDrainBacklog  = "drain_vs_backlog"
)

var allCurves = []string{curveIdleConsumers, curveIdleProjects, curveDrainBacklog}

func init() {
	register(benchCase{name: "scale", usage: "curves: idle statements/s against consumers and projects, drain rate against backlog size",
		flags: func(fs *flag.FlagSet) runner {
			o := defaultScaleOpts()
			fs.StringVar(&o.curves, "curves", o.curves, "curves to measure, comma-separated")
			fs.StringVar(&o.consumers, "consumers", o.consumers, "idle_statements_vs_consumers: consumer counts (each observes the same one project)")
			fs.StringVar(&o.projects, "projects", o.projects, "idle_statements_vs_projects: projects one consumer observes")
			fs.StringVar(&o.backlogs, "backlogs", o.backlogs, "drain_vs_backlog: unsequenced backlog sizes, each N or N:deletes-per-prewrite-transaction")
			fs.IntVar(&o.maxBacklog, "max-backlog", o.maxBacklog, "drain_vs_backlog: skip sizes above this (0: none), for quick runs")
			fs.IntVar(&o.prewriteWriters, "prewrite-writers", o.prewriteWriters, "drain_vs_backlog: goroutines writing each backlog")
			fs.DurationVar(&o.settle, "settle", o.settle, "idle curves: wait after every cursor is positioned, before the window")
			fs.DurationVar(&o.window, "window", o.window, "idle curves: measurement window (default: one heartbeat interval, so each window holds one lease renewal per consumer)")
			return func(ctx context.Context, env *Env, emit func(any) error) error { return runScale(ctx, env, o, emit) }
		}})
}

type scaleOpts struct {
	curves, consumers, projects, backlogs string
	maxBacklog, prewriteWriters           int
	settle, window                        time.Duration
}

func defaultScaleOpts() scaleOpts {
	return scaleOpts{curves: curveIdleConsumers + "," + curveIdleProjects + "," + curveDrainBacklog,
		consumers: "1,4,16,64", projects: "1,100,1000,10000", backlogs: "10000,100000,1000000:50",
		prewriteWriters: defaultBacklog().writers, settle: 2 * time.Second,
		window: outbox.Config{}.WithDefaults().HeartbeatInterval}
}

// scaleLine is one point of a curve: x is the point's value (consumers, projects or backlog
// events), y the curve's measure, named by y_name; the embedded part describes the point.
type scaleLine struct {
	Header
	Curve string  `json:"curve"`
	X     int     `json:"x"`
	Y     float64 `json:"y"`
	YName string  `json:"y_name"`
	*IdlePoint
	*DrainPoint
}

// IdlePoint is what K consumers cost the database while nothing happens.
type IdlePoint struct {
	Consumers int `json:"consumers"`
	// Projects is how many projects each consumer observes (the same ones for every consumer).
	Projects      int     `json:"projects"`
	StartSeconds  float64 `json:"start_seconds"` // from Start until every cursor was positioned
	WindowSeconds float64 `json:"window_seconds"`
	// Source is where the server-side count comes from: "pg_stat_statements" (statements in
	// this database, the bench's own reads of the view left out) or, without the extension,
	// "pg_stat_database" (transactions, which backends report at most once a second, so only
	// approximate over a short window; the bench's two reads are included).
	Source string `json:"source"`
	// Top-level statements (what the consumers sent) and all statements (with those that
	// functions such as the ticker and the reader ran) per second; -1 without pg_stat_statements.
	StatementsPerS       float64 `json:"statements_per_s"`
	NestedStatementsPerS float64 `json:"statements_with_nested_per_s"`
	XactsPerS            float64 `json:"xacts_per_s,omitempty"`
	// ClientStatementsPerS counts what the consumers' pools sent, from the driver's tracer.
	ClientStatementsPerS float64 `json:"client_statements_per_s"`
	// ServerCPUMSPerS is the server's CPU (all its processes) per second of the window.
	ServerCPUMSPerS float64 `json:"server_cpu_ms_per_s"`
	// Ticks is how many ticks were stored during the window: none, since nothing committed (a
	// tick is taken only when something did).
	Ticks int64 `json:"ticks"`
}

// DrainPoint is one drain of an unsequenced backlog (see the drain case).
type DrainPoint struct {
	Backlog
	Events               int     `json:"events"`
	Received             int     `json:"received"`
	Duplicates           int     `json:"duplicates"`
	Missing              int     `json:"missing"`
	Seconds              float64 `json:"seconds"`
	EventsPerS           float64 `json:"events_per_s"`
	CursorDurableSeconds float64 `json:"cursor_durable_seconds"`
	PeakRSSMB            float64 `json:"peak_rss_mb"`
	TimedOut             bool    `json:"timed_out,omitempty"`
}

func atoiList(what, list string) ([]int, error) {
	var out []int
	for _, s := range splitList(list) {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("scale: bad %s %q", what, s)
		}
		out = append(out, n)
	}
	return out, nil
}

func runScale(ctx context.Context, env *Env, o scaleOpts, emit func(any) error) error {
	if o.window <= 0 || o.settle < 0 || o.prewriteWriters < 1 {
		return errors.New("scale: need window > 0, settle >= 0 and prewrite-writers >= 1")
	}
	want := map[string]bool{}
	for _, c := range splitList(o.curves) {
		known := false
		for _, k := range allCurves {
			known = known || c == k
		}
		if !known {
			return fmt.Errorf("scale: unknown curve %q (curves: %v)", c, allCurves)
		}
		want[c] = true
	}
	consumers, err := atoiList("consumer count", o.consumers)
	if err != nil {
		return err
	}
	projects, err := atoiList("project count", o.projects)
	if err != nil {
		return err
	}
	sizes, err := parseSizes(o.backlogs)
	if err != nil && want[curveDrainBacklog] {
		return fmt.Errorf("scale: %w", err)
	}
	if want[curveIdleConsumers] {
		for _, k := range consumers {
			if err := emitIdle(ctx, env, o, curveIdleConsumers, k, 1, k, emit); err != nil {
				return err
			}
		}
	}
	if want[curveIdleProjects] {
		for _, p := range projects {
			if err := emitIdle(ctx, env, o, curveIdleProjects, 1, p, p, emit); err != nil {
				return err
			}
		}
	}
	if want[curveDrainBacklog] {
		for _, s := range sizes {
			if o.maxBacklog > 0 && s.events > o.maxBacklog {
				env.Logf("scale: skipping the backlog of %d events (-max-backlog %d)", s.events, o.maxBacklog)
				continue
			}
			line, err := drainPoint(ctx, env, s, o.prewriteWriters)
			if err != nil {
				return err
			}
			if err := emit(line); err != nil {
				return err
			}
		}
	}
	return nil
}

func emitIdle(ctx context.Context, env *Env, o scaleOpts, curve string, consumers, projects, x int, emit func(any) error) error {
	h := env.Header("scale")
	p, err := idlePoint(ctx, env, o, consumers, projects)
	if err != nil {
		return err
	}
	line := scaleLine{Header: h, Curve: curve, X: x, IdlePoint: &p}
	if p.Source == "pg_stat_statements" {
		line.Y, line.YName = p.StatementsPerS, "statements_per_s"
	} else {
		line.Y, line.YName = p.XactsPerS, "xacts_per_s"
	}
	return emit(line)
}

// idlePoint starts consumers (default settings, one pool each, all observing the same
// projects), waits until every cursor is positioned and then settle, and counts what the
// database executes over the window while nothing is written.
func idlePoint(ctx context.Context, env *Env, o scaleOpts, consumers, projects int) (IdlePoint, error) {
	p := IdlePoint{Consumers: consumers, Projects: projects, StatementsPerS: -1, NestedStatementsPerS: -1}
	db, admin, closeDB, err := env.NewDBPool(ctx, "scale_idle", 2)
	if err != nil {
		return p, err
	}
	defer closeDB()
	stats := openStatStatements(ctx, admin)
	server := findServer(ctx, admin)
	names := make([]string, projects)
	for i := range names {
		names[i] = projectName(i)
	}
	counter := &stampTracer{}
	specs := make([]consumerSpec, consumers)
	ids := make([]string, consumers)
	for k := range specs {
		ids[k] = fmt.Sprintf("bench-idle-%d", k)
		specs[k] = consumerSpec{id: ids[k], projects: names, tracer: counter}
	}
	env.Logf("scale: %d idle consumer(s) of %d project(s)", consumers, projects)
	started := time.Now()
	running, err := startConsumers(ctx, db, specs)
	if err != nil {
		return p, err
	}
	defer closeConsumers(running)
	timeout := time.Minute + time.Duration(consumers*projects)*10*time.Millisecond
	if err := waitPositioned(ctx, outbox.NewAdmin(admin, outbox.AdminOptions{}), ids, consumers*projects, timeout); err != nil {
		return p, fmt.Errorf("scale: %w", err)
	}
	p.StartSeconds = seconds(time.Since(started))
	sleepCtx(ctx, o.settle)

	var top0, all0, x0 int64
	if stats.ok {
		p.Source = "pg_stat_statements"
		top0, all0, err = stats.calls(ctx)
	} else {
		p.Source = "pg_stat_database"
		env.Logf("scale: pg_stat_statements unavailable (%s); counting transactions from pg_stat_database", stats.why)
		x0, err = xacts(ctx, admin)
	}
	if err != nil {
		return p, err
	}
	tick0, err := newestTick(ctx, admin)
	if err != nil {
		return p, err
	}
	client0 := counter.statements.Load()
	cpu := startCPU(server)
	t0 := time.Now()
	sleepCtx(ctx, o.window)
	window := time.Since(t0)
	_, serverCPU := cpu.Stop()
	client := counter.statements.Load() - client0
	tick, err := newestTick(ctx, admin)
	if err != nil {
		return p, err
	}
	p.Ticks = tick - tick0
	if stats.ok {
		top, all, err := stats.calls(ctx)
		if err != nil {
			return p, err
		}
		p.StatementsPerS, p.NestedStatementsPerS = perSecond(top-top0, window), perSecond(all-all0, window)
	} else {
		x, err := xacts(ctx, admin)
		if err != nil {
			return p, err
		}
		p.XactsPerS = perSecond(x-x0, window)
	}
	p.WindowSeconds = seconds(window)
	p.ClientStatementsPerS = perSecond(client, window)
	p.ServerCPUMSPerS = round3(float64(serverCPU.Microseconds()) / 1000 / window.Seconds())
	return p, ctx.Err()
}

// newestTick is the newest stored tick's ID (the tick table always holds one).
func newestTick(ctx context.Context, db *pgxpool.Pool) (int64, error) {
	var id int64
	if err := db.QueryRow(ctx, `SELECT max(tick_id) FROM lifecycle_tick`).Scan(&id); err != nil {
		return 0, fmt.Errorf("read the newest tick: %w", err)
	}
	return id, nil
}

// drainPoint drains an unsequenced backlog of s.events written by the host's deletes.
func drainPoint(ctx context.Context, env *Env, s sizeSpec, writers int) (scaleLine, error) {
	h := env.Header("scale")
	r, err := runDrain(ctx, env, drainOpts{events: s.events, batch: 1000, poll: time.Second,
		backlog: backlogOpts{kind: backlogUnsequenced, perTx: s.perTx, writers: writers}})
	if err != nil {
		return scaleLine{}, err
	}
	return drainScaleLine(h, r), nil
}

// drainScaleLine is a drain's result as a point of the drain_vs_backlog curve.
func drainScaleLine(h Header, r drainResult) scaleLine {
	h.Bench = "scale"
	d := &DrainPoint{Backlog: r.Backlog, Events: r.Events, Received: r.Received, Duplicates: r.Duplicates, Missing: r.Missing,
		Seconds: r.Seconds, EventsPerS: r.EventsPerS, CursorDurableSeconds: r.CursorDurableSeconds, PeakRSSMB: r.PeakRSSMB, TimedOut: r.TimedOut}
	return scaleLine{Header: h, Curve: curveDrainBacklog, X: r.Events, Y: r.EventsPerS, YName: "events_per_s", DrainPoint: d}
}
