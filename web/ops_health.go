package web

import (
	"cmp"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"time"

	"fusion/outbox"
)

// The operations page's judgement: how bad each consumer's state is, why it is so, and what
// to do about it, so that the one consumer behind among many projects is at the top of the
// page in red with the runbook section that says what to do, rather than one amber cell in
// the third table down.

// OpsThresholds say when a consumer's lag is a warning and when it is critical. A consumer
// reaches a level when either figure (events or seconds) does. Zero fields take the defaults.
type OpsThresholds struct {
	WarnEvents int64         // default 50
	CritEvents int64         // default 250
	WarnLag    time.Duration // age of the oldest unacknowledged event; default 10s
	CritLag    time.Duration // default 30s
	// StaleHeartbeat is how old a lease holder's last heartbeat may get before the page says
	// its process is probably not running. Default 30s (three default heartbeat intervals,
	// the default lease TTL).
	StaleHeartbeat time.Duration
}

func (t OpsThresholds) withDefaults() OpsThresholds {
	if t.WarnEvents == 0 {
		t.WarnEvents = 50
	}
	if t.CritEvents == 0 {
		t.CritEvents = 250
	}
	if t.WarnLag == 0 {
		t.WarnLag = 10 * time.Second
	}
	if t.CritLag == 0 {
		t.CritLag = 30 * time.Second
	}
	if t.StaleHeartbeat == 0 {
		t.StaleHeartbeat = 30 * time.Second
	}
	return t
}

func (t OpsThresholds) check() []error {
	var errs []error
	if t.WarnEvents < 1 || t.CritEvents < t.WarnEvents {
		errs = append(errs, invalid("OpsOptions.Thresholds", "events: need 1 <= WarnEvents <= CritEvents (got %d, %d)", t.WarnEvents, t.CritEvents))
	}
	if t.WarnLag <= 0 || t.CritLag < t.WarnLag {
		errs = append(errs, invalid("OpsOptions.Thresholds", "lag: need 0 < WarnLag <= CritLag (got %s, %s)", t.WarnLag, t.CritLag))
	}
	if t.StaleHeartbeat <= 0 {
		errs = append(errs, invalid("OpsOptions.Thresholds", "StaleHeartbeat must be positive (got %s)", t.StaleHeartbeat))
	}
	return errs
}

// DefaultRunbookURL is where the page links its runbook sections when the host names no
// other place: docs/operations.md as the host serves it on its own origin. Hosts that do not
// serve it point OpsOptions.RunbookURL at their copy (the repository's page on the Git host).
const DefaultRunbookURL = "/docs/operations.md"

func checkRunbookURL(u string) error {
	p, err := url.Parse(u)
	if err != nil || (p.Scheme != "" && p.Scheme != "http" && p.Scheme != "https") || p.Fragment != "" || strings.ContainsAny(u, "\r\n\\") {
		return invalid("OpsOptions.RunbookURL", "must be an http(s) URL or a path, without a #fragment (got %q)", u)
	}
	return nil
}

// The runbook sections (docs/operations.md headings, as Markdown renderers anchor them).
const (
	runbookLag          = "#lag"
	runbookDeadLetters  = "#dead-letters"
	runbookReplay       = "#replaying-after-a-fix"
	runbookRetire       = "#retiring-and-reinstating-a-consumer"
	runbookTrouble      = "#troubleshooting"
	runbookReconcile    = "#reconciliation"
	runbookNotRunningID = runbookTrouble
)

// opsSeverity orders states: the page lists the worst first.
type opsSeverity int

const (
	sevOK opsSeverity = iota
	sevWarn
	sevCrit
)

// Class is the CSS class and the word the page shows.
func (s opsSeverity) Class() string {
	switch s {
	case sevCrit:
		return "crit"
	case sevWarn:
		return "warn"
	}
	return "ok"
}

// Word is how the page names the severity to a reader (and to a screen reader).
func (s opsSeverity) Word() string {
	switch s {
	case sevCrit:
		return "critical"
	case sevWarn:
		return "warning"
	}
	return "ok"
}

// opsProblem is one thing wrong with one consumer: a line of the summary and of the row.
type opsProblem struct {
	Severity   opsSeverity
	ProjectID  string
	ConsumerID string
	What       string // the headline: "300 events behind, the oldest waiting 40 s"
	Why        string // the likely cause in plain words
	Do         string // what to do
	Runbook    string // the runbook section's URL
	kind       int    // order among problems of one severity: lag, dead letters, the rest
	magnitude  float64
}

// opsConsumer is a consumer's row: its status and what the page makes of it.
type opsConsumer struct {
	outbox.ConsumerStatus
	Severity    opsSeverity
	LagSeverity opsSeverity // of the lag alone, which its cell shows
	Problems    []opsProblem
	Heartbeat   string // "2 s ago", "never"
	Lease       string // "held", "expired 11 s ago", "none"
	Reconcile   string // the last reconciliation in plain words, "" when never
}

