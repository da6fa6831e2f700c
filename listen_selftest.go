package outbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// The wake-up self-test. A LISTEN through a transaction-pooling proxy succeeds and then hears
// nothing: the proxy ran it on a server connection the consumer no longer holds. Polling still
// delivers every event, so the failure is silent unless someone looks. After each LISTEN the
// consumer therefore sends one notification to itself through its pool, on the same channel,
// the way writers send theirs, and expects it on the LISTEN connection within
// Config.ListenCheckTimeout. When it arrives the wake-ups are proven; when it does not, the
// consumer says once what to do, stops listening and runs on polling alone, and Wakeups,
// Runner.Wakeups and the outbox_listen_wakeups_working gauge say so.
//
// The payload is "selftest/<random hex>", which is not a project ID: other consumers on the
// channel skip it as not theirs.

// WakeupState says whether a consumer's LISTEN wake-ups were proven to arrive.
type WakeupState string

// Wake-up states.
const (
	// WakeupsUnchecked: the consumer has not listened yet, or its self-test is under way.
	WakeupsUnchecked WakeupState = "unchecked"
	// WakeupsWorking: the self-test notification arrived on the LISTEN connection.
	WakeupsWorking WakeupState = "working"
	// WakeupsPollingOnly: the self-test notification never arrived; the consumer stopped
	// listening and finds events by polling alone, every Config.PollInterval. Set
	// Config.ListenDSN to a direct connection to PostgreSQL to get wake-ups back.
	WakeupsPollingOnly WakeupState = "polling-only"
	// WakeupsDisabled: Config.NotifyDisabled; the consumer polls by design.
	WakeupsDisabled WakeupState = "disabled"
)

const selfTestPrefix = "selftest/"

const selfTestNotifySQL = `SELECT pg_notify($1, $2)`

// errPollingOnly ends the listen loop for good: the self-test failed.
var errPollingOnly = errors.New("LISTEN wake-ups do not arrive")

// wakeupCheck is a consumer's self-test state, shared by the listen goroutine and readers.
type wakeupCheck struct {
	state  atomic.Value // WakeupState
	logged sync.Once
}

func (w *wakeupCheck) load() WakeupState {
	if s, ok := w.state.Load().(WakeupState); ok {
		return s
	}
	return WakeupsUnchecked
}

// Wakeups says whether the consumer's LISTEN wake-ups were proven to work (see WakeupState).
func (c *Consumer) Wakeups() WakeupState {
	if c.cfg.NotifyDisabled {
		return WakeupsDisabled
	}
	return c.wakeups.load()
}

// WakeupsWorking reports whether the self-test notification arrived on the LISTEN connection.
func (c *Consumer) WakeupsWorking() bool { return c.Wakeups() == WakeupsWorking }

// Wakeups is the running consumer's wake-up state, or "" when no consumer runs.
func (r *Runner) Wakeups() WakeupState {
	c := r.Consumer()
	if c == nil {
		return ""
	}
	return c.Wakeups()
}

// selfTest is one run of the self-test on a fresh LISTEN connection.
type selfTest struct {
	token string
	timer *time.Timer
}

// startSelfTest sends the self-test notification through the pool and arms the bound: when it
// passes before the notification arrived, cancel stops the LISTEN connection's wait.
func (c *Consumer) startSelfTest(ctx context.Context, cancel context.CancelFunc) (*selfTest, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("wake-up self-test token: %w", err)
	}
	st := &selfTest{token: selfTestPrefix + hex.EncodeToString(b[:])}
	sendCtx, stop := context.WithTimeout(ctx, 10*time.Second)
	defer stop()
	if _, err := c.pool.Exec(sendCtx, selfTestNotifySQL, c.cfg.NotifyChannel, st.token); err != nil {
		return nil, fmt.Errorf("wake-up self-test: send: %w", err)
	}
	st.timer = time.AfterFunc(c.cfg.ListenCheckTimeout, cancel)
	return st, nil
}

// received handles a self-test notification; it reports whether n was ours.
func (c *Consumer) received(st *selfTest, payload string) bool {
	if st == nil || payload != st.token {
		return false
	}
	if st.timer.Stop() {
		c.wakeups.state.Store(WakeupsWorking)
		c.metrics.wakeups(string(c.id), true)
		c.log.Debug("wake-up self-test passed: notifications reach the LISTEN connection")
	}
	return true
}

// selfTestFailed records a failed self-test, says once what to do, and drops what the LISTEN
// registered where it can. It returns errPollingOnly, which ends the listen loop.
func (c *Consumer) selfTestFailed(conn *pgx.Conn) error {
	c.wakeups.state.Store(WakeupsPollingOnly)
	c.metrics.wakeups(string(c.id), false)
	c.wakeups.logged.Do(func() {
		fix := "set ListenDSN (listen_dsn) to a connection string that reaches PostgreSQL directly, not through the pooler"
		if c.cfg.ListenDSN != "" {
			fix = "ListenDSN (listen_dsn) is set: point it at PostgreSQL directly, not at the pooler"
		}
		c.log.Warn("LISTEN wake-ups do not arrive (is the pool behind a transaction-pooling proxy?); the consumer runs on polling alone",
			zap.String("channel", c.cfg.NotifyChannel), zap.Duration("self_test_timeout", c.cfg.ListenCheckTimeout),
			zap.Duration("poll_interval", c.cfg.PollInterval), zap.String("fix", fix))
	})
	// Behind a proxy the LISTEN stays registered on a shared server connection; an UNLISTEN
	// there may land on the same one. Best effort: the connection is closed next.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, _ = conn.Exec(ctx, "UNLISTEN "+pgx.Identifier{c.cfg.NotifyChannel}.Sanitize())
	return errPollingOnly
}

func newListenWakeupsGauge() *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "outbox_listen_wakeups_working",
		Help: "1 when the consumer's wake-up self-test notification arrived on its LISTEN connection, 0 when it did not and the consumer polls alone (set ListenDSN)."},
		[]string{"consumer"})
}

func (m *Metrics) wakeups(consumer string, working bool) {
	if m == nil {
		return
	}
	v := 0.0
	if working {
		v = 1
	}
	m.listenWakeups.WithLabelValues(consumer).Set(v)
}
