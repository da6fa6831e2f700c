package outbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Head is a project's stream position as the sequencer left it.
type Head struct {
	ProjectID     string
	LastSequence  int64 // the last sequence assigned
	PrunedThrough int64 // rows at or below this may have been pruned
	Assigned      int   // sequences assigned by this call
}

const sequenceSQL = `SELECT project_id, last_sequence, pruned_through, assigned FROM lifecycle_outbox_sequence($1, $2)`

// Sequence numbers the committed, unsequenced events of projects (every project when
// projects is nil), at most limit per project per round, repeating while a project had more,
// and returns each project's head. It must not run inside a REPEATABLE READ or SERIALIZABLE
// transaction: the database function refuses.
//
// Locking cost: one row lock per project on lifecycle_outbox_heads, held for the few
// milliseconds of one call. Only sequencers take it, so writers never wait; sequencers of one
// project wait for each other, sequencers of different projects do not.
func Sequence(ctx context.Context, db DBTX, projects []string, limit int) (map[string]Head, error) {
	heads := make(map[string]Head, len(projects))
	for {
		rows, err := db.Query(ctx, sequenceSQL, projects, limit)
		if err != nil {
			return nil, fmt.Errorf("sequence: %w", err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Head])
		if err != nil {
			return nil, fmt.Errorf("sequence: %w", err)
		}
		var more []string
		for _, h := range got {
			if h.Assigned >= limit {
				more = append(more, h.ProjectID) // there may be more pending
			}
			h.Assigned += heads[h.ProjectID].Assigned
			heads[h.ProjectID] = h
		}
		if len(more) == 0 {
			return heads, nil
		}
		projects = more
	}
}
