package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"sync"
	"time"

	"fusion/outbox"
)

func init() {
	register(benchCase{name: "sequence", usage: "numbering rate of one tick over a backlog the host's deletes wrote while no consumer ran",
		flags: func(fs *flag.FlagSet) runner {
			o := sequenceOpts{events: 200000, projects: 1, backlog: defaultBacklog()}
			fs.IntVar(&o.events, "events", o.events, "unsequenced events in the backlog")
			fs.IntVar(&o.projects, "projects", o.projects, "projects the backlog spreads over")
			o.backlog.register(fs, false)
			return one(func(ctx context.Context, env *Env) (sequenceResult, error) { return runSequence(ctx, env, o) })
		}})
	register(benchCase{name: "drain", usage: "one fresh consumer drains a backlog (by default unsequenced, written by the host's deletes)",
		flags: func(fs *flag.FlagSet) runner {
			o := drainOpts{events: 200000, batch: 1000, poll: time.Second, backlog: defaultBacklog()}
			fs.IntVar(&o.events, "events", o.events, "events in the backlog")
			o.backlog.register(fs, true)
			fs.IntVar(&o.batch, "batch", o.batch, "consumer BatchSize")
			fs.DurationVar(&o.poll, "poll", o.poll, "consumer PollInterval")
			return one(func(ctx context.Context, env *Env) (drainResult, error) { return runDrain(ctx, env, o) })
		}})
	register(benchCase{name: "fanout", usage: "K durable consumers each drain the same backlog",
		flags: func(fs *flag.FlagSet) runner {
			o := fanoutOpts{consumers: 4, events: 20000, backlog: defaultBacklog()}
			fs.IntVar(&o.consumers, "consumers", o.consumers, "consumers (distinct identities)")
			fs.IntVar(&o.events, "events", o.events, "events in the backlog")
			o.backlog.register(fs, true)
			return one(func(ctx context.Context, env *Env) (fanoutResult, error) { return runFanout(ctx, env, o) })
		}})
}

type sequenceOpts struct {
	events, projects int
	backlog          backlogOpts // its kind is always unsequenced
}

type sequenceResult struct {
	Header
	Backlog
	Events   int `json:"events"`
	Projects int `json:"projects"`
	// BatchSize is the copy floor's batch, the one the sequencer that schema 18 replaced
	// numbered per project and call; a tick has none.
	BatchSize int `json:"batch_size"`
	// Numbered is what the one tick numbered (every event of the backlog), Seconds how long
	// the call took, NumberingEventsPerS the two together.
	Numbered            int64   `json:"numbered"`
	Seconds             float64 `json:"seconds"`
	NumberingEventsPerS float64 `json:"numbering_events_per_s"`
	// The copy floor, measured just before on the same backlog: its events copied once, in
	// batches, into a table with the stream's columns, indexes and checks, without locks or
	// row-level security (see copyFloor). -1 for a backlog in several projects.
	CopyFloorSeconds  float64 `json:"copy_floor_seconds"`
	CopyFloorRowsPerS float64 `json:"copy_floor_rows_per_s"`
	VsCopyFloor       float64 `json:"vs_copy_floor"`
}

// runSequence times one outbox.Tick, as the consumers' ticker calls it (as the consumer
// role), over an unsequenced backlog that the reference host's deletes wrote through the
// writer hook while no consumer ran: the tick numbers the whole backlog at once, as the first
// consumer's ticker does when it is elected. Reading it is the drain case's.
func runSequence(ctx context.Context, env *Env, o sequenceOpts) (sequenceResult, error) {
	res := sequenceResult{Header: env.Header("sequence"), Events: o.events, Projects: o.projects, BatchSize: floorBatch}
	o.backlog.kind = backlogUnsequenced
	if o.events < 1 || o.projects < 1 {
		return res, errors.New("sequence: need events >= 1 and projects >= 1")
	}
	if err := o.backlog.validate("sequence"); err != nil {
		return res, err
	}
	db, pool, closeDB, err := env.NewDBPool(ctx, "sequence", 4)
	if err != nil {
		return res, err
	}
	defer closeDB()
	projects, counts := make([]string, o.projects), make([]int, o.projects)
	for p := range projects {
		projects[p] = projectName(p)
		counts[p] = o.events / o.projects
		if p < o.events%o.projects {
			counts[p]++
		}
	}
	if res.Backlog, err = writeBacklog(ctx, env, db, projects, counts, "s", o.backlog); err != nil {
		return res, err
	}
	env.Logf("sequence: %d unsequenced events in %d project(s): the copy floor, then one tick", o.events, o.projects)
	// The copy floor takes one statement per batch of one project, where one tick serves
	// every project: it bounds a backlog in one project only.
	res.CopyFloorSeconds, res.CopyFloorRowsPerS, res.VsCopyFloor = -1, -1, -1
	if o.projects == 1 {
		floor, copied, err := copyFloor(ctx, pool, projects, floorBatch)
		if err != nil {
			return res, err
		}
		if copied != int64(o.events) {
			return res, fmt.Errorf("sequence: the copy floor copied %d of %d events", copied, o.events)
		}
		res.CopyFloorSeconds, res.CopyFloorRowsPerS = seconds(floor), perSecond(copied, floor)
	}
	ticker, err := db.ConsumerPool(ctx, 1, nil)
	if err != nil {
		return res, err
	}
	defer ticker.Close()
	started := time.Now()
	tick, err := outbox.Tick(ctx, ticker)
	elapsed := time.Since(started)
	if err != nil {
		return res, err
	}
	res.Numbered = tick.Events
	res.Seconds, res.NumberingEventsPerS = seconds(elapsed), perSecond(tick.Events, elapsed)
	if res.CopyFloorRowsPerS > 0 {
		res.VsCopyFloor = ratio(res.NumberingEventsPerS, res.CopyFloorRowsPerS)
	}
	if res.Numbered != int64(o.events) || tick.Ticks != 1 {
		return res, fmt.Errorf("sequence: %d tick(s) numbered %d of %d events", tick.Ticks, res.Numbered, o.events)
	}
	return res, nil
}

