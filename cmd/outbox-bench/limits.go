package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox"
)

func init() {
	register(benchCase{name: "limits", usage: "this machine's floor and ceiling: raw delete tx with and without one extra insert; keyset reads",
		flags: func(fs *flag.FlagSet) runner {
			o := limitsOpts{writers: "1,16", events: "4000,16000", readEvents: 200000, page: 1000}
			fs.StringVar(&o.writers, "writers", o.writers, "comma-separated writer counts (projects = writers)")
			fs.StringVar(&o.events, "events", o.events, "comma-separated deletes per side, one per writer count")
			fs.IntVar(&o.readEvents, "read-events", o.readEvents, "outbox rows the keyset read walks")
			fs.IntVar(&o.page, "page", o.page, "keyset page size")
			return one(func(ctx context.Context, env *Env) (limitsResult, error) { return runLimits(ctx, env, o) })
		}})
}

type limitsOpts struct {
	writers, events  string
	readEvents, page int
}

// LimitsDelete compares the bare delete transaction with and without one extra insert: a
// bare indexed row (the raw cost of any outbox), and the outbox's own row sent as plain SQL
// (its width, indexes and checks, without the writer hook's Go around it).
type LimitsDelete struct {
	Writers             int       `json:"writers"`
	Projects            int       `json:"projects"`
	Events              int       `json:"events"`
	Bare                WriteSide `json:"bare"`
	PlusInsert          WriteSide `json:"plus_insert"`
	PlusOutboxRow       WriteSide `json:"plus_outbox_row"`
	PlusInsertVsBare    float64   `json:"plus_insert_vs_bare"`
	PlusOutboxRowVsBare float64   `json:"plus_outbox_row_vs_bare"`
}

type limitsResult struct {
	Header
	Delete           []LimitsDelete `json:"delete"`
	ReadRows         int            `json:"read_rows"`
	PageSize         int            `json:"page_size"`
	ReadRowsPerS     float64        `json:"read_rows_per_s"`
	ReadCommitRowsPS float64        `json:"read_commit_rows_per_s"`
}

// The reference host's delete transaction, as Store.Delete issues it, without the host's Go
// around it; the extra insert is the raw cost of any outbox: one row, one btree index.
const (
	rawDeleteSQL = `UPDATE tasks SET deleted_at = now(), updated_at = now()
		WHERE project_id = $1 AND id = $2 AND deleted_at IS NULL
		RETURNING title, "column", archived, archived_at, deleted_at`
	rawAuditSQL   = `INSERT INTO run_audit (project_id, task_id, action, actor, metadata) VALUES ($1, $2, 'task:deleted', 'taskstore', $3)`
	rawScratchSQL = `INSERT INTO bench_scratch (project_id, k) VALUES ($1, $2)`
	scratchDDL    = `CREATE TABLE bench_scratch (project_id text NOT NULL, k text NOT NULL);
		CREATE INDEX bench_scratch_key ON bench_scratch (project_id, k)`
)

// The extra insert of a rawDelete.
const (
	extraNone = iota
	extraScratch
	extraOutboxRow
)

