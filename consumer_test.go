package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
)

func TestWriterAndObserverProcesses(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	projects := []string{"alpha", "beta"}
	writer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: projects, Config: testkit.FastConfig()})
	for _, p := range projects {
		_, err := writer.Store.CreateMany(ctx, p, "t", 30)
		require.NoError(t, err)
	}
	observer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "dashboard", Projects: projects, Config: testkit.FastConfig()})
	for _, p := range projects {
		require.Len(t, observer.Store.Cache().Live(p), 30)
	}

	for i := range 30 {
		for _, p := range projects {
			_, err := writer.Store.Delete(ctx, p, fmt.Sprintf("t-%d", i+1))
			require.NoError(t, err)
		}
	}
	evs := observer.Rec.WaitCount(t, ctx, 60)
	require.Len(t, evs, 60, "each deletion observed once")
	last := map[string]int64{}
	for _, ev := range evs {
		require.True(t, ev.Observed)
		require.Equal(t, writer.Writer.ProcessID(), ev.WriterProcessID, "carries the writer's identity")
		require.Equal(t, outbox.ConsumerID("dashboard"), ev.ConsumerID)
		require.Equal(t, last[ev.ProjectID]+1, ev.Sequence, "in sequence order per project")
		last[ev.ProjectID] = ev.Sequence
	}
	for _, p := range projects {
		require.Empty(t, observer.Store.Cache().Live(p), "the observer's cache dropped every deleted task")
		testkit.WaitCursor(t, ctx, observer.Pool, p, "dashboard", 30)
	}
	require.Zero(t, pgtest.QueryInt(t, writer.Pool, `SELECT count(*) FROM run_audit WHERE actor <> 'taskstore'`), "the observer wrote no audit row")
	require.Equal(t, 60, pgtest.QueryInt(t, writer.Pool, `SELECT count(*) FROM mailbox_notices`), "one notice per delete, all from the writer")
}

func TestOwnEventsAreNotDeliveredTwiceToOwnListeners(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	proc := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: testkit.FastConfig()})
	var local []testhost.TaskDeleted
	var mu sync.Mutex
	proc.Store.Emitter().On(func(_ context.Context, ev testhost.TaskDeleted) { mu.Lock(); local = append(local, ev); mu.Unlock() })
	other := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}, Config: testkit.FastConfig()})

	_, err := proc.Store.Create(ctx, "p", "mine", "", "")
	require.NoError(t, err)
	_, err = other.Store.Create(ctx, "p", "theirs", "", "")
	require.NoError(t, err)
	_, err = proc.Store.Delete(ctx, "p", "mine")
	require.NoError(t, err)
	_, err = other.Store.Delete(ctx, "p", "theirs")
	require.NoError(t, err)

	testkit.WaitCursor(t, ctx, proc.Pool, "p", "engine", 2)
	evs := proc.Rec.Snapshot()
	require.Len(t, evs, 1, "only the other process's deletion is observed")
	require.Equal(t, "theirs", evs[0].TaskID)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, local, 1, "the local emitter heard its own delete once")
	require.Equal(t, "mine", local[0].TaskID)
	require.Equal(t, int64(1), proc.Consumer.Stats().Own)
}

