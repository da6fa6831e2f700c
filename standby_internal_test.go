package outbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestStandbyErrorClasses: which standby failures are recovery conflicts (retried), which say
// the standby is down (left until it catches up), and which are neither.
func TestStandbyErrorClasses(t *testing.T) {
	t.Parallel()
	conflict := &pgconn.PgError{Code: pgerrcode.SerializationFailure, Message: "canceling statement due to conflict with recovery"}
	require.True(t, recoveryConflict(fmt.Errorf("read events: %w", conflict)))
	require.True(t, recoveryConflict(&pgconn.PgError{Code: pgerrcode.QueryCanceled, Message: "canceling statement due to conflict with recovery"}))
	require.False(t, recoveryConflict(&pgconn.PgError{Code: pgerrcode.QueryCanceled, Message: "canceling statement due to statement timeout"}))
	require.True(t, recoveryConflict(&pgconn.PgError{Code: pgerrcode.DeadlockDetected, Message: "canceling statement due to conflict with recovery"}))
	require.False(t, recoveryConflict(io.ErrUnexpectedEOF))

	for _, err := range []error{io.ErrUnexpectedEOF, fmt.Errorf("read heads: %w", io.EOF),
		&pgconn.PgError{Code: pgerrcode.AdminShutdown}, &pgconn.PgError{Code: pgerrcode.CannotConnectNow},
		&pgconn.PgError{Code: pgerrcode.ConnectionFailure}} {
		require.True(t, standbyDown(err), "%v", err)
	}
	for _, err := range []error{conflict, &pgconn.PgError{Code: pgerrcode.InvalidTextRepresentation}, errors.New("read sequence 3 after 1")} {
		require.False(t, standbyDown(err), "%v", err)
	}
}

// TestStandbyReadRetriesConflictsThenUsesThePrimary: a read the standby cancels for a recovery
// conflict is tried again there; after readConflictRetries more it runs on the primary, which
// serves the rest of the scan, without leaving the standby for the next. A standby that is
// down is left (logged once, counted); another failure moves only the scan.
func TestStandbyReadRetriesConflictsThenUsesThePrimary(t *testing.T) {
	t.Parallel()
	primary, standby := &pgxpool.Pool{}, &pgxpool.Pool{}
	conflict := &pgconn.PgError{Code: pgerrcode.SerializationFailure, Message: "canceling statement due to conflict with recovery"}
	newLoop := func() (*scanLoop, *observer.ObservedLogs) {
		core, logs := observer.New(zap.InfoLevel)
		st := &stats{}
		cfg := Config{ReadDSN: "host=standby", ReadMaxLag: time.Second}
		return &scanLoop{pool: primary, reads: &readSource{cfg: cfg.consumerConfig(), log: zap.New(core), stats: st, standby: standby, scanStandby: true}}, logs
	}
	// failing returns an fn that fails with err on the standby n times, and records the pools.
	failing := func(err error, n int) (func(*pgxpool.Pool) error, *[]*pgxpool.Pool) {
		var got []*pgxpool.Pool
		return func(db *pgxpool.Pool) error {
			got = append(got, db)
			if db == standby && n > 0 {
				n--
				return err
			}
			return nil
		}, &got
	}
	ctx := context.Background()

	l, _ := newLoop()
	fn, got := failing(conflict, 2)
	require.NoError(t, l.read(ctx, fn))
	require.Equal(t, []*pgxpool.Pool{standby, standby, standby}, *got, "retried on the standby")
	require.True(t, l.reads.scanStandby)
	require.EqualValues(t, 2, l.reads.stats.readConflicts.Load())

	l, _ = newLoop()
	fn, got = failing(conflict, 100)
	require.NoError(t, l.read(ctx, fn))
	require.Len(t, *got, readConflictRetries+2)
	require.Equal(t, primary, (*got)[len(*got)-1], "then read on the primary")
	require.False(t, l.reads.scanStandby, "which serves the rest of the scan")
	require.False(t, l.reads.fallen, "the next scan tries the standby again")
	require.Zero(t, l.reads.stats.readFallbacks.Load())

	l, logs := newLoop()
	fn, got = failing(io.ErrUnexpectedEOF, 100)
	require.NoError(t, l.read(ctx, fn))
	require.Equal(t, []*pgxpool.Pool{standby, primary}, *got)
	require.True(t, l.reads.fallen, "a standby that is down is left")
	require.EqualValues(t, 1, l.reads.stats.readFallbacks.Load())
	require.NoError(t, l.read(ctx, fn))
	require.Equal(t, primary, (*got)[len(*got)-1])
	require.Equal(t, 1, logs.FilterMessageSnippet("reading from the primary").Len(), "logged once")

	l, _ = newLoop()
	fn, got = failing(&pgconn.PgError{Code: pgerrcode.InvalidTextRepresentation}, 100)
	require.NoError(t, l.read(ctx, fn))
	require.Equal(t, []*pgxpool.Pool{standby, primary}, *got)
	require.False(t, l.reads.fallen)
	require.False(t, l.reads.scanStandby)
}

// TestStandbyPauses: a scan waiting for a standby reads it again within 4 ms during the grace
// (so a wait ends at most about 4 ms after the replay of a standby that keeps up), then backs
// off to 20 ms.
func TestStandbyPauses(t *testing.T) {
	t.Parallel()
	cfg := Config{ReadMaxLag: 5 * time.Second}.consumerConfig()
	grace := standbyGrace(cfg)
	pause, waited := time.Millisecond, time.Duration(0)
	var pauses []time.Duration
	for waited += pause; waited < grace; waited += pause {
		pause = standbyPause(pause, waited, cfg)
		pauses = append(pauses, pause)
	}
	require.Equal(t, []time.Duration{2 * time.Millisecond, 4 * time.Millisecond, 4 * time.Millisecond}, pauses[:3])
	require.LessOrEqual(t, slices.Max(pauses), 4*time.Millisecond, "within the grace")
	for range 10 {
		pause = standbyPause(pause, grace, cfg)
	}
	require.Equal(t, 20*time.Millisecond, pause, "after it")
}
