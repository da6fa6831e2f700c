package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// side is one database, its tasks and the delete each job runs: the write and limits cases
// compare two of them.
type side struct {
	name string
	// pool is the writer role's, for the deletes; admin the superuser's, for setup.
	pool, admin *pgxpool.Pool
	tracer      *stampTracer
	del         deleteFunc
	jobs        []deleteJob
	close       []func()
	run         deleteRun
	// Statements the pool sent while the deletes ran, and the wake-ups among them.
	statements, roundTrips, notifies int64
	// CPU the bench process and the server used while the deletes ran.
	clientCPU, serverCPU time.Duration
	server               *serverCPU
}

func (s *side) Close() {
	for i := len(s.close) - 1; i >= 0; i-- {
		s.close[i]()
	}
}

// sideSetup prepares a side's database through admin and returns its delete, which runs on
// pool; cleanup may be nil.
type sideSetup func(ctx context.Context, admin, pool *pgxpool.Pool) (del deleteFunc, cleanup func(), err error)

// newSide creates a fresh database with tasks t-0 .. t-(events-1), event e deleting task t-e
// of project e mod projects, and a pool for the writers (plus the writer hook's NOTIFY) as the
// writer role.
func newSide(ctx context.Context, env *Env, name string, writers, events, projects int, setup sideSetup) (*side, error) {
	db, err := env.NewDB(ctx, name)
	if err != nil {
		return nil, err
	}
	s := &side{name: name, tracer: &stampTracer{}, close: []func(){db.Drop}}
	if s.admin, err = db.Pool(ctx, 2, nil); err != nil {
		s.Close()
		return nil, err
	}
	s.close = append(s.close, s.admin.Close)
	if s.pool, err = db.WriterPool(ctx, int32(writers+2), s.tracer); err != nil {
		s.Close()
		return nil, err
	}
	s.close = append(s.close, s.pool.Close)
	s.server = findServer(ctx, s.pool)
	for p := range projects {
		if err := createTasks(ctx, s.admin, projectName(p), "t", p, events-1, projects); err != nil {
			s.Close()
			return nil, err
		}
	}
	if _, err := s.admin.Exec(ctx, "VACUUM ANALYZE tasks"); err != nil {
		s.Close()
		return nil, fmt.Errorf("vacuum tasks: %w", err)
	}
	s.jobs = make([]deleteJob, events)
	for e := range s.jobs {
		s.jobs[e] = deleteJob{project: projectName(e % projects), task: fmt.Sprintf("t-%d", e)}
	}
	del, cleanup, err := setup(ctx, s.admin, s.pool)
	if err != nil {
		s.Close()
		return nil, err
	}
	if cleanup != nil {
		s.close = append(s.close, cleanup)
	}
	s.del = del
	return s, nil
}

// runABBA runs each side's jobs in two halves, in the order a, b, ..., then back ..., b, a,
// with a CHECKPOINT before each half, so that drift over the run (a shared machine, growing
// tables, checkpoints) weighs on every side alike.
func runABBA(ctx context.Context, env *Env, writers int, sides ...*side) error {
	type step struct {
		s    *side
		half int
	}
	var steps []step
	for _, s := range sides {
		steps = append(steps, step{s, 0})
	}
	for i := len(sides) - 1; i >= 0; i-- {
		steps = append(steps, step{sides[i], 1})
	}
	for _, step := range steps {
		n := len(step.s.jobs) / 2
		jobs := step.s.jobs[:n]
		if step.half == 1 {
			jobs = step.s.jobs[n:]
		}
		if _, err := step.s.admin.Exec(ctx, "CHECKPOINT"); err != nil {
			return fmt.Errorf("checkpoint: %w", err)
		}
		env.Logf("%s: half %d, %d deletes on %d writers", step.s.name, step.half+1, len(jobs), writers)
		statements, roundTrips, notifies := step.s.tracer.statements.Load(), step.s.tracer.roundTrips.Load(), step.s.tracer.notifies.Load()
		cpu := startCPU(step.s.server)
		r := runDeletes(ctx, step.s.del, writers, jobs, false)
		client, server := cpu.Stop()
		step.s.clientCPU += client
		step.s.serverCPU += server
		step.s.statements += step.s.tracer.statements.Load() - statements
		step.s.roundTrips += step.s.tracer.roundTrips.Load() - roundTrips
		step.s.notifies += step.s.tracer.notifies.Load() - notifies
		if r.firstEr != nil {
			env.Logf("%s: first error: %v", step.s.name, r.firstEr)
		}
		step.s.run.tx += r.tx
		step.s.run.errors += r.errors
		step.s.run.elapsed += r.elapsed
		step.s.run.calls = append(step.s.run.calls, r.calls...)
		step.s.run.txOnly = append(step.s.run.txOnly, r.txOnly...)
	}
	return ctx.Err()
}

func (s *side) summary() WriteSide {
	l, t := summarize(s.run.calls), summarize(s.run.txOnly)
	w := WriteSide{Tx: s.run.tx, Errors: s.run.errors, Seconds: seconds(s.run.elapsed), TxPerS: perSecond(s.run.tx, s.run.elapsed),
		P50: l.P50, P99: l.P99, Max: l.Max, TxOnlyP50: t.P50, TxOnlyP99: t.P99, Notifies: s.notifies}
	if s.run.tx > 0 {
		w.StatementsPerTx = round3(float64(s.statements) / float64(s.run.tx))
		w.RoundTripsPerTx = round3(float64(s.roundTrips) / float64(s.run.tx))
		w.ClientCPUPerTx = round1(float64(s.clientCPU/time.Microsecond) / float64(s.run.tx))
		w.ServerCPUPerTx = round1(float64(s.serverCPU/time.Microsecond) / float64(s.run.tx))
	}
	return w
}

func projectName(i int) string { return fmt.Sprintf("p%03d", i) }