func TestCompetingConsumersOnlyLeaseHolderAdvances(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	cfg := testkit.FastConfig()
	cfg.Clock = clock
	// Only the fake clock expires A's lease: an hour is beyond any real time a busy machine
	// takes between A's acquisition and B's attempts, as 30s of real time is not.
	cfg.LeaseTTL = time.Hour
	cfg.HeartbeatInterval = 10 * time.Second

	writer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}, Config: cfg})
	_, err := writer.Store.CreateMany(ctx, "p", "t", 5)
	require.NoError(t, err)

	// A takes the lease and blocks in its listener on the third event.
	release, aAt3 := make(chan struct{}), make(chan struct{})
	var aOnce, bOnce sync.Once
	a := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: cfg})
	a.Rec.SetFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence == 3 {
			aOnce.Do(func() { close(aAt3) })
			<-release
		}
		return nil
	})
	outbox.PauseHeartbeat(a.Consumer, true) // A is "frozen" from now on
	b := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: cfg})
	bGate, bAt3 := make(chan struct{}), make(chan struct{})
	b.Rec.SetFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence == 3 {
			bOnce.Do(func() { close(bAt3) })
			<-bGate
		}
		return nil
	})
	waitClosed := func(ch chan struct{}, what string) {
		select {
		case <-ch:
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v", what, ctx.Err())
		}
	}

	for i := range 5 {
		_, err := writer.Store.Delete(ctx, "p", fmt.Sprintf("t-%d", i+1))
		require.NoError(t, err)
	}
	waitClosed(aAt3, "A to reach event 3")
	require.Empty(t, b.Rec.Snapshot(), "B holds no lease while A's is valid")
	outbox.HeartbeatNow(ctx, b.Consumer)
	require.Empty(t, b.Rec.Snapshot(), "B still cannot take an unexpired lease")

	// Time passes beyond A's lease; B takes over with a new epoch, re-delivers from the
	// durable cursor (at-least-once) and is held at 3 itself.
	clock.Advance(time.Hour + time.Second)
	outbox.HeartbeatNow(ctx, b.Consumer)
	st, err := outbox.NewAdmin(b.Pool, outbox.AdminOptions{Clock: clock}).Status(ctx, outbox.StatusFilter{ConsumerID: "engine"})
	require.NoError(t, err)
	require.Len(t, st, 1)
	require.True(t, st[0].LeaseHeld)
	require.Equal(t, int64(2), st[0].LeaseEpoch, "B's acquisition bumped the epoch")
	waitClosed(bAt3, "B to reach event 3")
	before := testkit.CursorOf(t, a.Pool, "p", "engine")
	require.Less(t, before, int64(3))

	// A wakes up late, finishes 3 and tries to acknowledge through 3: rejected.
	close(release)
	deadline, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	for a.Consumer.Stats().LeaseLosses == 0 {
		select {
		case <-deadline.Done():
			t.Fatal("A never noticed it lost the lease")
		case <-time.After(10 * time.Millisecond):
		}
	}
	require.Equal(t, before, testkit.CursorOf(t, a.Pool, "p", "engine"), "A's late acknowledgement was rejected")
	require.Len(t, a.Rec.Snapshot(), 3, "A stopped dispatching once its lease was gone")

	// Only the holder advances.
	close(bGate)
	testkit.WaitCursor(t, ctx, b.Pool, "p", "engine", 5)
	evs := b.Rec.Snapshot()
	require.Equal(t, int64(5), evs[len(evs)-1].Sequence)
}

func TestRestartResumesFromCursor(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	writer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}, Config: testkit.FastConfig()})
	_, err := writer.Store.CreateMany(ctx, "p", "t", 40)
	require.NoError(t, err)

	first := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "cli", Projects: []string{"p"}, Config: testkit.FastConfig()})
	for i := range 20 {
		_, err := writer.Store.Delete(ctx, "p", fmt.Sprintf("t-%d", i+1))
		require.NoError(t, err)
	}
	first.Rec.WaitCount(t, ctx, 20)
	first.Stop(t)
	require.Equal(t, int64(20), testkit.CursorOf(t, writer.Pool, "p", "cli"), "stop flushed the acknowledgements")

	for i := 20; i < 40; i++ {
		_, err := writer.Store.Delete(ctx, "p", fmt.Sprintf("t-%d", i+1))
		require.NoError(t, err)
	}
	second := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "cli", Projects: []string{"p"}, Config: testkit.FastConfig()})
	evs := second.Rec.WaitCount(t, ctx, 20)
	require.Len(t, evs, 20)
	for i, ev := range evs {
		require.Equal(t, int64(21+i), ev.Sequence, "resumed after the cursor, nothing lost or repeated")
	}
	require.Zero(t, second.Consumer.Stats().Reconciliations)
}

