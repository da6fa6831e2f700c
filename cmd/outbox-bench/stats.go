package main

import (
	"bufio"
	"context"
	"math"
	"os"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"fusion/outbox"
)

// Latencies is a latency summary in milliseconds.
type Latencies struct {
	P50  float64 `json:"p50_ms"`
	P99  float64 `json:"p99_ms"`
	Max  float64 `json:"max_ms"`
	Mean float64 `json:"mean_ms,omitempty"`
}

// summarize sorts ds in place and summarises it.
func summarize(ds []time.Duration) Latencies {
	if len(ds) == 0 {
		return Latencies{}
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	return Latencies{
		P50:  ms(quantile(ds, 0.50)),
		P99:  ms(quantile(ds, 0.99)),
		Max:  ms(ds[len(ds)-1]),
		Mean: ms(sum / time.Duration(len(ds))),
	}
}

// quantile is the nearest-rank quantile of sorted ds.
func quantile(sorted []time.Duration, q float64) time.Duration {
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func ms(d time.Duration) float64 { return round3(float64(d) / float64(time.Millisecond)) }

func round3(f float64) float64 { return math.Round(f*1000) / 1000 }

func round1(f float64) float64 { return math.Round(f*10) / 10 }

func perSecond(n int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return round1(float64(n) / d.Seconds())
}

func seconds(d time.Duration) float64 { return round3(d.Seconds()) }

// rssMB reads a field of /proc/self/status (VmRSS, VmHWM) in MiB; 0 when unavailable.
func rssMB(field string) float64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || name != field {
			continue
		}
		kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
		if err != nil {
			return 0
		}
		return round1(kb / 1024)
	}
	return 0
}

// peakRSS measures the process's peak resident set over a phase. It frees what the Go
// runtime can give back, resets the kernel's high-water mark when allowed (clear_refs 5), and
// also samples VmRSS in case the reset is refused.
type peakRSS struct {
	reset  bool
	before float64
	stop   chan struct{}
	done   chan float64
}

func startPeakRSS() *peakRSS {
	debug.FreeOSMemory()
	p := &peakRSS{stop: make(chan struct{}), done: make(chan float64, 1)}
	p.reset = os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) == nil
	p.before = rssMB("VmRSS")
	go func() {
		peak := p.before
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-p.stop:
				p.done <- peak
				return
			case <-t.C:
				peak = max(peak, rssMB("VmRSS"))
			}
		}
	}()
	return p
}

// Stop returns the RSS before the phase and its peak, in MiB.
func (p *peakRSS) Stop() (before, peak float64) {
	close(p.stop)
	peak = <-p.done
	if p.reset {
		peak = max(peak, rssMB("VmHWM"))
	}
	return p.before, peak
}

// indexTracker counts what a listener received of n expected events whose task IDs are
// "<prefix>-<i>", i in 1..n, keyed by event ID: the task part of the received event ID picks
// the bit, so memory is n bits, not a map of the backlog. Events it cannot place (foreign,
// malformed) count as unexpected.
type indexTracker struct {
	prefix string
	n      int
	done   chan struct{}

	mu         sync.Mutex
	seen       []uint64
	at         []int64 // first arrival of each index (Unix ns), when timed
	unique     int
	received   int
	duplicates int
	unexpected int
}

func newIndexTracker(prefix string, n int) *indexTracker {
	return &indexTracker{prefix: prefix + "-", n: n, done: make(chan struct{}), seen: make([]uint64, (n+64)/64)}
}

// newTimedTracker is an indexTracker that also keeps when each event first arrived: 8 bytes
// per expected event.
func newTimedTracker(prefix string, n int) *indexTracker {
	t := newIndexTracker(prefix, n)
	t.at = make([]int64, n+1)
	return t
}

func (t *indexTracker) listener() outbox.Listener {
	return outbox.ListenerFunc("bench-tracker", func(_ context.Context, ev outbox.ObservedEvent) error {
		t.add(ev.EventID)
		return nil
	})
}

// eventIDStamp is the length of ":<deletedAt>" at the end of a task:deleted event ID.
const eventIDStamp = len(":2006-01-02T15:04:05.000000Z")

