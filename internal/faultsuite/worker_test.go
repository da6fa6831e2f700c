package faultsuite

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox"
	"fusion/outbox/internal/testhost"
)

// The child worker's checks: what its log says it applied, and where its position file says
// it stands.

// workerSummary is what a child worker's log shows.
type workerSummary struct {
	applied         int // events applied, first deliveries
	redelivered     int // events delivered again (at least once, across a kill)
	resets          int // projects reset: told to refetch, their next event starts afresh
	gaps            int // events skipped with no reset before them: lost
	fenceViolations int // writer-owned side effects the fence let through
}

// readWorkerLog checks, project by project, that the worker got each event after the one
// before it, or again (a redelivery after a kill), or after a reset; anything else is a gap.
func readWorkerLog(path string) (workerSummary, error) {
	var s workerSummary
	f, err := os.Open(path)
	if err != nil {
		return s, err
	}
	defer f.Close()
	last := map[string]int64{}
	afterReset := map[string]bool{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r testhost.ApplyRecord
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return s, fmt.Errorf("%s: %w", path, err)
		}
		switch r.Kind {
		case "reset":
			s.resets++
			afterReset[r.Project] = true
			continue
		case "fence-violated":
			s.fenceViolations++
			continue
		case "applied", "duplicate":
		default:
			continue
		}
		switch prev := last[r.Project]; {
		case afterReset[r.Project]:
			delete(afterReset, r.Project)
		case r.Sequence <= prev:
			s.redelivered++
			continue
		case r.Sequence > prev+1:
			s.gaps += int(r.Sequence - prev - 1)
		}
		if r.Kind == "applied" {
			s.applied++
		} else {
			s.redelivered++
		}
		last[r.Project] = r.Sequence
	}
	return s, sc.Err()
}

// workerPositions reads the position file of a worker that follows a stream of projects (all
// the parent serves, sorted): the stream ID 1.<fingerprint>.<seq>... in base 36.
func workerPositions(path string, projects []string) (map[string]int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	parts := strings.Split(strings.TrimSpace(string(b)), ".")
	sorted := slices.Sorted(slices.Values(projects))
	if len(parts) != len(sorted)+2 {
		return nil, fmt.Errorf("position %q does not cover %d projects", b, len(sorted))
	}
	out := map[string]int64{}
	for i, p := range sorted {
		v, err := strconv.ParseInt(parts[i+2], 36, 64)
		if err != nil {
			return nil, fmt.Errorf("position %q: %w", b, err)
		}
		out[p] = v
	}
	return out, nil
}

// waitWorkerCaughtUp waits until the worker's saved position is at the head of every project.
func waitWorkerCaughtUp(ctx context.Context, pool *pgxpool.Pool, positions, consumer string, projects []string) error {
	admin := outbox.NewAdmin(pool, outbox.AdminOptions{})
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var last error
	for {
		st, err := admin.Status(ctx, outbox.StatusFilter{ConsumerID: consumer})
		if err != nil {
			return err
		}
		pos, err := workerPositions(positions, projects)
		switch {
		case errors.Is(err, os.ErrNotExist):
			last = errors.New("the worker saved no position")
		case err != nil:
			return err
		default:
			last = nil
			for _, s := range st {
				if pos[s.ProjectID] < s.Head {
					last = fmt.Errorf("worker at %d of %d in %s", pos[s.ProjectID], s.Head, s.ProjectID)
				}
			}
		}
		if last == nil && len(st) == len(projects) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the child worker did not catch up: %v", last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
