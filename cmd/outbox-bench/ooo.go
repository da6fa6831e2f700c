package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"fusion/outbox"
	"fusion/outbox/internal/testhost"
)

func init() {
	register(benchCase{name: "ooo", usage: "delivery while another transaction stays open",
		flags: func(fs *flag.FlagSet) runner {
			o := oooOpts{hold: 2 * time.Second, events: 200, writers: 4, cases: oooOutboxTx + "," + oooUnrelatedTx}
			fs.DurationVar(&o.hold, "hold", o.hold, "how long the other transaction stays open at least (it stays open until the deletes committed)")
			fs.IntVar(&o.events, "events", o.events, "deletes committed while it is open")
			fs.IntVar(&o.writers, "writers", o.writers, "writers committing them")
			fs.StringVar(&o.cases, "case", o.cases, "comma-separated: "+oooOutboxTx+", "+oooUnrelatedTx)
			return func(ctx context.Context, env *Env, emit func(any) error) error {
				for _, c := range splitList(o.cases) {
					r, err := runOOO(ctx, env, o, c)
					if err != nil {
						return err
					}
					if err := emit(r); err != nil {
						return err
					}
				}
				return nil
			}
		}})
}

const (
	oooOutboxTx    = "open_outbox_tx"
	oooUnrelatedTx = "open_unrelated_tx"
)

type oooOpts struct {
	hold            time.Duration
	events, writers int
	cases           string
}

type oooResult struct {
	Header
	Case               string  `json:"case"`
	HoldSeconds        float64 `json:"hold_seconds"`
	Events             int     `json:"events"`
	CommittedWhileHeld int     `json:"committed_while_held"`
	ReceivedWhileHeld  int     `json:"received_while_held"`
	Received           int     `json:"received"`
	Duplicates         int     `json:"duplicates"`
	Missing            int     `json:"missing"`
	InSeqOrder         bool    `json:"in_seq_order"`
	ReleaseToAllMS     float64 `json:"release_to_all_ms"`
}