type drainOpts struct {
	events, batch int
	poll          time.Duration
	backlog       backlogOpts
}

type drainResult struct {
	Header
	Backlog
	Events               int     `json:"events"`
	BatchSize            int     `json:"batch_size"`
	PollIntervalMS       int64   `json:"poll_interval_ms"`
	Received             int     `json:"received"`
	Duplicates           int     `json:"duplicates"`
	Missing              int     `json:"missing"`
	Seconds              float64 `json:"seconds"`
	EventsPerS           float64 `json:"events_per_s"`
	CursorDurableSeconds float64 `json:"cursor_durable_seconds"`
	// ClientCPUSeconds is the CPU this process used from Start to the last event: the
	// consumer's own cost, which the database's share of the 2 cores does not blur.
	ClientCPUSeconds float64 `json:"client_cpu_seconds"`
	PhaseCPU
	RSSBeforeMB float64 `json:"rss_before_mb"`
	PeakRSSMB   float64 `json:"peak_rss_mb"`
	TimedOut    bool    `json:"timed_out,omitempty"`
}

// drainWaitBase is the part of a drain's deadline that does not grow with its events. The
// tests raise it: on a busy test machine (-race, two cores shared) a small drain can take
// longer than 30s, and the deadline only says when to give up.
var drainWaitBase = 30 * time.Second

// drainTimeout leaves a slow machine room while still ending a run that lost events.
func drainTimeout(events int) time.Duration {
	return drainWaitBase + time.Duration(events)*50*time.Microsecond
}

// runDrain prewrites a backlog (by default unsequenced: the host's deletes with the writer
// hook while no consumer ran; -backlog sequenced bulk-loads it already numbered) and times one
// fresh consumer (cursor "oldest", durable acknowledgements) from Start until its listener has
// every event, and until its cursor row says so. An unsequenced backlog's time includes its
// numbering: the consumer's ticker, elected at Start, numbers it in one tick, and the
// consumer reads it as the tick announces it.
func runDrain(ctx context.Context, env *Env, o drainOpts) (drainResult, error) {
	res := drainResult{Header: env.Header("drain"), Events: o.events, BatchSize: o.batch, PollIntervalMS: o.poll.Milliseconds()}
	if o.events < 1 {
		return res, errors.New("drain: need events >= 1")
	}
	if err := o.backlog.validate("drain"); err != nil {
		return res, err
	}
	db, admin, closeDB, err := env.NewDBPool(ctx, "drain", 2)
	if err != nil {
		return res, err
	}
	defer closeDB()
	const project, consumer = "drain", "bench-drain"
	env.Logf("drain: prewriting %d events (%s)", o.events, o.backlog.kind)
	if res.Backlog, err = writeBacklog(ctx, env, db, []string{project}, []int{o.events}, "d", o.backlog); err != nil {
		return res, err
	}

	server, err := localServer(ctx, db)
	if err != nil {
		return res, err
	}
	tr := newIndexTracker("d", o.events)
	rss := startPeakRSS()
	env.Logf("drain: consuming")
	meter, started := startCPU(server), time.Now()
	c, err := startConsumer(ctx, db, consumerSpec{id: consumer, projects: []string{project},
		cfg:       outbox.Config{NewCursor: outbox.NewCursorOldest, BatchSize: o.batch, PollInterval: o.poll},
		listeners: []outbox.Listener{tr.listener()}})
	if err != nil {
		rss.Stop()
		return res, err
	}
	defer c.Close()
	complete := tr.wait(ctx, drainTimeout(o.events))
	drained := time.Since(started)
	cpu, srv := meter.Stop()
	res.PhaseCPU = phaseCPU(server, cpu, srv, drained, o.events)
	durableAt, durable := waitCursor(ctx, admin, consumer, project, int64(o.events), 30*time.Second)
	res.RSSBeforeMB, res.PeakRSSMB = rss.Stop()
	res.Received, res.Duplicates, res.Missing, _ = tr.Counts()
	res.Seconds, res.TimedOut, res.ClientCPUSeconds = seconds(drained), !complete || !durable, seconds(cpu)
	res.EventsPerS = perSecond(int64(o.events-res.Missing), drained)
	if durable {
		res.CursorDurableSeconds = seconds(durableAt.Sub(started))
	}
	return res, ctx.Err()
}

