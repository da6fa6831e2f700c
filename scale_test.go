package outbox_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

// statementCounter counts the statements a pool sends (those with text sql, when it is set),
// and closes reached, when it is not nil, as the count reaches at.
type statementCounter struct {
	n       atomic.Int64
	sql     string
	at      int64
	reached chan struct{}
}

func (s *statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if s.sql != "" && d.SQL != s.sql {
		return ctx
	}
	if s.n.Add(1) == s.at && s.reached != nil {
		close(s.reached)
	}
	return ctx
}

func (s *statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func TestOneProcessObservingAThousandProjects(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	admin := pgtest.Pool(t, db.URL)
	const n = 1000
	projects := make([]string, n)
	for i := range projects {
		projects[i] = fmt.Sprintf("proj-%04d", i)
	}
	// A restart of a process that already has cursors in every project.
	_, err := admin.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence)
		SELECT p, 'fleet', 0 FROM unnest($1::text[]) AS p`, projects)
	require.NoError(t, err)

	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	counter := &statementCounter{}
	cfg.ConnConfig.Tracer = counter
	cfg.ConnConfig.RuntimeParams["application_name"] = "scale-observer"
	cfg.MaxConns = 8
	pool := pgtest.PoolConfig(t, cfg)

	rec := testkit.NewRecorder()
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{
		ID: "fleet", Pool: pool, Projects: outbox.StaticProjects(projects),
		Config:     outbox.Config{PollInterval: time.Second, HeartbeatInterval: time.Second, LeaseTTL: 5 * time.Second},
		Dispatcher: outbox.NewDispatcher(outbox.DispatcherOptions{Listeners: []outbox.Listener{rec}, NoLocalWriter: true}),
		Logger:     zaptest.NewLogger(t),
	})
	require.NoError(t, err)
	require.NoError(t, c.Start(ctx))
	defer func() { require.NoError(t, c.Stop(context.Background())) }()

	writer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"proj-0500"}})
	_, err = writer.Store.CreateMany(ctx, "proj-0500", "t", 10)
	require.NoError(t, err)
	_, err = writer.Store.Delete(ctx, "proj-0500", "t-1")
	require.NoError(t, err)
	rec.WaitCount(t, ctx, 1) // started, leased everything, scanned

	// Measure a few intervals of steady state with a trickle of activity in one project.
	start, before := time.Now(), counter.n.Load()
	for i := 2; i <= 10; i++ {
		_, err := writer.Store.Delete(ctx, "proj-0500", fmt.Sprintf("t-%d", i))
		require.NoError(t, err)
	}
	rec.WaitCount(t, ctx, 10)
	for time.Since(start) < 4*time.Second {
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
	intervals := time.Since(start).Seconds() // one heartbeat and one poll per second
	perInterval := float64(counter.n.Load()-before) / intervals
	t.Logf("1000 projects: %.1f statements per heartbeat/poll interval", perInterval)

	var conns, listens int
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE query ILIKE 'LISTEN%')
		FROM pg_stat_activity WHERE application_name = 'scale-observer'`).Scan(&conns, &listens))
	t.Logf("1000 projects: %d connections (%d LISTEN)", conns, listens)

	// One renewal, one tick and one poll scan (heads read, open-deliveries read) per interval,
	// plus the work the nine wake-ups caused in the one busy project: a few dozen at most, where
	// a statement per project would be thousands.
	require.Less(t, perInterval, 30.0)
	require.Equal(t, 2, listens, "one LISTEN connection for all projects' ticks, and the elected ticker's for the writers' hints")
	// The pool's: a scan's heads and open deliveries read at once, an acknowledgement and a
	// renewal, whatever the number of projects.
	require.LessOrEqual(t, conns, 6, "the two dedicated connections and at most four pool connections")
	st, err := outbox.NewAdmin(admin, outbox.AdminOptions{}).Status(ctx, outbox.StatusFilter{ConsumerID: "fleet"})
	require.NoError(t, err)
	held := 0
	for _, s := range st {
		if s.LeaseHeld {
			held++
		}
	}
	require.Equal(t, n, held, "every project's lease is held and renewed")
}
