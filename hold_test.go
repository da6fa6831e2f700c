package outbox_test

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

// The sequencer's holder (migration 0008): the consumer instance that numbers a project holds
// it for a while, the other instances leave it alone, and the holder announces what it numbered.

const (
	holderA = "dash@00000000000000aa"
	holderB = "engine@00000000000000bb"
)

// sequenceAs calls the consumer's form of the sequencer as instance owner and returns each
// project's assigned count and held_ms.
func sequenceAs(t *testing.T, db outbox.DBTX, owner string, channel any, gap string, projects ...string) (assigned, heldMS map[string]int) {
	t.Helper()
	rows, err := db.Query(ctxT(t), `SELECT project_id, assigned, held_ms
		FROM lifecycle_outbox_sequence($1::text[], -100, $2::text, '1 second'::interval, $3::text, $4::interval)`, projects, owner, channel, gap)
	require.NoError(t, err)
	assigned, heldMS = map[string]int{}, map[string]int{}
	for _, r := range must(pgx.CollectRows(rows, pgx.RowToMap))(t) {
		p := r["project_id"].(string)
		assigned[p], heldMS[p] = int(r["assigned"].(int32)), int(r["held_ms"].(int32))
	}
	return assigned, heldMS
}

func queryString(t *testing.T, db outbox.DBTX, sql string, args ...any) string {
	t.Helper()
	var v string
	require.NoError(t, db.QueryRow(ctxT(t), sql, args...).Scan(&v))
	return v
}

func must[T any](v T, err error) func(*testing.T) T {
	return func(t *testing.T) T {
		t.Helper()
		require.NoError(t, err)
		return v
	}
}

func TestSequencerLeavesAHeldProjectToItsHolder(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	pending := func() int {
		return pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_outbox_pending WHERE project_id = 'a'`)
	}
	_, err := pool.Exec(ctx, insertPendingRow, "a", "t1")
	require.NoError(t, err)

	assigned, held := sequenceAs(t, pool, holderA, nil, "0", "a")
	require.Equal(t, 1, assigned["a"])
	require.Zero(t, held["a"], "the caller's own hold is not reported as another's")
	require.Equal(t, holderA, queryString(t, pool, `SELECT sequencer_owner FROM lifecycle_outbox_heads WHERE project_id = 'a'`))

	// Another instance leaves the held project alone and learns for how long.
	_, err = pool.Exec(ctx, insertPendingRow, "a", "t2")
	require.NoError(t, err)
	assigned, held = sequenceAs(t, pool, holderB, nil, "0", "a")
	require.Equal(t, -2, assigned["a"], "the function's mark of a project another instance holds")
	require.Positive(t, held["a"])
	require.LessOrEqual(t, held["a"], 1000)
	require.Equal(t, 1, pending(), "the other instance numbered nothing")

	// The holder goes on numbering it; Sequence, which names no holder, numbers regardless.
	assigned, _ = sequenceAs(t, pool, holderA, nil, "0", "a")
	require.Equal(t, 1, assigned["a"])
	_, err = pool.Exec(ctx, insertPendingRow, "a", "t3")
	require.NoError(t, err)
	heads, err := outbox.Sequence(ctx, pool, []string{"a"}, 10)
	require.NoError(t, err)
	require.EqualValues(t, 3, heads["a"].LastSequence)

	// A hold that ran out (its holder died) is taken over by the next instance that numbers.
	_, err = pool.Exec(ctx, `UPDATE lifecycle_outbox_heads SET sequencer_until = now() - interval '1 millisecond' WHERE project_id = 'a'`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, insertPendingRow, "a", "t4")
	require.NoError(t, err)
	assigned, held = sequenceAs(t, pool, holderB, nil, "0", "a")
	require.Equal(t, 1, assigned["a"])
	require.Zero(t, held["a"])
	require.Equal(t, holderB, queryString(t, pool, `SELECT sequencer_owner FROM lifecycle_outbox_heads WHERE project_id = 'a'`))

	// A holder that gives its holds up hands the project over at once.
	require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT lifecycle_outbox_release_sequencer($1)`, holderB))
	_, err = pool.Exec(ctx, insertPendingRow, "a", "t5")
	require.NoError(t, err)
	assigned, _ = sequenceAs(t, pool, holderA, nil, "0", "a")
	require.Equal(t, 1, assigned["a"])
	require.Zero(t, pending())
	require.EqualValues(t, 5, pgtest.QueryInt(t, pool, `SELECT last_sequence FROM lifecycle_outbox_heads WHERE project_id = 'a'`), "no gap")
}

