package outbox

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Head is a project's stream position as the sequencer left it.
type Head struct {
	ProjectID     string
	LastSequence  int64 // the last sequence assigned
	PrunedThrough int64 // rows at or below this may have been pruned
	Assigned      int   // sequences assigned by this call
	// Busy says another sequencer was numbering the project when this call reached it, so this
	// call left it alone: LastSequence is what that sequencer had committed. Sequence waits
	// for that sequencer instead; only the consumer's scan, which calls again soon, sees it.
	Busy bool
	// heldFor is how long another consumer instance still holds the project as its sequencer
	// (the consumer's call only): that instance numbers it and announces what it numbered.
	heldFor time.Duration
}

// The casts make the call an exact match for the module's function, so that no overload
// elsewhere on the search path with other argument types can be chosen instead.
const sequenceSQL = `SELECT project_id, last_sequence, pruned_through, assigned FROM lifecycle_outbox_sequence($1::text[], $2::integer)`

// sequenceHeldSQL is the consumer's call: as a holder, announcing what it numbers.
const sequenceHeldSQL = `
SELECT project_id, last_sequence, pruned_through, assigned, held_ms
FROM lifecycle_outbox_sequence($1::text[], $2::integer, $3::text, $4::interval, $5::text, $6::interval)`

// headsSQL reads the heads of projects another instance sequences.
const headsSQL = `SELECT project_id, last_sequence, pruned_through FROM lifecycle_outbox_heads WHERE project_id = ANY ($1::text[])`

// releaseHoldsSQL gives up the instance's sequencer holds.
const releaseHoldsSQL = `SELECT lifecycle_outbox_release_sequencer($1::text)`

// holder is a consumer instance sequencing as its projects' sequencer: it holds a project it
// numbers for hold, and announces on channel (when not empty) what it numbered, at most once
// per gap per project. The other instances leave a held project to it (see migration 0008).
type holder struct {
	owner   string
	hold    time.Duration
	channel string
	gap     time.Duration
}

// sequencerHold is how long a consumer instance holds a project it numbered. It renews the hold
// while it keeps numbering; when it stops, it gives the hold up, and when it dies, the hold runs
// out and another instance numbers the project: a delay of at most this, once.
const sequencerHold = time.Second

// sequencedProjectsSQL lists the projects a call for every project covers, for calling them one
// by one after that call failed.
const sequencedProjectsSQL = `
SELECT DISTINCT project_id FROM lifecycle_outbox WHERE sequence IS NULL
UNION
SELECT DISTINCT project_id::text FROM lifecycle_outbox_pending
UNION
SELECT project_id FROM lifecycle_outbox_heads
ORDER BY 1`

// ProjectErrors is returned by a call that serves several projects when some of them failed
// and the others did not: what it returned holds every other project. One project's broken
// rows cost only that project.
type ProjectErrors struct {
	Op     string           // what failed, e.g. "sequence"
	Failed map[string]error // by project ID
}

func (e *ProjectErrors) Error() string {
	projects := e.Projects()
	parts := make([]string, len(projects))
	for i, p := range projects {
		parts[i] = fmt.Sprintf("project %s: %v", p, e.Failed[p])
	}
	return fmt.Sprintf("%s: %d of the projects failed: %s", e.Op, len(projects), strings.Join(parts, "; "))
}

// Projects returns the projects that failed, sorted.
func (e *ProjectErrors) Projects() []string {
	out := make([]string, 0, len(e.Failed))
	for p := range e.Failed {
		out = append(out, p)
	}
	sort.Strings(out)
	return out
}