func rawDelete(extra int) sideSetup {
	return func(ctx context.Context, admin, pool *pgxpool.Pool) (deleteFunc, func(), error) {
		if _, err := admin.Exec(ctx, scratchDDL); err != nil {
			return nil, nil, fmt.Errorf("create scratch table: %w", err)
		}
		// The writer role inserts into it, as into any table of the host's.
		var writer string
		if err := pool.QueryRow(ctx, "SELECT current_user").Scan(&writer); err != nil {
			return nil, nil, fmt.Errorf("read writer role: %w", err)
		}
		if _, err := admin.Exec(ctx, "GRANT INSERT ON bench_scratch TO "+pgx.Identifier{writer}.Sanitize()); err != nil {
			return nil, nil, fmt.Errorf("grant scratch table: %w", err)
		}
		// The outbox row goes through the real writer hook, without its post-commit wake-up.
		w, err := outbox.NewWriter(pool, outbox.Config{NotifyDisabled: true}, nil)
		if err != nil {
			return nil, nil, err
		}
		return func(ctx context.Context, j deleteJob) (string, error) {
			return "", pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				var title, column string
				var archived bool
				var archivedAt *time.Time
				var deletedAt time.Time
				if err := tx.QueryRow(ctx, rawDeleteSQL, j.project, j.task).Scan(&title, &column, &archived, &archivedAt, &deletedAt); err != nil {
					return fmt.Errorf("raw delete: %w", err)
				}
				meta, _ := json.Marshal(map[string]any{"column": column, "archived": archived})
				if _, err := tx.Exec(ctx, rawAuditSQL, j.project, j.task, meta); err != nil {
					return fmt.Errorf("raw audit: %w", err)
				}
				switch extra {
				case extraScratch:
					if _, err := tx.Exec(ctx, rawScratchSQL, j.project, j.task); err != nil {
						return fmt.Errorf("scratch insert: %w", err)
					}
				case extraOutboxRow:
					if _, _, err := w.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: j.project, TaskID: j.task,
						DeletedAt: deletedAt, PriorColumn: column, Archived: archived}); err != nil {
						return fmt.Errorf("outbox row insert: %w", err)
					}
				}
				return nil
			})
		}, closeWriter(w), nil
	}
}

// runLimits measures, in one run, what any outbox must cost the delete transaction and how
// fast this machine can walk an outbox by keyset, with and without a durable cursor write per
// page: the ceiling of a drain with that batch size.
func runLimits(ctx context.Context, env *Env, o limitsOpts) (limitsResult, error) {
	res := limitsResult{Header: env.Header("limits"), ReadRows: o.readEvents, PageSize: o.page}
	if o.readEvents < 1 || o.page < 1 {
		return res, errors.New("limits: need read-events >= 1 and page >= 1")
	}
	writerCounts, eventCounts := splitList(o.writers), splitList(o.events)
	if len(writerCounts) != len(eventCounts) {
		return res, errors.New("limits: -writers and -events need one entry each")
	}
	for i, ws := range writerCounts {
		writers, err := strconv.Atoi(ws)
		if err != nil || writers < 1 {
			return res, fmt.Errorf("limits: bad writer count %q", ws)
		}
		events, err := strconv.Atoi(eventCounts[i])
		if err != nil || events < 2 {
			return res, fmt.Errorf("limits: bad event count %q", eventCounts[i])
		}
		var sides []*side
		for _, v := range []struct {
			name  string
			extra int
		}{{"limits_bare", extraNone}, {"limits_plus_insert", extraScratch}, {"limits_plus_outbox_row", extraOutboxRow}} {
			s, err := newSide(ctx, env, v.name, writers, events, writers, rawDelete(v.extra))
			if err != nil {
				closeSides(sides)
				return res, err
			}
			sides = append(sides, s)
		}
		err = runABBA(ctx, env, writers, sides...)
		d := LimitsDelete{Writers: writers, Projects: writers, Events: events,
			Bare: sides[0].summary(), PlusInsert: sides[1].summary(), PlusOutboxRow: sides[2].summary()}
		closeSides(sides)
		if err != nil {
			return res, err
		}
		d.PlusInsertVsBare = ratio(d.PlusInsert.TxPerS, d.Bare.TxPerS)
		d.PlusOutboxRowVsBare = ratio(d.PlusOutboxRow.TxPerS, d.Bare.TxPerS)
		res.Delete = append(res.Delete, d)
	}
	var err error
	res.ReadRowsPerS, res.ReadCommitRowsPS, err = keysetLimits(ctx, env, o)
	return res, err
}

func closeSides(sides []*side) {
	for _, s := range sides {
		s.Close()
	}
}

