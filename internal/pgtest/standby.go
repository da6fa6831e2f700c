package pgtest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"fusion/outbox/internal/pgcluster"
)

// Pair is a primary and a streaming hot standby of it, both throwaway clusters of their own
// (not the shared test server, which other tests restart and rewrite), for the tests of
// reading from a standby. One pair costs two server starts and a base backup: a test binary
// should start one and share it among its standby tests, leaving the destructive ones
// (promotion) for last.
type Pair struct {
	Primary *pgcluster.Cluster
	Standby *pgcluster.Cluster
	srv     *server
}

// StandbyDB is one test's database on a Pair: URL on the primary, StandbyURL on the standby.
type StandbyDB struct {
	DB
	StandbyURL string
}

// StartPair starts a new primary with the migrated template and a streaming hot standby of it
// (pgcluster.StartStandby), and stops both when t ends. It needs the server binaries: with
// none it fails under CI=true and skips otherwise. TEST_DATABASE_URL and Docker servers are
// not used, since the test must be able to stop, pause and promote them.
func StartPair(t testing.TB) *Pair {
	t.Helper()
	if _, err := pgcluster.FindBinDir(); err != nil {
		skipOrFail(t)
		t.Skipf("pgtest: a standby needs the server binaries: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute) // a failure bound
	defer cancel()
	// Commits are flushed at once (fsync stays off, so a flush costs little): WAL reaches the
	// standby when the commit returns, not within the WAL writer's delay. Function calls are
	// counted (pg_stat_user_functions), on the standby too, so a test can tell which server
	// served a read.
	primary, err := pgcluster.Start(ctx, pgcluster.Options{Settings: map[string]string{"synchronous_commit": "on", "track_functions": "pl"}})
	if err != nil {
		t.Fatalf("pgtest: start the pair's primary: %v", err)
	}
	s := &server{adminURL: primary.URL("postgres"), cluster: primary, kind: "cluster", close: primary.Stop}
	s.template = "outbox_template"
	if err := s.buildTemplate(ctx); err != nil {
		primary.Stop()
		t.Fatalf("pgtest: build the pair's template: %v", err)
	}
	standby, err := pgcluster.StartStandby(ctx, primary)
	if err != nil {
		primary.Stop()
		t.Fatalf("pgtest: start the standby: %v", err)
	}
	t.Cleanup(func() {
		standby.Stop() // first: its slot is dropped on the primary
		primary.Stop()
	})
	return &Pair{Primary: primary, Standby: standby, srv: s}
}

// NewDB creates a fresh migrated database on the pair's primary, waits until the standby
// accepts connections to it, and drops it when t ends (on the primary; the standby follows).
func (p *Pair) NewDB(t testing.TB) StandbyDB {
	t.Helper()
	db, drop, err := p.srv.createDB(p.srv.template)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		if err := drop(); err != nil {
			t.Logf("pgtest: %v", err)
		}
	})
	sdb := StandbyDB{DB: db, StandbyURL: p.Standby.URL(db.Name)}
	if err := p.WaitReplayed(t); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	return sdb
}

// WaitReplayed waits (a minute at most) until the standby has replayed all the WAL the primary
// had written when it was called. It fails when the standby is stopped or paused.
func (p *Pair) WaitReplayed(t testing.TB) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pc, err := pgx.Connect(ctx, p.Primary.URL("postgres"))
	if err != nil {
		return fmt.Errorf("connect to the primary: %w", err)
	}
	defer pc.Close(ctx)
	var lsn string
	if err := pc.QueryRow(ctx, `SELECT pg_catalog.pg_current_wal_insert_lsn()::text`).Scan(&lsn); err != nil {
		return fmt.Errorf("read the primary's WAL position: %w", err)
	}
	sc, err := pgx.Connect(ctx, p.Standby.URL("postgres"))
	if err != nil {
		return fmt.Errorf("connect to the standby: %w", err)
	}
	defer sc.Close(ctx)
	for {
		var done bool
		err := sc.QueryRow(ctx, `SELECT coalesce(pg_catalog.pg_last_wal_replay_lsn() >= $1::text::pg_lsn, false)`, lsn).Scan(&done)
		if err != nil {
			return fmt.Errorf("read the standby's replay position: %w", err)
		}
		if done {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the standby did not replay %s within a minute", lsn)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// PauseReplay pauses the standby's replay (pg_wal_replay_pause: it keeps receiving WAL but
// applies none) until ResumeReplay; t's cleanup resumes it if the standby still runs.
func (p *Pair) PauseReplay(t testing.TB) {
	t.Helper()
	p.standbyExec(t, `SELECT pg_catalog.pg_wal_replay_pause()`)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if c, err := pgx.Connect(ctx, p.Standby.URL("postgres")); err == nil {
			_, _ = c.Exec(ctx, `SELECT pg_catalog.pg_wal_replay_resume() WHERE pg_catalog.pg_is_in_recovery()`)
			_ = c.Close(ctx)
		}
	})
}

// ResumeReplay resumes the standby's replay.
func (p *Pair) ResumeReplay(t testing.TB) {
	t.Helper()
	p.standbyExec(t, `SELECT pg_catalog.pg_wal_replay_resume()`)
}

func (p *Pair) standbyExec(t testing.TB, sql string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := pgx.Connect(ctx, p.Standby.URL("postgres"))
	if err != nil {
		t.Fatalf("pgtest: connect to the standby: %v", err)
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, sql); err != nil {
		t.Fatalf("pgtest: %s: %v", sql, err)
	}
}