// Sequence numbers the committed, unsequenced events of projects (every project when
// projects is nil), at most limit per project per round, repeating while a project had more,
// and returns each project's head. It must not run inside a REPEATABLE READ or SERIALIZABLE
// transaction: the database function refuses.
//
// When the call for several projects fails in the database (a row another role numbered by
// hand collides with the next sequence, a heads row stays locked past the function's lock
// timeout, ...), Sequence calls each project alone: the heads of the projects that succeed are
// returned with a *ProjectErrors naming those that did not. The common path stays one call;
// only a failure costs one more call per project.
//
// Locking cost: one row lock per project on lifecycle_outbox_heads, held for the few
// milliseconds of one call. Only sequencers take it, so writers never wait; sequencers of one
// project wait for each other, sequencers of different projects do not.
func Sequence(ctx context.Context, db DBTX, projects []string, limit int) (map[string]Head, error) {
	return sequence(ctx, db, projects, limit, true, nil)
}

// sequence is Sequence; without wait, a project another sequencer is numbering comes back
// at once with Busy set instead of waiting for that sequencer's lock, and each project gets one
// batch of at most limit. With a holder, a project another instance holds comes back with
// heldFor set, and nothing numbered.
func sequence(ctx context.Context, db DBTX, projects []string, limit int, wait bool, h *holder) (map[string]Head, error) {
	heads := make(map[string]Head, len(projects))
	for {
		got, err := sequenceOnce(ctx, db, projects, limit, wait, h)
		if err != nil {
			_, inTx := db.(pgx.Tx) // the caller's transaction is aborted: nothing more can run in it
			if inTx || !perProject(err) || (projects != nil && len(projects) < 2) {
				return nil, fmt.Errorf("sequence: %w", err)
			}
			return sequenceEach(ctx, db, projects, limit, heads, wait, h)
		}
		var more []string
		for _, h := range got {
			if h.Assigned >= limit {
				more = append(more, h.ProjectID) // there may be more pending
			}
			h.Assigned += heads[h.ProjectID].Assigned
			heads[h.ProjectID] = h
		}
		if len(more) == 0 || !wait {
			// The consumer's call numbers one batch per project: it reads that batch while the
			// next is numbered (see the scan loop's prefetch).
			return heads, nil
		}
		projects = more
	}
}

func sequenceOnce(ctx context.Context, db DBTX, projects []string, limit int, wait bool, hd *holder) ([]Head, error) {
	if !wait {
		limit = -limit // the function's sign for "skip a project another sequencer holds"
	}
	var rows pgx.Rows
	var err error
	if hd == nil {
		rows, err = db.Query(ctx, sequenceSQL, projects, limit)
	} else {
		var channel *string
		if hd.channel != "" {
			channel = &hd.channel
		}
		rows, err = db.Query(ctx, sequenceHeldSQL, projects, limit, hd.owner, hd.hold, channel, hd.gap)
	}
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Head, error) {
		var h Head
		var heldMS int32
		dest := []any{&h.ProjectID, &h.LastSequence, &h.PrunedThrough, &h.Assigned}
		if hd != nil {
			dest = append(dest, &heldMS)
		}
		err := row.Scan(dest...)
		switch h.Assigned {
		case -1: // the function's mark of a project another sequencer held locked
			h.Assigned, h.Busy = 0, true
		case -2: // held by another instance, which numbers it
			h.Assigned = 0
		}
		h.heldFor = time.Duration(heldMS) * time.Millisecond
		return h, err
	})
}

// readHeads reads the heads of projects without sequencing them.
func readHeads(ctx context.Context, db DBTX, projects []string) (map[string]Head, error) {
	rows, err := db.Query(ctx, headsSQL, projects)
	if err != nil {
		return nil, fmt.Errorf("read heads: %w", err)
	}
	got, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Head, error) {
		var h Head
		return h, row.Scan(&h.ProjectID, &h.LastSequence, &h.PrunedThrough)
	})
	if err != nil {
		return nil, fmt.Errorf("read heads: %w", err)
	}
	heads := make(map[string]Head, len(got))
	for _, h := range got {
		heads[h.ProjectID] = h
	}
	return heads, nil
}