// keysetSQL reads a page of a project's stream as the consumer does (readEventsSQL): through
// lifecycle_outbox_read, after the position @after, continuing after the key (@key_txid,
// @key_deleted_at, @key_task_id) of the event at it inside its tick.
const keysetSQL = `
SELECT project_id, sequence, event_type, task_id, deleted_at, coalesce(prior_column, ''), archived,
       writer_process_id, occurred_at, payload_version, txid::text
FROM lifecycle_outbox_read(@project::text, @after::bigint, @limit::integer,
                           @key_txid::text::xid8, @key_deleted_at::timestamptz, @key_task_id::text)`

const keysetAckSQL = `UPDATE lifecycle_consumer_cursors SET last_acked_sequence = $3, acked_at = now()
WHERE project_id = $1 AND consumer_id = $2`

func keysetLimits(ctx context.Context, env *Env, o limitsOpts) (plain, withCommit float64, err error) {
	db, err := env.NewDB(ctx, "limits_read")
	if err != nil {
		return 0, 0, err
	}
	defer db.Drop()
	pool, err := db.Pool(ctx, 2, nil)
	if err != nil {
		return 0, 0, err
	}
	defer pool.Close()
	const project = "read"
	if err := insertBacklog(ctx, pool, project, "r", o.readEvents); err != nil {
		return 0, 0, err
	}
	if _, err := pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ($1, 'bench-read')`, project); err != nil {
		return 0, 0, fmt.Errorf("create cursor: %w", err)
	}
	// The walk reads as the consumer role, whose reads row-level security filters.
	reader, err := db.ConsumerPool(ctx, 2, nil)
	if err != nil {
		return 0, 0, err
	}
	defer reader.Close()
	for _, commit := range []bool{false, true} {
		env.Logf("limits: keyset read of %d rows, cursor commit per page: %t", o.readEvents, commit)
		started := time.Now()
		n, err := keysetWalk(ctx, reader, project, o.page, commit)
		elapsed := time.Since(started)
		if err != nil {
			return 0, 0, err
		}
		if n != o.readEvents {
			return 0, 0, fmt.Errorf("limits: keyset read %d of %d rows", n, o.readEvents)
		}
		if commit {
			withCommit = perSecond(int64(n), elapsed)
		} else {
			plain = perSecond(int64(n), elapsed)
		}
	}
	return plain, withCommit, nil
}

// keysetWalk reads the project's stream page by page, decoding every column as the consumer
// does and passing each page's last key to the next read, and optionally writes the cursor
// (autocommit, durable) after each page.
func keysetWalk(ctx context.Context, pool *pgxpool.Pool, project string, page int, commit bool) (int, error) {
	var after int64
	var keyTxid, keyTask *string
	var keyDeletedAt *time.Time
	total := 0
	for {
		rows, err := pool.Query(ctx, keysetSQL, pgx.StrictNamedArgs{"project": project, "after": after, "limit": page,
			"key_txid": keyTxid, "key_deleted_at": keyDeletedAt, "key_task_id": keyTask})
		if err != nil {
			return total, fmt.Errorf("keyset read: %w", err)
		}
		n := 0
		for rows.Next() {
			var p, typ, task, prior, writer string
			var txid *string
			var seq int64
			var deletedAt, occurredAt time.Time
			var archived bool
			var version int16
			if err := rows.Scan(&p, &seq, &typ, &task, &deletedAt, &prior, &archived, &writer, &occurredAt, &version, &txid); err != nil {
				rows.Close()
				return total, fmt.Errorf("keyset decode: %w", err)
			}
			after, keyTxid, keyDeletedAt, keyTask = seq, txid, &deletedAt, &task
			n++
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return total, fmt.Errorf("keyset read: %w", err)
		}
		if n == 0 {
			return total, nil
		}
		total += n
		if commit {
			if _, err := pool.Exec(ctx, keysetAckSQL, project, "bench-read", after); err != nil {
				return total, fmt.Errorf("keyset cursor commit: %w", err)
			}
		}
	}
}