// taskOfEventID returns the task part of a task:deleted event ID by its fixed layout: the
// listener runs on the consumer's dispatch path, so the tracker must not parse timestamps.
func taskOfEventID(id string) (string, bool) {
	rest, ok := strings.CutPrefix(id, "task-deleted:")
	if !ok || len(rest) <= eventIDStamp || rest[len(rest)-eventIDStamp] != ':' {
		return "", false
	}
	return rest[:len(rest)-eventIDStamp], true
}

func (t *indexTracker) add(eventID string) {
	now := time.Now().UnixNano()
	i := -1
	if task, ok := taskOfEventID(eventID); ok {
		if rest, ok := strings.CutPrefix(task, t.prefix); ok {
			if v, err := strconv.Atoi(rest); err == nil && v >= 1 && v <= t.n {
				i = v
			}
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.received++
	switch {
	case i < 0:
		t.unexpected++
	case t.seen[i/64]&(1<<(i%64)) != 0:
		t.duplicates++
	default:
		t.seen[i/64] |= 1 << (i % 64)
		if t.at != nil {
			t.at[i] = now
		}
		t.unique++
		if t.unique == t.n {
			close(t.done)
		}
	}
}

// Counts returns received, duplicates, missing and unexpected.
func (t *indexTracker) Counts() (received, duplicates, missing, unexpected int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.received, t.duplicates, t.n - t.unique, t.unexpected
}

// arrivals copies, for a timed tracker, when each index first arrived (0: not yet).
func (t *indexTracker) arrivals() []int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]int64(nil), t.at...)
}

// missingOf counts, for a timed tracker, the indexes i with want[i] != 0 that have not
// arrived.
func (t *indexTracker) missingOf(want []int64) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for i, w := range want {
		if w != 0 && (i >= len(t.at) || t.at[i] == 0) {
			n++
		}
	}
	return n
}

// wait blocks until every expected event arrived, the timeout passed or ctx ended; it
// reports whether everything arrived.
func (t *indexTracker) wait(ctx context.Context, timeout time.Duration) bool {
	tm := time.NewTimer(timeout)
	defer tm.Stop()
	select {
	case <-t.done:
		return true
	case <-tm.C:
	case <-ctx.Done():
	}
	return false
}

// arrivals records when each event ID first reached a listener, with its project sequence,
// and checks that each project's sequences arrive in order.
type arrivals struct {
	mu         sync.Mutex
	first      map[string]time.Time
	received   int
	duplicates int
	lastSeq    map[string]int64
	outOfOrder int
	changed    chan struct{} // signalled (non-blocking) on every new event
}

func newArrivals() *arrivals {
	return &arrivals{first: map[string]time.Time{}, lastSeq: map[string]int64{}, changed: make(chan struct{}, 1)}
}

func (a *arrivals) listener() outbox.Listener {
	return outbox.ListenerFunc("bench-arrivals", func(_ context.Context, ev outbox.ObservedEvent) error {
		now := time.Now()
		a.mu.Lock()
		a.received++
		if _, dup := a.first[ev.EventID]; dup {
			a.duplicates++
		} else {
			a.first[ev.EventID] = now
		}
		if ev.Sequence <= a.lastSeq[ev.ProjectID] {
			a.outOfOrder++
		}
		a.lastSeq[ev.ProjectID] = max(a.lastSeq[ev.ProjectID], ev.Sequence)
		a.mu.Unlock()
		select {
		case a.changed <- struct{}{}:
		default:
		}
		return nil
	})
}

// has reports how many of ids have arrived.
func (a *arrivals) has(ids []string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for _, id := range ids {
		if _, ok := a.first[id]; ok {
			n++
		}
	}
	return n
}

// waitFor blocks until every one of ids arrived or the deadline passed.
func (a *arrivals) waitFor(ctx context.Context, ids []string, timeout time.Duration) bool {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for a.has(ids) < len(ids) {
		select {
		case <-a.changed:
		case <-deadline.C:
			return a.has(ids) == len(ids)
		case <-ctx.Done():
			return false
		}
	}
	return true
}

func (a *arrivals) snapshot() (first map[string]time.Time, received, duplicates, outOfOrder int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	first = make(map[string]time.Time, len(a.first))
	for k, v := range a.first {
		first[k] = v
	}
	return first, a.received, a.duplicates, a.outOfOrder
}