// sequenceEach sequences projects one at a time after a call covering them all failed,
// adding to heads what earlier rounds assigned.
func sequenceEach(ctx context.Context, db DBTX, projects []string, limit int, heads map[string]Head, wait bool, hd *holder) (map[string]Head, error) {
	if projects == nil {
		rows, err := db.Query(ctx, sequencedProjectsSQL)
		if err != nil {
			return nil, fmt.Errorf("sequence: list projects: %w", err)
		}
		if projects, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			return nil, fmt.Errorf("sequence: list projects: %w", err)
		}
	}
	failed := map[string]error{}
	for _, p := range projects {
		h, err := sequence(ctx, db, []string{p}, limit, wait, hd)
		if err != nil {
			if ctx.Err() != nil {
				return nil, fmt.Errorf("sequence: %w", ctx.Err())
			}
			failed[p] = err
			delete(heads, p)
			continue
		}
		if got, ok := h[p]; ok {
			got.Assigned += heads[p].Assigned
			heads[p] = got
		}
	}
	if len(failed) == len(projects) && len(projects) > 0 {
		return nil, &ProjectErrors{Op: "sequence", Failed: failed}
	}
	if len(failed) > 0 {
		return heads, &ProjectErrors{Op: "sequence", Failed: failed}
	}
	return heads, nil
}

// perProject reports whether err may be the doing of one project's rows or locks, which
// calling the projects one by one can isolate: a data exception, an integrity violation, a
// lock not granted in time, a deadlock, or the function's own gap check. Anything else (the
// connection, the context, a privilege, the transaction's state) would fail every call alike.
func perProject(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch {
	case pgErr.Code == "22023": // invalid_parameter_value: the call's own arguments
		return false
	case strings.HasPrefix(pgErr.Code, "22"), strings.HasPrefix(pgErr.Code, "23"):
		return true
	}
	switch pgErr.Code {
	case "55P03", "40P01", "XX000": // lock_not_available, deadlock_detected, internal_error (the gap check)
		return true
	}
	return false
}

// isolatingSequencer is the consumer's use of Sequence. It remembers the projects whose
// sequencing failed and sequences each of them in a call of its own until it succeeds, so that a
// project that keeps failing costs one small call per scan and never fails the call of the
// others. Only the consumer's loop goroutine uses it.
type isolatingSequencer struct {
	suspects map[string]bool
}

// sequence is Sequence over projects with the suspects called alone. The error, when some
// projects failed, is a *ProjectErrors and the heads of the others are returned.
func (s *isolatingSequencer) sequence(ctx context.Context, db DBTX, projects []string, limit int, hd *holder) (map[string]Head, error) {
	if s.suspects == nil {
		s.suspects = map[string]bool{}
	}
	healthy := make([]string, 0, len(projects))
	var suspects []string
	for _, p := range projects {
		if s.suspects[p] {
			suspects = append(suspects, p)
		} else {
			healthy = append(healthy, p)
		}
	}
	heads := map[string]Head{}
	failed := map[string]error{}
	if len(healthy) > 0 {
		h, err := sequence(ctx, db, healthy, limit, false, hd)
		var pe *ProjectErrors
		switch {
		case errors.As(err, &pe):
			for p, e := range pe.Failed {
				failed[p] = e
			}
		case err != nil && len(healthy) == 1 && perProject(err):
			failed[healthy[0]] = err
		case err != nil:
			return nil, err
		}
		for p, v := range h {
			heads[p] = v
		}
	}
	for _, p := range suspects {
		h, err := sequence(ctx, db, []string{p}, limit, false, hd)
		if err != nil {
			if !perProject(err) {
				return nil, err
			}
			failed[p] = err
			continue
		}
		delete(s.suspects, p)
		for q, v := range h {
			heads[q] = v
		}
	}
	for p := range failed {
		s.suspects[p] = true
	}
	if len(failed) > 0 {
		return heads, &ProjectErrors{Op: "sequence", Failed: failed}
	}
	return heads, nil
}