func TestNotificationWakesConsumerAndPollingCoversLostOnes(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	writer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}, Config: testkit.FastConfig()})
	_, err := writer.Store.CreateMany(ctx, "p", "t", 20)
	require.NoError(t, err)

	t.Run("a notification wakes a consumer that polls hourly", func(t *testing.T) {
		cfg := testkit.FastConfig()
		cfg.PollInterval = time.Hour
		obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "hourly", Projects: []string{"p"}, Config: cfg})
		testkit.WaitCursor(t, ctx, obs.Pool, "p", "hourly", 0) // positioned; LISTEN is up before the first scan
		_, err := writer.Store.Delete(ctx, "p", "t-1")
		require.NoError(t, err)
		prompt, cancel := context.WithTimeout(ctx, testkit.WaitLimit) // far below the hour
		defer cancel()
		obs.Rec.WaitCount(t, prompt, 1)
	})

	t.Run("with the LISTEN connection killed, polling still delivers everything", func(t *testing.T) {
		cfg := testkit.FastConfig()
		cfg.PollInterval = 100 * time.Millisecond
		obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "poller", Projects: []string{"p"}, Config: cfg})
		testkit.WaitCursor(t, ctx, obs.Pool, "p", "poller", 1)
		admin := pgtest.Pool(t, db.URL)
		var killed int
		require.NoError(t, admin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE datname = current_database() AND query ILIKE 'LISTEN%'`).Scan(&killed))
		require.GreaterOrEqual(t, killed, 1)
		for i := 2; i <= 20; i++ {
			_, err := writer.Store.Delete(ctx, "p", fmt.Sprintf("t-%d", i))
			require.NoError(t, err)
		}
		evs := obs.Rec.WaitCount(t, ctx, 20)
		require.Len(t, evs, 20, "the first deletion and the 19 made while LISTEN was down")
		testkit.WaitCursor(t, ctx, obs.Pool, "p", "poller", 20)
	})

	t.Run("a separate LISTEN DSN, and payloads that are not ours, are handled", func(t *testing.T) {
		_, err := writer.Store.CreateMany(ctx, "p", "u", 3)
		require.NoError(t, err)
		cfg := testkit.FastConfig()
		cfg.PollInterval = time.Hour
		cfg.ListenDSN = db.URL
		obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "own-listen", Projects: []string{"p"}, Config: cfg})
		testkit.WaitCursor(t, ctx, obs.Pool, "p", "own-listen", 20)
		// Garbage on our channel: skipped with a log line, nothing lost or stuck.
		for _, payload := range []string{"", "not ours!", `{"project":"p"}`, strings.Repeat("x", 300), "other-project"} {
			_, err := writer.Pool.Exec(ctx, `SELECT pg_notify('lifecycle_outbox', $1)`, payload)
			require.NoError(t, err)
		}
		for i := 1; i <= 3; i++ {
			_, err := writer.Store.Delete(ctx, "p", fmt.Sprintf("u-%d", i))
			require.NoError(t, err)
		}
		prompt, cancel := context.WithTimeout(ctx, testkit.WaitLimit) // far below the hour
		defer cancel()
		evs := obs.Rec.WaitCount(t, prompt, 23) // the 20 it replayed from the oldest, then the new ones
		require.Len(t, evs, 23)
		require.Equal(t, []int64{21, 22, 23}, []int64{evs[20].Sequence, evs[21].Sequence, evs[22].Sequence})
	})
}

// TestConsumerWithoutPreparedStatementCache runs writer and consumer on pools that keep no
// prepared statements, as a transaction-pooling proxy needs: the module holds no session
// state outside its LISTEN connection.
func TestConsumerWithoutPreparedStatementCache(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	cfg.MaxConns = 8
	pool := pgtest.PoolConfig(t, cfg)

	w, err := outbox.NewWriter(pool, outbox.Config{}, zaptest.NewLogger(t))
	require.NoError(t, err)
	defer testkit.CloseWriter(t, w)
	store := testhost.New(pool, testhost.Options{Writer: w})
	_, err = store.CreateMany(ctx, "p", "t", 5)
	require.NoError(t, err)
	rec := testkit.NewRecorder()
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: "proxied", Pool: pool, Config: testkit.FastConfig(), Projects: outbox.StaticProjects{"p"},
		Dispatcher: outbox.NewDispatcher(outbox.DispatcherOptions{Listeners: []outbox.Listener{rec}, NoLocalWriter: true}), Logger: zaptest.NewLogger(t)})
	require.NoError(t, err)
	require.NoError(t, c.Start(ctx))
	defer func() { require.NoError(t, c.Stop(context.Background())) }()
	other := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}})
	for i := 1; i <= 5; i++ {
		_, err := other.Store.Delete(ctx, "p", fmt.Sprintf("t-%d", i))
		require.NoError(t, err)
	}
	rec.WaitCount(t, ctx, 5)
	testkit.WaitCursor(t, ctx, pool, "p", "proxied", 5)
}

func TestReconciliation(t *testing.T) {
	t.Parallel()
	// Each subtest takes its own deadline once it runs (testkit.Ctx), and hands it to these
	// helpers: parallel subtests wait for a free slot after this function returns, and a
	// deadline taken here could pass while they wait.
	setup := func(t *testing.T, ctx context.Context) (pgtest.DB, *testkit.Process) {
		db := pgtest.NewDB(t)
		w := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}, Config: testkit.FastConfig()})
		_, err := w.Store.CreateMany(ctx, "p", "t", 10)
		require.NoError(t, err)
		for i := range 4 {
			_, err := w.Store.Delete(ctx, "p", fmt.Sprintf("t-%d", i+1))
			require.NoError(t, err)
			_, err = outbox.Sequence(ctx, w.Pool, nil, 100) // a tick each, so that one can be pruned whole
			require.NoError(t, err)
		}
		return db, w
	}
	reasonOf := func(t *testing.T, ctx context.Context, pool *pgxpool.Pool, consumer string) string {
		var r string
		require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(reconcile_reason, '') FROM lifecycle_consumer_cursors WHERE consumer_id = $1`, consumer).Scan(&r))
		return r
	}

	t.Run("missing cursor", func(t *testing.T) {
		t.Parallel()
		ctx := testkit.Ctx(t)
		db, w := setup(t, ctx)
		cfg := testkit.FastConfig()
		cfg.NewCursor = outbox.NewCursorReconcile
		obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "fresh", Projects: []string{"p"}, Config: cfg, NoStart: true})
		require.NoError(t, obs.Store.Cache().ReplaceLive(ctx, "p", []string{"t-1", "stale-id"}))
		obs.Start(t)
		testkit.WaitCursor(t, ctx, w.Pool, "p", "fresh", 4)
		require.Equal(t, string(outbox.ReasonMissingCursor), reasonOf(t, ctx, w.Pool, "fresh"))
		require.Len(t, obs.Store.Cache().Live("p"), 6, "the live set replaced the cache; stale IDs dropped")
		require.False(t, obs.Store.Cache().Has("p", "stale-id"))
		require.Empty(t, obs.Rec.Snapshot(), "history before the head is not replayed")
	})

	t.Run("cursor ahead of head", func(t *testing.T) {
		t.Parallel()
		ctx := testkit.Ctx(t)
		db, w := setup(t, ctx)
		_, err := w.Pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('p', 'ahead', 99)`)
		require.NoError(t, err)
		testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "ahead", Projects: []string{"p"}, Config: testkit.FastConfig()})
		testkit.WaitCursor(t, ctx, w.Pool, "p", "ahead", 4)
		require.Equal(t, string(outbox.ReasonCursorAheadOfHead), reasonOf(t, ctx, w.Pool, "ahead"))
	})

	t.Run("cursor below the pruned floor", func(t *testing.T) {
		t.Parallel()
		ctx := testkit.Ctx(t)
		db, w := setup(t, ctx)
		_, err := w.Pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('p', 'behind', 1)`)
		require.NoError(t, err)
		tag, err := w.Pool.Exec(ctx, `DELETE FROM lifecycle_event_log WHERE project_id = 'p' AND task_id IN ('t-1', 't-2', 't-3')`)
		require.NoError(t, err)
		require.Equal(t, int64(3), tag.RowsAffected())
		_, err = w.Pool.Exec(ctx, `UPDATE lifecycle_outbox_heads SET pruned_through = 3, last_sequence = GREATEST(last_sequence, 3) WHERE project_id = 'p'`)
		require.NoError(t, err)
		obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "behind", Projects: []string{"p"}, Config: testkit.FastConfig(), NoStart: true})
		all := make([]string, 10)
		for i := range all {
			all[i] = fmt.Sprintf("t-%d", i+1)
		}
		require.NoError(t, obs.Store.Cache().ReplaceLive(ctx, "p", all)) // a cache that missed the deletions
		obs.Start(t)
		testkit.WaitCursor(t, ctx, w.Pool, "p", "behind", 4)
		require.Equal(t, string(outbox.ReasonCursorBelowPrunedFloor), reasonOf(t, ctx, w.Pool, "behind"))
		require.False(t, obs.Store.Cache().Has("p", "t-2"), "the pruned deletion is reflected by the rebuilt cache")
	})

	t.Run("a delete committed while reconciling is not lost", func(t *testing.T) {
		t.Parallel()
		ctx := testkit.Ctx(t)
		db, w := setup(t, ctx)
		cfg := testkit.FastConfig()
		cfg.NewCursor = outbox.NewCursorReconcile
		deleted := make(chan error, 1)
		racing := &racingLiveTasks{inner: w.Store, during: func() {
			_, err := w.Store.Delete(ctx, "p", "t-9")
			deleted <- err
		}}
		obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "racer", Projects: []string{"p"}, Config: cfg, Live: racing})
		require.NoError(t, <-deleted)
		evs := obs.Rec.WaitCount(t, ctx, 1)
		require.Equal(t, "t-9", evs[0].TaskID)
		require.False(t, obs.Store.Cache().Has("p", "t-9"))
		testkit.WaitCursor(t, ctx, w.Pool, "p", "racer", 5)
	})
}

