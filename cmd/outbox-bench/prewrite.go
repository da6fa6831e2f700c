package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"fusion/outbox"
	"fusion/outbox/internal/testhost"
)

// How a case's backlog was written.
const (
	backlogUnsequenced = "unsequenced"
	backlogSequenced   = "sequenced"

	prewriteHost = "host_deletes"
	prewriteBulk = "bulk_sql"
)

// Backlog says how a case's backlog was written; the sequence, drain, fanout and scale
// (drain_vs_backlog) lines carry it.
type Backlog struct {
	// Kind is "unsequenced" when the backlog was written through real delete transactions
	// while no consumer ran, so that a tick must number it before a consumer can read it (the
	// realistic case after an outage or for a new observer: the first consumer's ticker
	// numbers it all in one tick), or "sequenced" when it was bulk-loaded already numbered,
	// in ticks of backlogTickEvents, the state that a ticker running alongside the writers
	// leaves.
	Kind string `json:"backlog"`
	// Prewrite is how the rows got there: "host_deletes" (the reference host's delete with the
	// writer hook) or "bulk_sql" (one INSERT ... SELECT of finished rows).
	Prewrite string `json:"prewrite"`
	// PerTx is how many host-style deletes shared one transaction. 1 is testhost.Store.Delete
	// exactly as the host runs it, post-commit mailbox notice included; N > 1 puts N deletes
	// (the host's UPDATE ... RETURNING, its audit row and Writer.RecordTaskDeletedTx) in one
	// transaction and sends no mailbox notices, which writes a large backlog much faster. 0
	// for bulk_sql.
	PerTx int `json:"prewrite_per_tx"`
	// Writers is how many goroutines wrote it concurrently (0 for bulk_sql).
	Writers int `json:"prewrite_writers"`
	// Order is the order a project's tasks were deleted in: "random" (a fixed shuffle of their
	// IDs, as a host deletes whatever its users delete) for host_deletes, "id" for bulk_sql.
	Order   string  `json:"prewrite_order"`
	Seconds float64 `json:"prewrite_seconds"`
}

// backlogOpts are the flags that choose how a backlog is written.
type backlogOpts struct {
	kind           string
	perTx, writers int
}

func defaultBacklog() backlogOpts {
	return backlogOpts{kind: backlogUnsequenced, perTx: 1, writers: 8}
}

// register adds -prewrite-per-tx and -prewrite-writers, and -backlog when the case offers both
// kinds.
func (o *backlogOpts) register(fs *flag.FlagSet, kinds bool) {
	if kinds {
		fs.StringVar(&o.kind, "backlog", o.kind, fmt.Sprintf("%q: written through the reference host's deletes while no consumer ran; %q: bulk-loaded already numbered", backlogUnsequenced, backlogSequenced))
	}
	fs.IntVar(&o.perTx, "prewrite-per-tx", o.perTx, "host-style deletes per prewrite transaction (1: Store.Delete exactly as the host runs it)")
	fs.IntVar(&o.writers, "prewrite-writers", o.writers, "goroutines writing the unsequenced backlog concurrently")
}

func (o backlogOpts) validate(what string) error {
	if o.kind != backlogUnsequenced && o.kind != backlogSequenced {
		return fmt.Errorf("%s: -backlog must be %q or %q", what, backlogUnsequenced, backlogSequenced)
	}
	if o.perTx < 1 || o.writers < 1 {
		return fmt.Errorf("%s: need prewrite-per-tx >= 1 and prewrite-writers >= 1", what)
	}
	return nil
}

// writeBacklog writes counts[p] task:deleted events into project projects[p], for tasks
// "<prefix>-1" .. "<prefix>-<counts[p]>", and leaves the database as a restarted observer
// would find it: the event log vacuumed and analysed (as autovacuum would have done by then)
// and a checkpoint taken, so that neither lands inside the measurement.
func writeBacklog(ctx context.Context, env *Env, db *DB, projects []string, counts []int, prefix string, o backlogOpts) (Backlog, error) {
	if o.kind == backlogSequenced {
		b := Backlog{Kind: backlogSequenced, Prewrite: prewriteBulk, Order: orderID}
		pool, err := db.Pool(ctx, 2, nil)
		if err != nil {
			return b, err
		}
		defer pool.Close()
		t0 := time.Now()
		for p, project := range projects {
			if err := insertBacklog(ctx, pool, project, prefix, counts[p]); err != nil {
				return b, err
			}
		}
		b.Seconds = seconds(time.Since(t0))
		return b, nil
	}
	b := Backlog{Kind: backlogUnsequenced, Prewrite: prewriteHost, PerTx: o.perTx, Writers: o.writers, Order: orderRandom}
	admin, pool, closePools, err := db.Pools(ctx, int32(o.writers+1), nil)
	if err != nil {
		return b, err
	}
	defer closePools()
	total := 0
	for p, project := range projects {
		if err := createTasks(ctx, admin, project, prefix, 1, counts[p], 1); err != nil {
			return b, err
		}
		total += counts[p]
	}
	if _, err := admin.Exec(ctx, "VACUUM ANALYZE tasks"); err != nil {
		return b, fmt.Errorf("vacuum tasks: %w", err)
	}
	env.Logf("prewriting %d events through the host's deletes (%d per transaction, %d writers)", total, o.perTx, o.writers)
	t0 := time.Now()
	if err := hostPrewrite(ctx, env, pool, batchJobs(projects, counts, prefix, o.perTx), total, o.writers); err != nil {
		return b, err
	}
	b.Seconds = seconds(time.Since(t0))
	for _, sql := range []string{"VACUUM ANALYZE lifecycle_event_log", "CHECKPOINT"} {
		if _, err := admin.Exec(ctx, sql); err != nil {
			return b, fmt.Errorf("after prewrite: %s: %w", sql, err)
		}
	}
	return b, nil
}

