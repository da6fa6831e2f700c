package outbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// The wake-up self-test. A LISTEN through a transaction-pooling proxy succeeds and then hears
// nothing: the proxy ran it on a server connection the consumer no longer holds. Polling still
// delivers every event, so the failure is silent unless someone looks. After each LISTEN (and
// on joining its process's LISTEN connection, listen_hub.go) the consumer therefore sends one
// notification to itself through its pool, on the same channel, the way writers send theirs,
// and expects it on the LISTEN connection within
// Config.ListenCheckTimeout. When it arrives the wake-ups are proven; when it does not, the
// consumer says once what to do, and Wakeups, Outbox.Wakeups and the
// outbox_listen_wakeups_working gauge say that it runs on polling alone. It keeps the LISTEN
// connection (an idle client costs a proxy no server connection): should a notification
// arrive after all (a database too slow for the bound, not a proxy), the wake-ups count as
// working again.
//
// The payload is "selftest/<random hex>", which is not a project ID: other consumers on the
// channel skip it as not theirs.

// WakeupState says whether a consumer's LISTEN wake-ups were proven to arrive.
type WakeupState string

// Wake-up states.
const (
	// WakeupsUnchecked: the consumer has not listened yet, or its self-test is under way.
	WakeupsUnchecked WakeupState = "unchecked"
	// WakeupsWorking: the self-test notification (or another one) arrived on the LISTEN
	// connection.
	WakeupsWorking WakeupState = "working"
	// WakeupsPollingOnly: the self-test notification did not arrive in time, or
	// Config.TransactionPooler is set without Config.ListenDSN (no LISTEN goes through a
	// transaction pooler); the consumer finds events by polling alone, every Config.PollInterval. Set Config.ListenDSN to a
	// direct connection to PostgreSQL to get wake-ups back.
	WakeupsPollingOnly WakeupState = "polling-only"
	// WakeupsDisabled: Config.NotifyDisabled; the consumer polls by design.
	WakeupsDisabled WakeupState = "disabled"
)

const selfTestPrefix = "selftest/"

const selfTestNotifySQL = `SELECT pg_catalog.pg_notify($1, $2)`

// wakeupCheck is a consumer's self-test state, shared by the listen goroutine, the self-test's
// timer and readers.
type wakeupCheck struct {
	mu     sync.Mutex
	state  WakeupState // "" until the first outcome
	warned bool
	// The self-test under way: its run (each start and stop moves it on, so a send or a bound
	// of an earlier run does nothing), its payload and its bound (nil until the send is done).
	run   int
	token string
	timer *time.Timer
}

func (w *wakeupCheck) load() WakeupState {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.state == "" {
		return WakeupsUnchecked
	}
	return w.state
}

// Wakeups is the running consumer's wake-up state, or "" when no consumer runs.
func (o *Outbox) Wakeups() WakeupState {
	c := o.Consumer()
	if c == nil {
		return ""
	}
	return c.Wakeups()
}

// startSelfTest starts a self-test: the notification is sent through the pool by a goroutine
// of its own (the caller holds the hub's lock), and its bound is armed once it is sent.
func (wk *waker) startSelfTest() {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	w := &wk.check
	w.mu.Lock()
	run, token := w.endRun(), selfTestPrefix+hex.EncodeToString(b[:])
	w.token = token
	w.mu.Unlock()
	wk.tests.Add(1)
	go func() {
		defer wk.tests.Done()
		wk.sendSelfTest(run, token)
	}()
}

// sendSelfTest sends the self-test's notification, trying again while the send fails (the
// database is away; the connection's loss will start another run), and arms its bound.
func (wk *waker) sendSelfTest(run int, token string) {
	w := &wk.check
	b := newBackoff()
	for {
		sendCtx, stop := context.WithTimeout(wk.ctx, 10*time.Second)
		_, err := wk.pool.Exec(sendCtx, selfTestNotifySQL, wk.cfg.TickChannel, token)
		stop()
		w.mu.Lock()
		if w.run != run || wk.ctx.Err() != nil {
			w.mu.Unlock()
			return
		}
		if err == nil {
			w.timer = time.AfterFunc(wk.cfg.ListenCheckTimeout, func() { wk.selfTestTimedOut(run) })
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
		wk.log.Debug("wake-up self-test: send failed; trying again", zap.Error(err), zap.Duration("retry_in", b.wait))
		if !b.sleep(wk.ctx) {
			return
		}
	}
}

// stopSelfTest ends the self-test under way, if any: its bound no longer counts.
func (wk *waker) stopSelfTest() {
	w := &wk.check
	w.mu.Lock()
	defer w.mu.Unlock()
	w.endRun()
}

// endRun ends the run under way (its bound no longer counts) and returns the next one's
// number. The caller holds w.mu.
func (w *wakeupCheck) endRun() int {
	w.run++
	if w.timer != nil {
		w.timer.Stop()
		w.timer = nil
	}
	return w.run
}

// heard records that a notification reached the LISTEN connection, which proves the channel
// whatever its payload, and reports whether it was the self-test's own (not to be parsed).
func (wk *waker) heard(payload string) bool {
	w := &wk.check
	// The lock covers the gauge and the log too, so that whoever reads the state sees what
	// was said about it.
	w.mu.Lock()
	defer w.mu.Unlock()
	previous := w.state
	w.state = WakeupsWorking
	switch previous {
	case WakeupsWorking:
	case WakeupsPollingOnly:
		wk.metrics.wakeups(string(wk.id), true)
		wk.log.Info("LISTEN wake-ups arrive after all; notifications wake the consumer again")
	default:
		wk.metrics.wakeups(string(wk.id), true)
		wk.log.Debug("wake-up self-test passed: notifications reach the LISTEN connection")
	}
	return w.token != "" && payload == w.token
}

// selfTestTimedOut runs when the self-test's bound passes. Unless a notification arrived
// meanwhile, the consumer runs on polling alone and says once what to do.
func (wk *waker) selfTestTimedOut(run int) {
	w := &wk.check
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.run != run || w.state == WakeupsWorking {
		return
	}
	w.state = WakeupsPollingOnly
	wk.metrics.wakeups(string(wk.id), false)
	if w.warned {
		return
	}
	w.warned = true
	fix := "set ListenDSN (listen_dsn) to a connection string that reaches PostgreSQL directly, not through the pooler"
	if wk.cfg.ListenDSN != "" {
		fix = "ListenDSN (listen_dsn) is set: point it at PostgreSQL directly, not at the pooler"
	}
	wk.log.Warn("LISTEN wake-ups do not arrive (is the pool behind a transaction-pooling proxy?); the consumer runs on polling alone",
		zap.String("channel", wk.cfg.TickChannel), zap.Duration("self_test_timeout", wk.cfg.ListenCheckTimeout),
		zap.Duration("poll_interval", wk.cfg.PollInterval), zap.String("fix", fix))
}

// pollOnly records, without a self-test, that the consumer runs on polling alone, and says
// why and what to set.
func (wk *waker) pollOnly(why string) {
	w := &wk.check
	w.mu.Lock()
	defer w.mu.Unlock()
	w.state = WakeupsPollingOnly
	w.warned = true
	wk.metrics.wakeups(string(wk.id), false)
	wk.log.Warn("LISTEN wake-ups do not arrive: "+why+"; the consumer runs on polling alone",
		zap.String("channel", wk.cfg.TickChannel), zap.Duration("poll_interval", wk.cfg.PollInterval),
		zap.String("fix", "set ListenDSN (listen_dsn) to a connection string that reaches PostgreSQL directly, not through the pooler, or NotifyDisabled (notify_disabled)"))
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