// runOOO holds one transaction open while events deletes of another project commit through
// the reference host, with one consumer (default settings) observing both projects:
//
//   - open_outbox_tx: the open transaction is a delete of project ooo-b that has written its
//     audit row and inserted its outbox row;
//   - open_unrelated_tx: it is an unrelated write to another table.
//
// After the hold it commits; the events then count the other transaction's event too when it
// wrote one.
func runOOO(ctx context.Context, env *Env, o oooOpts, which string) (oooResult, error) {
	res := oooResult{Header: env.Header("ooo"), Case: which, Events: o.events}
	if which != oooOutboxTx && which != oooUnrelatedTx {
		return res, fmt.Errorf("ooo: unknown case %q", which)
	}
	if o.events < 1 || o.writers < 1 {
		return res, errors.New("ooo: need events >= 1 and writers >= 1")
	}
	db, err := env.NewDB(ctx, "ooo")
	if err != nil {
		return res, err
	}
	defer db.Drop()
	admin, pool, closePools, err := db.Pools(ctx, int32(o.writers+4), &stampTracer{})
	if err != nil {
		return res, err
	}
	defer closePools()
	const projectA, projectB, consumer = "ooo-a", "ooo-b", "bench-ooo"
	if err := createTasks(ctx, admin, projectA, "t", 0, o.events-1, 1); err != nil {
		return res, err
	}
	if err := createTasks(ctx, admin, projectB, "held", 1, 1, 1); err != nil {
		return res, err
	}
	if _, err := admin.Exec(ctx, `CREATE TABLE bench_unrelated (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, note text)`); err != nil {
		return res, fmt.Errorf("create unrelated table: %w", err)
	}
	if _, err := admin.Exec(ctx, `GRANT INSERT ON bench_unrelated TO `+pgx.Identifier{db.writer.name}.Sanitize()); err != nil {
		return res, fmt.Errorf("grant unrelated table: %w", err)
	}
	store, w, err := newHost(pool, true, true)
	if err != nil {
		return res, err
	}
	defer closeWriter(w)()
	arr := newArrivals()
	c, err := startConsumer(ctx, db, consumerSpec{id: consumer, projects: []string{projectA, projectB}, listeners: []outbox.Listener{arr.listener()}})
	if err != nil {
		return res, err
	}
	defer c.Close()
	for _, p := range []string{projectA, projectB} {
		if _, ok := waitCursor(ctx, admin, consumer, p, 0, 10*time.Second); !ok {
			return res, errors.New("ooo: the consumer never positioned its cursors")
		}
	}

	held, heldEvent, err := openHeldTx(ctx, pool, store, w, which, projectB)
	if err != nil {
		return res, err
	}
	defer func() { _ = held.Rollback(context.Background()) }()
	heldAt := time.Now()
	env.Logf("ooo: %s held; committing %d deletes", which, o.events)
	jobs := make([]deleteJob, o.events)
	for i := range jobs {
		jobs[i] = deleteJob{project: projectA, task: fmt.Sprintf("t-%d", i)}
	}
	done := make(chan deleteRun, 1)
	go func() { done <- runDeletes(ctx, hostDelete(store), o.writers, jobs, true) }()

	// Hold until the deletes finished and the hold time passed: every delete commits while the
	// other transaction is open, however slow the machine is.
	var run deleteRun
	select {
	case run = <-done:
	case <-ctx.Done():
		return res, ctx.Err()
	}
	if d := time.Until(heldAt.Add(o.hold)); d > 0 {
		time.Sleep(d)
	}
	releaseAt := time.Now()
	first, _, _, _ := arr.snapshot()
	if err := held.Commit(ctx); err != nil {
		return res, fmt.Errorf("ooo: release: %w", err)
	}
	released := time.Now()
	if heldEvent != "" {
		w.Committed(projectB)
	}
	res.HoldSeconds = seconds(releaseAt.Sub(heldAt))
	if run.firstEr != nil {
		return res, fmt.Errorf("ooo: deletes: %w", run.firstEr)
	}
	for i, id := range run.events {
		if run.commits[i].Before(releaseAt) {
			res.CommittedWhileHeld++
			if at, ok := first[id]; ok && at.Before(releaseAt) {
				res.ReceivedWhileHeld++
			}
		}
	}
	ids := run.events
	if heldEvent != "" {
		ids = append(ids, heldEvent)
		res.Events++
	}
	complete := arr.waitFor(ctx, ids, 10*time.Second)
	first, received, dups, outOfOrder := arr.snapshot()
	if complete {
		var last time.Time
		for _, id := range ids {
			if first[id].After(last) {
				last = first[id]
			}
		}
		res.ReleaseToAllMS = ms(max(last.Sub(released), 0))
	}
	res.Received, res.Duplicates, res.InSeqOrder = received, dups, outOfOrder == 0
	res.Missing = len(ids) - arr.has(ids)
	return res, ctx.Err()
}

// openHeldTx begins the transaction that stays open and returns it with the event ID it
// recorded, if any.
func openHeldTx(ctx context.Context, pool interface {
	Begin(context.Context) (pgx.Tx, error)
}, store *testhost.Store, w *outbox.Writer, which, project string) (pgx.Tx, string, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return nil, "", fmt.Errorf("ooo: begin held transaction: %w", err)
	}
	if which == oooUnrelatedTx {
		if _, err := tx.Exec(ctx, `INSERT INTO bench_unrelated (note) VALUES ('held')`); err != nil {
			_ = tx.Rollback(ctx)
			return nil, "", fmt.Errorf("ooo: unrelated write: %w", err)
		}
		return tx, "", nil
	}
	// The reference host's delete transaction, stopped before its commit.
	t := testhost.Task{ProjectID: project, ID: "held-1"}
	var deletedAt time.Time
	err = tx.QueryRow(ctx, `UPDATE tasks SET deleted_at = now(), updated_at = now()
		WHERE project_id = $1 AND id = $2 AND deleted_at IS NULL RETURNING title, "column", deleted_at`, project, t.ID).
		Scan(&t.Title, &t.Column, &deletedAt)
	if err == nil {
		t.DeletedAt = &deletedAt
		err = store.WriteDeleteAuditTx(ctx, tx, t)
	}
	var ev outbox.Event
	if err == nil {
		ev, _, err = w.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: project, TaskID: t.ID, DeletedAt: deletedAt, PriorColumn: t.Column})
	}
	if err != nil {
		_ = tx.Rollback(ctx)
		return nil, "", fmt.Errorf("ooo: held delete: %w", err)
	}
	return tx, ev.EventID, nil
}