const (
	orderRandom = "random"
	orderID     = "id"
)

// batchJobs cuts each project's deletes into transactions of perTx, one project per
// transaction as a host's delete has, interleaving the projects so that they fill alike. A
// project's tasks are deleted in a fixed random order, not in the order of their IDs, as a
// host's real deletes are: the tasks' rows are then updated at random places, and the log's
// events (keyed by deletion time first) are in no order of their task IDs.
func batchJobs(projects []string, counts []int, prefix string, perTx int) [][]deleteJob {
	per := make([][][]deleteJob, len(projects))
	rounds := 0
	for p, project := range projects {
		order := rand.New(rand.NewPCG(uint64(p), 0x5eed)).Perm(counts[p])
		for i := 0; i < counts[p]; i += perTx {
			batch := make([]deleteJob, 0, perTx)
			for _, k := range order[i:min(i+perTx, counts[p])] {
				batch = append(batch, deleteJob{project: project, task: prefix + "-" + strconv.Itoa(k+1)})
			}
			per[p] = append(per[p], batch)
		}
		rounds = max(rounds, len(per[p]))
	}
	var out [][]deleteJob
	for r := range rounds {
		for p := range per {
			if r < len(per[p]) {
				out = append(out, per[p][r])
			}
		}
	}
	return out
}

// hostPrewrite runs the batches on writers goroutines through the reference host with the
// writer hook wired and its wake-ups off (no consumer runs to hear them). A batch of one is
// Store.Delete; a longer one is one transaction of host-style deletes (deleteBatchTx).
func hostPrewrite(ctx context.Context, env *Env, pool *pgxpool.Pool, batches [][]deleteJob, total, writers int) error {
	store, w, err := newHost(pool, true, false)
	if err != nil {
		return err
	}
	defer closeWriter(w)()
	var next, done atomic.Int64
	progress := make(chan struct{})
	defer close(progress)
	go func() {
		t := time.NewTicker(10 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-progress:
				return
			case <-t.C:
				env.Logf("prewrite: %d of %d events", done.Load(), total)
			}
		}
	}()
	g, gctx := errgroup.WithContext(ctx)
	for range writers {
		g.Go(func() error {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(batches) || gctx.Err() != nil {
					return gctx.Err()
				}
				batch := batches[i]
				if len(batch) == 1 {
					r, err := store.Delete(gctx, batch[0].project, batch[0].task)
					if err != nil {
						return fmt.Errorf("prewrite delete: %w", err)
					}
					if !r.Deleted || !r.EventRecorded {
						return fmt.Errorf("prewrite delete of %s/%s: deleted %t, recorded %t", batch[0].project, batch[0].task, r.Deleted, r.EventRecorded)
					}
				} else if err := deleteBatchTx(gctx, pool, store, w, batch); err != nil {
					return err
				}
				done.Add(int64(len(batch)))
			}
		})
	}
	return g.Wait()
}

// deleteBatchTx runs the host's delete transaction for every job in one transaction: the
// host's UPDATE ... RETURNING (the statement Store.Delete runs, see rawDeleteSQL), its audit
// row through Store.WriteDeleteAuditTx, and Writer.RecordTaskDeletedTx; then, after commit,
// Writer.Committed as the host calls it.
func deleteBatchTx(ctx context.Context, pool *pgxpool.Pool, store *testhost.Store, w *outbox.Writer, jobs []deleteJob) error {
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, j := range jobs {
			t := testhost.Task{ProjectID: j.project, ID: j.task}
			var deletedAt time.Time
			if err := tx.QueryRow(ctx, rawDeleteSQL, j.project, j.task).Scan(&t.Title, &t.Column, &t.Archived, &t.ArchivedAt, &deletedAt); err != nil {
				return fmt.Errorf("delete %s/%s: %w", j.project, j.task, err)
			}
			t.DeletedAt = &deletedAt
			if err := store.WriteDeleteAuditTx(ctx, tx, t); err != nil {
				return err
			}
			_, recorded, err := w.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: j.project, TaskID: j.task,
				DeletedAt: deletedAt, PriorColumn: t.Column, Archived: t.Archived})
			if err != nil {
				return fmt.Errorf("record deletion: %w", err)
			}
			if !recorded {
				return fmt.Errorf("deletion of %s/%s not recorded", j.project, j.task)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("prewrite transaction: %w", err)
	}
	w.Committed(jobs[0].project)
	return nil
}

// sizeSpec is one backlog size of a list such as "100000,1000000:50": the events, and the
// deletes per prewrite transaction (1 unless given after a colon).
type sizeSpec struct{ events, perTx int }

func parseSizes(list string) ([]sizeSpec, error) {
	var out []sizeSpec
	for _, item := range splitList(list) {
		n, per, hasPer := strings.Cut(item, ":")
		s := sizeSpec{perTx: 1}
		var err error
		if s.events, err = strconv.Atoi(n); err != nil || s.events < 1 {
			return nil, fmt.Errorf("bad backlog size %q", item)
		}
		if hasPer {
			if s.perTx, err = strconv.Atoi(per); err != nil || s.perTx < 1 {
				return nil, fmt.Errorf("bad deletes per transaction in %q", item)
			}
		}
		out = append(out, s)
	}
	if len(out) == 0 {
		return nil, errors.New("no backlog sizes")
	}
	return out, nil
}