// racingLiveTasks commits a delete from another connection while the reconciliation snapshot
// is open, after the head was read.
type racingLiveTasks struct {
	inner  outbox.LiveTasks
	once   sync.Once
	during func()
}

func (r *racingLiveTasks) LiveTaskIDsTx(ctx context.Context, tx pgx.Tx, project string) ([]string, error) {
	r.once.Do(r.during)
	return r.inner.LiveTaskIDsTx(ctx, tx, project)
}

func TestObservedListenerCannotPerformWriterOwnedEffects(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	writer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}, Config: testkit.FastConfig()})
	_, err := writer.Store.CreateMany(ctx, "p", "t", 3)
	require.NoError(t, err)

	var mu sync.Mutex
	var errs []error
	obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "sneaky", Projects: []string{"p"}, Config: testkit.FastConfig(), NoStart: true})
	sneaky := outbox.ListenerFunc("sneaky", func(ctx context.Context, ev outbox.ObservedEvent) error {
		task := testhost.Task{ProjectID: ev.ProjectID, ID: ev.TaskID, Column: ev.PriorColumn}
		record := func(err error) { mu.Lock(); errs = append(errs, err); mu.Unlock() }
		record(obs.Store.SendDeleteNotice(ctx, task))
		tx, err := obs.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		record(obs.Store.WriteDeleteAuditTx(ctx, tx, task))
		_, _, err = obs.Writer.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: ev.ProjectID, TaskID: "t-3", DeletedAt: ev.DeletedAt})
		record(err)
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		_, err = obs.Store.Delete(ctx, ev.ProjectID, "t-3")
		record(err)
		return nil
	})
	// The sneaky listener joins the observer's dispatcher; built here so it can use obs.
	obs.Consumer = newConsumerWith(t, obs, "sneaky", []string{"p"}, testkit.FastConfig(), sneaky)
	obs.Start(t)
	_, err = writer.Store.Delete(ctx, "p", "t-1")
	require.NoError(t, err)
	obs.Rec.WaitCount(t, ctx, 1)
	testkit.WaitCursor(t, ctx, obs.Pool, "p", "sneaky", 1)

	mu.Lock()
	defer mu.Unlock()
	require.Len(t, errs, 4)
	for _, err := range errs {
		var fence *outbox.FenceError
		require.ErrorAs(t, err, &fence)
		require.True(t, errors.Is(err, outbox.ErrObservedContext))
	}
	require.Equal(t, 1, pgtest.QueryInt(t, writer.Pool, `SELECT count(*) FROM mailbox_notices`))
	require.Equal(t, 1, pgtest.QueryInt(t, writer.Pool, `SELECT count(*) FROM run_audit`))
	require.Equal(t, 1, pgtest.QueryInt(t, writer.Pool, `SELECT count(*) FROM lifecycle_event_log`))
	task, err := writer.Store.Get(ctx, "p", "t-3")
	require.NoError(t, err)
	require.Nil(t, task.DeletedAt, "the observer's delete was refused")
}