// opsAssess judges one consumer at now (the database's clock as the Admin sees it).
func opsAssess(s outbox.ConsumerStatus, letters []outbox.DeadLetter, th OpsThresholds, runbook string, now time.Time) opsConsumer {
	c := opsConsumer{ConsumerStatus: s, Heartbeat: "never", Lease: "none"}
	var hbAge time.Duration
	if s.HeartbeatAt != nil {
		hbAge = max(now.Sub(*s.HeartbeatAt), 0)
		c.Heartbeat = opsAge(hbAge) + " ago"
	}
	switch {
	case s.LeaseOwner != "" && s.LeaseHeld:
		c.Lease = "held"
	case s.LeaseOwner != "" && s.LeaseExpiresAt != nil:
		c.Lease = "expired " + opsAge(max(now.Sub(*s.LeaseExpiresAt), 0)) + " ago"
	case s.LeaseOwner != "":
		c.Lease = "expired"
	}
	if s.ReconciledAt != nil {
		c.Reconcile = reconcileWords(s.ReconcileReason)
	}
	if s.Retired {
		return c // retired on purpose: nothing to worry about, nothing to do
	}
	add := func(p opsProblem) {
		p.ProjectID, p.ConsumerID, p.Runbook = s.ProjectID, s.ConsumerID, runbook+p.Runbook
		c.Problems = append(c.Problems, p)
		c.Severity = max(c.Severity, p.Severity)
	}

	// Why a consumer may not be moving: its process is gone, or it never had one.
	var stopped string
	switch {
	case s.LeaseOwner != "" && s.HeartbeatAt != nil && hbAge >= th.StaleHeartbeat:
		stopped = fmt.Sprintf("no heartbeat for %s: the process holding this lease is not running?", opsAge(hbAge))
		if !s.LeaseHeld {
			stopped = fmt.Sprintf("no heartbeat for %s and its lease %s: the process holding this lease is not running?", opsAge(hbAge), c.Lease)
		}
	case s.LeaseOwner != "" && !s.LeaseHeld:
		stopped = "its lease " + c.Lease + " and nobody renewed it: the process holding this lease is not running?"
	case s.LeaseOwner == "" && s.LagEvents > 0:
		stopped = "no process of this identity holds the lease: none is running for this project?"
	}
	const stoppedDo = "Check that a process with this consumer identity runs and reaches the database (a stopped, paused or crash-looping process; its log). It catches up by itself when it is back: do not retire a consumer that will come back."

	lagSev := sevOK
	switch {
	case s.LagEvents >= th.CritEvents || s.LagSeconds >= th.CritLag.Seconds():
		lagSev = sevCrit
	case s.LagEvents >= th.WarnEvents || s.LagSeconds >= th.WarnLag.Seconds():
		lagSev = sevWarn
	}
	if s.LagEvents == 0 {
		lagSev = sevOK
	}
	c.LagSeverity = lagSev
	if lagSev > sevOK {
		p := opsProblem{Severity: lagSev, kind: 0, magnitude: s.LagSeconds + float64(s.LagEvents)/1e6, Runbook: runbookLag,
			What: fmt.Sprintf("%d %s behind, the oldest waiting %s", s.LagEvents, plural(s.LagEvents, "event", "events"), opsAge(time.Duration(s.LagSeconds*float64(time.Second))))}
		switch {
		case stopped != "":
			p.Why, p.Do, p.Runbook = stopped, stoppedDo, runbookNotRunningID
		case s.Retrying > 0:
			p.Why = "the next event keeps failing and is retried: order is the contract, so the stream waits for it"
			p.Do = "Read the consumer's log for the event (\"delivery failed; the stream waits for the retry\") and fix the cause; after its last attempt it is parked as a dead letter and the stream moves on."
		default:
			p.Why = "its process runs and renews its lease, but acknowledges more slowly than events arrive: slow listeners or an overloaded process or database?"
			p.Do = "Look at the dispatch duration (outbox_dispatch_duration_seconds) and the process's log; more capacity or a faster listener."
		}
		add(p)
	} else if stopped != "" && s.LeaseOwner != "" {
		// Not behind (yet): a quiet project does not need its process, but the next deletion will.
		add(opsProblem{Severity: sevWarn, kind: 2, What: "not running?", Why: stopped, Do: stoppedDo, Runbook: runbookNotRunningID})
	}
	if s.Dead > 0 {
		classes := map[string]bool{}
		var why []string
		for _, d := range letters {
			if d.State == "dead" && !classes[d.LastFailureClass] {
				classes[d.LastFailureClass] = true
				why = append(why, failureWords(d.LastFailureClass).Meaning)
			}
		}
		if len(why) == 0 {
			why = append(why, "every delivery attempt failed")
		}
		add(opsProblem{Severity: sevCrit, kind: 1, magnitude: float64(s.Dead), Runbook: runbookReplay,
			What: fmt.Sprintf("%d dead %s: %s never took %s", s.Dead, plural(int64(s.Dead), "letter", "letters"), plural(int64(s.Dead), "this event", "these events"), plural(int64(s.Dead), "it", "them")),
			Why:  strings.Join(why, "; "),
			Do:   "Find the error in the consumer's log (search for the event ID), fix and deploy, then Replay each dead letter below (or outboxctl replay)."})
	}
	if s.Retrying > 0 && lagSev == sevOK {
		add(opsProblem{Severity: sevWarn, kind: 2, magnitude: float64(s.Retrying), Runbook: runbookDeadLetters,
			What: "an event is failing and being retried",
			Why:  "a listener or the cache failed on the next event; the stream waits for its retry",
			Do:   "Read the consumer's log for the event's error and fix the cause before its last attempt parks it as a dead letter."})
	}
	if s.ReplayRequested > 0 {
		why := "the consumer re-delivers it on its next scan"
		sev := sevWarn
		if stopped != "" {
			why = "it waits for a process of this identity to run: " + stopped
		}
		add(opsProblem{Severity: sev, kind: 2, magnitude: float64(s.ReplayRequested), Runbook: runbookReplay,
			What: fmt.Sprintf("%d %s requested", s.ReplayRequested, plural(int64(s.ReplayRequested), "replay", "replays")),
			Why:  why, Do: "Nothing if the consumer runs; the dead letters list shows the outcome."})
	}
	return c
}