// TestSequencerAnnouncesWhatItNumbered: the holder wakes the other consumers, at most once per
// gap per project, and only for projects that got numbers.
func TestSequencerAnnouncesWhatItNumbered(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	listener, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer listener.Release()
	_, err = listener.Exec(ctx, `LISTEN held_test`)
	require.NoError(t, err)
	// announced waits for the next announcement and returns its payload.
	announced := func() string {
		n, err := listener.Conn().WaitForNotification(ctx)
		require.NoError(t, err)
		return n.Payload
	}
	// quiet says whether nothing was announced: it sends a marker after whatever was committed
	// before, and notifications come in commit order, so the marker comes first when nothing
	// did, however slowly a busy machine delivers them.
	quiet := func() bool {
		_, err := pool.Exec(ctx, `SELECT pg_notify('held_test', 'marker')`)
		require.NoError(t, err)
		return announced() == "marker"
	}

	for _, p := range []string{"a", "b"} {
		_, err = pool.Exec(ctx, insertPendingRow, p, "t1")
		require.NoError(t, err)
	}
	assigned, _ := sequenceAs(t, pool, holderA, "held_test", "1 hour", "a", "b", "c")
	require.Equal(t, map[string]int{"a": 1, "b": 1}, assigned)
	got := map[string]bool{}
	for range 2 {
		got[announced()] = true
	}
	require.Equal(t, map[string]bool{"a": true, "b": true}, got, "an announcement for each numbered project")
	require.True(t, quiet(), "one announcement each")

	// Within the gap: numbered, not announced again.
	_, err = pool.Exec(ctx, insertPendingRow, "a", "t2")
	require.NoError(t, err)
	assigned, _ = sequenceAs(t, pool, holderA, "held_test", "1 hour", "a")
	require.Equal(t, 1, assigned["a"])
	require.True(t, quiet(), "a second announcement within the gap")

	// After the gap: announced. And a call that numbers nothing announces nothing.
	_, err = pool.Exec(ctx, insertPendingRow, "a", "t3")
	require.NoError(t, err)
	sequenceAs(t, pool, holderA, "held_test", "0", "a")
	require.Equal(t, "a", announced())
	sequenceAs(t, pool, holderA, "held_test", "0", "a", "b")
	require.True(t, quiet(), "nothing numbered, nothing announced")
}

// TestSequencerHoldRefusesBadArguments: what names a holder, how long it holds and where it
// announces are checked by the database, not trusted.
func TestSequencerHoldRefusesBadArguments(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	call := `SELECT count(*) FROM lifecycle_outbox_sequence(ARRAY['a'], -10, $1::text, $2::interval, $3::text, $4::interval)`
	for _, c := range []struct {
		name                 string
		owner, hold, ch, gap any
	}{
		{"owner without instance", "dash", "1 second", nil, nil},
		{"owner with spaces", "da sh@00000000000000aa", "1 second", nil, nil},
		{"no hold", holderA, nil, nil, nil},
		{"zero hold", holderA, "0", nil, nil},
		{"hold over an hour", holderA, "2 hours", nil, nil},
		{"channel with upper case", holderA, "1 second", "Wake", "0"},
		{"channel without gap", holderA, "1 second", "wake", nil},
		{"negative gap", holderA, "1 second", "wake", "-1 second"},
	} {
		_, err := pool.Exec(ctx, call, c.owner, c.hold, c.ch, c.gap)
		require.Error(t, err, c.name)
		requireSQLState(t, err, "22023")
	}
	_, err := pool.Exec(ctx, `SELECT lifecycle_outbox_release_sequencer('nobody')`)
	requireSQLState(t, err, "22023")
}