func TestIdentityFromPersistedSetting(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	settings := testhost.NewSettings(pool, "node-1")

	_, ok, err := outbox.ResolveConsumerID(ctx, settings, "outbox.consumer_id")
	require.NoError(t, err)
	require.False(t, ok, "absent: observation disabled")

	require.NoError(t, settings.Set(ctx, "outbox.consumer_id", ""))
	_, ok, err = outbox.ResolveConsumerID(ctx, settings, "outbox.consumer_id")
	require.NoError(t, err)
	require.False(t, ok, "empty: observation disabled")

	for _, bad := range []string{" dash", "dash board", "dash\n", "-lead", "x/y", strings.Repeat("a", 129)} {
		require.NoError(t, settings.Set(ctx, "outbox.consumer_id", bad))
		_, ok, err = outbox.ResolveConsumerID(ctx, settings, "outbox.consumer_id")
		require.False(t, ok)
		var verr *outbox.ValidationError
		require.ErrorAs(t, err, &verr, "%q", bad)
		require.Equal(t, "outbox.consumer_id", verr.Field, "the error names the field")
	}

	require.NoError(t, settings.Set(ctx, "outbox.consumer_id", "dashboard.eu-1"))
	id, ok, err := outbox.ResolveConsumerID(ctx, settings, "outbox.consumer_id")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, outbox.ConsumerID("dashboard.eu-1"), id)
}