// opsSummary is every problem of every consumer shown, the worst first.
func opsSummary(projects []opsProject) []opsProblem {
	var out []opsProblem
	for _, p := range projects {
		for _, c := range p.Consumers {
			out = append(out, c.Problems...)
		}
	}
	slices.SortStableFunc(out, func(a, b opsProblem) int {
		return cmp.Or(cmp.Compare(b.Severity, a.Severity), cmp.Compare(a.kind, b.kind), cmp.Compare(b.magnitude, a.magnitude),
			cmp.Compare(a.ProjectID, b.ProjectID), cmp.Compare(a.ConsumerID, b.ConsumerID))
	})
	return out
}

// opsFailure is a failure class in plain words.
type opsFailure struct {
	Label   string // short, for the table
	Meaning string // what it means
}

// failureWords explains a dead letter's failure class (dispatcher.go, deliveries.go).
func failureWords(class string) opsFailure {
	switch outbox.FailureClass(class) {
	case outbox.FailureListenerError:
		return opsFailure{"a listener returned an error", "a listener of this consumer returned an error for the event on every attempt (the error is in the consumer's log, under the event ID)"}
	case outbox.FailureListenerPanic:
		return opsFailure{"a listener crashed", "a listener panicked on the event (the stack is in the consumer's log)"}
	case outbox.FailureListenerTimeout:
		return opsFailure{"a listener timed out", "the listeners did not finish within ListenerTimeout (default 30 s): a hung or very slow call"}
	case outbox.FailureCacheError:
		return opsFailure{"the task cache refused it", "the host's task cache refused to apply the deletion"}
	case outbox.FailureUnsupportedEvent:
		return opsFailure{"an event this build does not know", "this build cannot interpret the event (a newer type or payload version): deploy a build that can, then replay"}
	case outbox.FailureUndecodableEvent:
		return opsFailure{"an unreadable row", "the stored event cannot be read (a time that is not finite, an invalid task ID): no retry changes it"}
	case "":
		return opsFailure{"unknown", "no failure was recorded"}
	}
	return opsFailure{class, "a failure class this build does not know"}
}

// reconcileWords says what a reconciliation did, without the reason's code.
func reconcileWords(r outbox.ReconcileReason) string {
	switch r {
	case outbox.ReasonMissingCursor:
		return "started at the latest event (first run in this project)"
	case outbox.ReasonCursorAheadOfHead:
		return "was ahead of the latest event (database restored?): moved back to it"
	case outbox.ReasonCursorBelowPrunedFloor:
		return "events it had not read were deleted by retention: skipped to the latest event"
	case "":
		return "resynchronized"
	}
	return "resynchronized (" + string(r) + ")"
}

// opsAge is a duration as people say it, to the second below two minutes.
func opsAge(d time.Duration) string {
	switch {
	case d < 2*time.Minute:
		return fmt.Sprintf("%d s", int64(d.Round(time.Second)/time.Second))
	case d < 2*time.Hour:
		return fmt.Sprintf("%d min", int64(d/time.Minute))
	case d < 48*time.Hour:
		return fmt.Sprintf("%d h", int64(d/time.Hour))
	}
	return fmt.Sprintf("%d days", int64(d/(24*time.Hour)))
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