// TestReleaseSequencerTouchesOnlyTheCallersProjects: a project-A consumer role cannot give up
// (or learn of) a hold on project B, whatever instance name it passes.
func TestReleaseSequencerTouchesOnlyTheCallersProjects(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	lp := newLeastPrivilege(t)
	for _, p := range []string{"proj-a", "proj-b"} {
		_, err := lp.owner.Exec(ctx, insertPendingRow, p, "t1")
		require.NoError(t, err)
	}
	sequenceAs(t, lp.owner, holderA, nil, "0", "proj-a", "proj-b")
	consumer, _ := lp.component(t, "consumer", consumerGrant("dash", "proj-a"))

	require.Equal(t, 1, pgtest.QueryInt(t, consumer, `SELECT lifecycle_outbox_release_sequencer($1)`, holderA))
	require.Equal(t, 1, pgtest.QueryInt(t, lp.owner,
		`SELECT count(*) FROM lifecycle_outbox_heads WHERE project_id = 'proj-b' AND sequencer_owner = $1 AND sequencer_until > now()`, holderA),
		"project B's hold is untouched")
	_, held := sequenceAs(t, consumer, holderB, nil, "0", "proj-a", "proj-b")
	require.NotContains(t, held, "proj-b", "project B is not reported")
}

// TestConsumersOfAProjectLeaveItToOneSequencer: of two consumers of a project, the one that
// numbered first numbers every later event too while the other only reads, and both get every
// event. Stopping the holder gives its hold up, and the other numbers at once.
func TestConsumersOfAProjectLeaveItToOneSequencer(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	cfg := fastConfig()
	c1, rec1 := startConsumer(t, pool, "c1", []string{"p"}, cfg, nil)
	c2, rec2 := startConsumer(t, pool, "c2", []string{"p"}, cfg, nil)
	write := func(task string) {
		_, err := pool.Exec(ctx, insertPendingRow, "p", task)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `SELECT pg_notify('lifecycle_outbox', 'p')`)
		require.NoError(t, err)
	}
	const n = 30
	for i := range n {
		write(fmt.Sprintf("t%d", i))
	}
	rec1.waitCount(t, ctx, n)
	rec2.waitCount(t, ctx, n)

	holder, other := c1, c2
	if c2.Stats().Numbered > 0 {
		holder, other = c2, c1
	}
	require.EqualValues(t, n, holder.Stats().Numbered, "the holder numbered every event")
	require.Zero(t, other.Stats().Numbered, "the other instance numbered none")
	require.Equal(t, holder.LeaseOwner(), queryString(t, pool, `SELECT sequencer_owner FROM lifecycle_outbox_heads WHERE project_id = 'p'`))

	stopConsumer(t, holder)
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_outbox_heads WHERE project_id = 'p' AND sequencer_until IS NOT NULL`),
		"the stopped holder gave its hold up")
	write("after-stop")
	otherRec := rec1
	if other == c2 {
		otherRec = rec2
	}
	otherRec.waitCount(t, ctx, n+1)
	require.EqualValues(t, 1, other.Stats().Numbered)
}

// TestDrainNumbersTheNextBatchWhileDispatching: draining a backlog, the consumer numbers the
// next batch while its listeners handle this one. The listener holds the first event of the
// second batch until a third sequencer call has started: a loop that numbered only between
// batches would never start it, since it is busy dispatching that event.
func TestDrainNumbersTheNextBatchWhileDispatching(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	seeder := pgtest.Pool(t, db.URL)
	const n, batch = 20, 5
	for i := range n {
		_, err := seeder.Exec(ctx, insertPendingRow, "p", fmt.Sprintf("t%02d", i))
		require.NoError(t, err)
	}
	calls := &statementCounter{sql: outbox.Statements["sequenceHeldSQL"], at: 3, reached: make(chan struct{})}
	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.ConnConfig.Tracer = calls
	pool := pgtest.PoolConfig(t, cfg)

	c := fastConfig()
	c.SequenceBatchSize, c.BatchSize = batch, batch
	c.ListenerTimeout = time.Hour // the listener below waits up to waitLimit, not abandoned before
	_, rec := startConsumer(t, pool, "c1", []string{"p"}, c, nil)
	var waited atomic.Bool
	rec.setFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence != batch+1 {
			return nil
		}
		select {
		case <-calls.reached:
			waited.Store(true)
		case <-time.After(waitLimit):
		}
		return nil
	})
	evs := rec.waitCount(t, ctx, n)
	require.True(t, waited.Load(), "no sequencer call while the second batch was dispatched")
	require.Equal(t, upTo(n), sequencesByProject(evs)["p"], "every event once, in order")
}