type fanoutOpts struct {
	consumers, events int
	backlog           backlogOpts
}

type fanoutResult struct {
	Header
	Backlog
	Consumers      int     `json:"consumers"`
	Events         int     `json:"events"`
	ReceivedTotal  int     `json:"received_total"`
	Duplicates     int     `json:"duplicates"`
	Missing        int     `json:"missing"`
	Seconds        float64 `json:"seconds"`
	DeliveriesPerS float64 `json:"deliveries_per_s"`
	// ClientCPUSeconds is the CPU this process (all K consumers) used until the last event.
	ClientCPUSeconds float64 `json:"client_cpu_seconds"`
	PhaseCPU
	TimedOut bool `json:"timed_out,omitempty"`
}

// PhaseCPU is what a drain or fanout cost the machine: ServerCPUSeconds is the CPU the
// database server's processes used meanwhile (-1 when the server does not run on this
// machine), CPUUSPerDelivery the client's and the server's CPU together per delivery, and
// CPUsBusy both over the elapsed time. Near the machine's core count, the run was bound by
// CPU, and a rate of R deliveries/s would need at most cores/R of CPU per delivery.
type PhaseCPU struct {
	ServerCPUSeconds float64 `json:"server_cpu_seconds"`
	CPUUSPerDelivery float64 `json:"cpu_us_per_delivery"`
	CPUsBusy         float64 `json:"cpus_busy"`
}

// phaseCPU fills a PhaseCPU from a meter's figures; server is nil when the server's CPU
// cannot be read.
func phaseCPU(server *serverCPU, client, srv, elapsed time.Duration, deliveries int) PhaseCPU {
	if server == nil || deliveries < 1 || elapsed <= 0 {
		return PhaseCPU{ServerCPUSeconds: -1}
	}
	return PhaseCPU{ServerCPUSeconds: seconds(srv),
		CPUUSPerDelivery: round1(float64(client+srv) / float64(time.Microsecond) / float64(deliveries)),
		CPUsBusy:         round3(float64(client+srv) / float64(elapsed))}
}

// localServer finds the CPU of db's server (nil when it does not run on this machine).
func localServer(ctx context.Context, db *DB) (*serverCPU, error) {
	admin, err := db.Pool(ctx, 1, nil)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	return findServer(ctx, admin), nil
}

// runFanout starts K consumers with distinct identities (each with its own pool, as separate
// processes would) at once and times until every one of them has every event.
func runFanout(ctx context.Context, env *Env, o fanoutOpts) (fanoutResult, error) {
	res := fanoutResult{Header: env.Header("fanout"), Consumers: o.consumers, Events: o.events}
	if o.consumers < 1 || o.events < 1 {
		return res, errors.New("fanout: need consumers >= 1 and events >= 1")
	}
	if err := o.backlog.validate("fanout"); err != nil {
		return res, err
	}
	db, err := env.NewDB(ctx, "fanout")
	if err != nil {
		return res, err
	}
	defer db.Drop()
	const project = "fan"
	if res.Backlog, err = writeBacklog(ctx, env, db, []string{project}, []int{o.events}, "f", o.backlog); err != nil {
		return res, err
	}

	trackers := make([]*indexTracker, o.consumers)
	running := make([]*runningConsumer, o.consumers)
	errs := make([]error, o.consumers)
	defer func() {
		for _, c := range running {
			if c != nil {
				c.Close()
			}
		}
	}()
	server, err := localServer(ctx, db)
	if err != nil {
		return res, err
	}
	env.Logf("fanout: %d consumers x %d events", o.consumers, o.events)
	var wg sync.WaitGroup
	meter, started := startCPU(server), time.Now()
	for i := range o.consumers {
		trackers[i] = newIndexTracker("f", o.events)
		wg.Add(1)
		go func() {
			defer wg.Done()
			running[i], errs[i] = startConsumer(ctx, db, consumerSpec{id: fmt.Sprintf("bench-fanout-%d", i),
				projects: []string{project}, cfg: outbox.Config{NewCursor: outbox.NewCursorOldest},
				listeners: []outbox.Listener{trackers[i].listener()}})
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return res, err
	}
	deadline := drainTimeout(o.events * o.consumers)
	for _, tr := range trackers {
		if !tr.wait(ctx, deadline-time.Since(started)) {
			res.TimedOut = true
			break
		}
	}
	elapsed := time.Since(started)
	client, srv := meter.Stop()
	res.ClientCPUSeconds, res.PhaseCPU = seconds(client), phaseCPU(server, client, srv, elapsed, o.consumers*o.events)
	for _, tr := range trackers {
		r, d, m, _ := tr.Counts()
		res.ReceivedTotal += r
		res.Duplicates += d
		res.Missing += m
	}
	res.Seconds = seconds(elapsed)
	res.DeliveriesPerS = perSecond(int64(o.consumers*o.events-res.Missing), elapsed)
	return res, ctx.Err()
}
