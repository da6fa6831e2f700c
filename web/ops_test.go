package web_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/web"
)

// hostileTaskID is a valid task ID (printable, no whitespace) that is also markup.
const hostileTaskID = `x"><svg/onload=alert(1)>`

// opsFixture is a database with what the operations page must show: a consumer that parked
// a dead letter (the task with the hostile ID) and a consumer that lags.
type opsFixture struct {
	writer  *testkit.Process
	admin   *outbox.Admin
	broken  *testkit.Process
	fixed   func()
	poisonQ int64 // the dead letter's sequence
}

func newOpsFixture(t *testing.T, ctx context.Context, url string) *opsFixture {
	t.Helper()
	f := &opsFixture{writer: testkit.StartProcess(t, url, testkit.ProcessOpts{Projects: []string{"p"}})}
	_, err := f.writer.Store.CreateMany(ctx, "p", "t", 10)
	require.NoError(t, err)
	_, err = f.writer.Store.Create(ctx, "p", hostileTaskID, "hostile", "todo")
	require.NoError(t, err)

	// "laggard" reads the first event and stops; it lags behind everything after.
	laggard := testkit.StartProcess(t, url, testkit.ProcessOpts{ID: "laggard", Projects: []string{"p"}, Config: testkit.FastConfig(), NoStart: true})
	_, err = f.writer.Store.Delete(ctx, "p", "t-1")
	require.NoError(t, err)
	laggard.Start(t)
	testkit.WaitCursor(t, ctx, f.writer.Pool, "p", "laggard", 1)
	laggard.Stop(t)

	cfg := testkit.FastConfig()
	cfg.MaxAttempts = 1
	f.broken = testkit.StartProcess(t, url, testkit.ProcessOpts{ID: "broken", Projects: []string{"p"}, Config: cfg, NoStart: true})
	var mu sync.Mutex
	fixed := false
	f.fixed = func() { mu.Lock(); fixed = true; mu.Unlock() }
	f.broken.Rec.SetFail(func(ev outbox.ObservedEvent) error {
		mu.Lock()
		defer mu.Unlock()
		if ev.TaskID == hostileTaskID && !fixed {
			return testkit.ErrListener
		}
		return nil
	})
	f.broken.Start(t)
	_, err = f.writer.Store.Delete(ctx, "p", hostileTaskID)
	require.NoError(t, err)
	f.poisonQ = 2
	for i := 2; i <= 4; i++ {
		_, err := f.writer.Store.Delete(ctx, "p", fmt.Sprintf("t-%d", i))
		require.NoError(t, err)
	}
	testkit.WaitCursor(t, ctx, f.writer.Pool, "p", "broken", 5)
	require.Equal(t, "dead", testkit.DeliveryOf(t, f.writer.Pool, "broken", f.poisonQ).State)
	f.admin = outbox.NewAdmin(f.writer.Pool, outbox.AdminOptions{Audit: f.writer.Store})
	return f
}

func getBody(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	resp, err := c.Get(u)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

func TestOpsPageShowsConsumersAndDeadLettersEscaped(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	f := newOpsFixture(t, ctx, pgtest.NewDB(t).URL)
	ops, err := web.OpsHandler(f.admin, web.OpsOptions{EventsURL: "/events"})
	require.NoError(t, err)
	srv := httptest.NewServer(http.StripPrefix("/ops", ops))
	defer srv.Close()

	status, page := getBody(t, srv.Client(), srv.URL+"/ops/")
	require.Equal(t, http.StatusOK, status)
	require.Regexp(t, `<tr class="consumer sev-ok lagging" data-consumer="laggard">`, page)
	require.Regexp(t, `(?s)data-consumer="laggard">.*?<span class="lag-events">4</span>`, page)
	require.Regexp(t, `<tr class="consumer sev-crit has-dead" data-consumer="broken">`, page)
	require.Contains(t, page, "Dead letters of <code>broken</code>")
	require.Contains(t, page, `data-events="/events"`)
	require.Contains(t, page, "read-only")
	require.NotContains(t, page, "<form", "no buttons without an action authorizer")
	// The hostile task ID is in the dead letter's event ID: shown, escaped, never as markup.
	require.NotContains(t, page, "<svg")
	require.Contains(t, page, "x&#34;&gt;&lt;svg/onload=alert(1)&gt;")

	resp, err := srv.Client().Get(srv.URL + "/ops/")
	require.NoError(t, err)
	resp.Body.Close()
	require.Contains(t, resp.Header.Get("Content-Security-Policy"), "script-src 'self'")
	require.Equal(t, "nosniff", resp.Header.Get("X-Content-Type-Options"))

	status, frag := getBody(t, srv.Client(), srv.URL+"/ops/consumers")
	require.Equal(t, http.StatusOK, status)
	require.Contains(t, frag, `data-consumer="laggard"`)
	require.NotContains(t, frag, "<html")
	for _, asset := range []string{"/ops/static/ops.js", "/ops/static/ops.css"} {
		status, body := getBody(t, srv.Client(), srv.URL+asset)
		require.Equal(t, http.StatusOK, status, asset)
		require.NotEmpty(t, body)
	}

	// Read-only: a post is refused whatever it carries.
	resp, err = srv.Client().PostForm(srv.URL+"/ops/replay", url.Values{"project": {"p"}, "consumer": {"broken"}, "sequence": {"2"}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode)
	require.Equal(t, "dead", testkit.DeliveryOf(t, f.writer.Pool, "broken", f.poisonQ).State)
}

var csrfField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// serveOps serves ops under /ops for the test, and a client for it that keeps cookies, as a
// browser does, and does not follow redirects, so that a test sees where they go.
func serveOps(t *testing.T, ops http.Handler) (*httptest.Server, *http.Client) {
	t.Helper()
	srv := httptest.NewServer(http.StripPrefix("/ops", ops))
	t.Cleanup(srv.Close)
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	return srv, &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

func TestOpsActionsNeedTheAuthorizerTheTokenAndTheSameOrigin(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	f := newOpsFixture(t, ctx, pgtest.NewDB(t).URL)
	var mu sync.Mutex
	var asked []web.OpsAction
	ops, err := web.OpsHandler(f.admin, web.OpsOptions{AuthorizeAction: func(r *http.Request, a web.OpsAction) (string, bool) {
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, a)
		return "oncall@example.com", r.Header.Get("X-Operator") == "yes"
	}})
	require.NoError(t, err)
	srv, browser := serveOps(t, ops)

	status, page := getBody(t, browser, srv.URL+"/ops/")
	require.Equal(t, http.StatusOK, status)
	m := csrfField.FindStringSubmatch(page)
	require.NotNil(t, m, "the page carries a form token")
	token := m[1]
	require.Contains(t, page, `action="replay"`)
	require.Contains(t, page, `action="retire"`)

	// The form names an actor of its own: the page must ignore it and audit whom the host
	// says is signed in.
	form := url.Values{"csrf": {token}, "project": {"p"}, "consumer": {"broken"}, "sequence": {fmt.Sprint(f.poisonQ)},
		"actor": {"mallory@example.com"}, "reason": {"FN-18"}}
	post := func(c *http.Client, path string, form url.Values, header ...string) *http.Response {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+path, strings.NewReader(form.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := c.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp
	}
	noCookie := &http.Client{CheckRedirect: browser.CheckRedirect}
	for name, resp := range map[string]*http.Response{
		"no cookie":        post(noCookie, "/ops/replay", form, "X-Operator", "yes"),
		"wrong token":      post(browser, "/ops/replay", url.Values{"csrf": {"AAAA"}, "project": {"p"}, "consumer": {"broken"}, "sequence": {"2"}}, "X-Operator", "yes"),
		"cross-site fetch": post(browser, "/ops/replay", form, "X-Operator", "yes", "Sec-Fetch-Site", "cross-site"),
		"foreign origin":   post(browser, "/ops/replay", form, "X-Operator", "yes", "Origin", "https://evil.example"),
		"not authorized":   post(browser, "/ops/replay", form),
		"a GET is not POST": func() *http.Response {
			r, _ := browser.Get(srv.URL + "/ops/replay?" + form.Encode())
			r.Body.Close()
			return r
		}(),
	} {
		require.Contains(t, []int{http.StatusForbidden, http.StatusMethodNotAllowed}, resp.StatusCode, name)
	}
	require.Equal(t, "dead", testkit.DeliveryOf(t, f.writer.Pool, "broken", f.poisonQ).State, "nothing was done")
	mu.Lock()
	require.Len(t, asked, 1, "the authorizer is asked only once the request is known to come from the page")
	require.Equal(t, web.OpsAction{Kind: web.OpsReplay, ProjectID: "p", ConsumerID: "broken", Sequence: f.poisonQ,
		Reason: "FN-18"}, asked[0])
	mu.Unlock()

	// Prose as a reason is refused by the audited call, and the page says why.
	bad := url.Values{}
	for k, v := range form {
		bad[k] = v
	}
	bad.Set("reason", "it broke")
	resp := post(browser, "/ops/replay", bad, "X-Operator", "yes", "Sec-Fetch-Site", "same-origin")
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	_, page = getBody(t, browser, redirected(t, srv.URL, resp))
	require.Contains(t, page, "the reason must be a ticket reference or short code")

	f.fixed()
	resp = post(browser, "/ops/replay", form, "X-Operator", "yes", "Sec-Fetch-Site", "same-origin")
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	_, page = getBody(t, browser, redirected(t, srv.URL, resp))
	require.Contains(t, page, fmt.Sprintf("replay of sequence %d of p for broken requested", f.poisonQ))
	require.Eventually(t, func() bool { return testkit.DeliveryOf(t, f.writer.Pool, "broken", f.poisonQ).State == "resolved" }, testkit.WaitLimit, 10*time.Millisecond)
	require.Equal(t, 0, pgtest.QueryInt(t, f.writer.Pool, `SELECT count(*) FROM run_audit WHERE actor = 'mallory@example.com'`),
		"the audit names the actor the form typed, not the signed-in operator")
	require.Equal(t, 1, pgtest.QueryInt(t, f.writer.Pool, `SELECT count(*) FROM run_audit WHERE action = $1 AND actor = 'oncall@example.com'`, outbox.AuditConsumerReplayed))

	resp = post(browser, "/ops/retire", url.Values{"csrf": {token}, "project": {"p"}, "consumer": {"laggard"},
		"reason": {"FN-19"}, "confirm": {"retire"}}, "X-Operator", "yes")
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	require.Equal(t, 1, pgtest.QueryInt(t, f.writer.Pool, `SELECT count(*) FROM lifecycle_consumer_cursors WHERE consumer_id = 'laggard' AND retired_at IS NOT NULL`))
	require.Equal(t, 1, pgtest.QueryInt(t, f.writer.Pool, `SELECT count(*) FROM run_audit WHERE action = $1`, outbox.AuditConsumerRetired))
}

// redirected is where a redirect response of a post points.
func redirected(t *testing.T, base string, resp *http.Response) string {
	t.Helper()
	loc, err := resp.Location()
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(loc.String(), base+"/ops/?"), "redirect to %s", loc)
	return loc.String()
}

func TestOpsHandlerOptions(t *testing.T) {
	t.Parallel()
	_, err := web.OpsHandler(nil, web.OpsOptions{EventsURL: "https://elsewhere/events", CSRFKey: []byte("short")})
	require.Error(t, err)
	for _, field := range []string{"admin", "OpsOptions.EventsURL", "OpsOptions.CSRFKey"} {
		require.ErrorContains(t, err, field)
	}
}

// TestOpsPageShowsOtherProjectsWhenOneIsUnreadable: a cursor row the status read cannot decode
// (written before the database checked its times) costs the page that project only: the other
// projects are shown, and the page names the one left out.
func TestOpsPageShowsOtherProjectsWhenOneIsUnreadable(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	testkit.SeedEvents(t, pool, "proj-a", 1)
	testkit.SeedEvents(t, pool, "proj-b", 1)
	// As in a database upgraded with such a row: its column kept its plain type (migration 0012).
	_, err := pool.Exec(ctx, `ALTER TABLE lifecycle_consumer_cursors ALTER COLUMN lease_expires_at TYPE timestamptz`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, lease_owner, lease_epoch, lease_expires_at)
		VALUES ('proj-a', 'ghost', 0, 'ghost@0000000000000000', 1, 'infinity'), ('proj-b', 'dash', 0, NULL, 0, NULL)`)
	require.NoError(t, err)
	h, err := web.OpsHandler(outbox.NewAdmin(pool, outbox.AdminOptions{}), web.OpsOptions{})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/")
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Contains(t, string(body), "dash", "the readable project's consumer is shown")
	require.Contains(t, string(body), "status unavailable for proj-a")

	// A reader confined to proj-b is not told that proj-a exists, unreadable or not.
	h, err = web.OpsHandler(outbox.NewAdmin(pool, outbox.AdminOptions{}), web.OpsOptions{
		Authorize: func(_ *http.Request, p string) bool { return p == "proj-b" }})
	require.NoError(t, err)
	confined := httptest.NewServer(h)
	defer confined.Close()
	status, page := getBody(t, confined.Client(), confined.URL+"/")
	require.Equal(t, http.StatusOK, status)
	require.Contains(t, page, "dash")
	require.NotContains(t, page, "proj-a")
}

// TestOpsPageShowsOnlyTheProjectsTheHostAllows is issue 28's confinement: a user the host
// confines to project a saw project p's consumers and the dead letter of p's task on the page
// and its fragment, and could post an action for p.
func TestOpsPageShowsOnlyTheProjectsTheHostAllows(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	f := newOpsFixture(t, ctx, pgtest.NewDB(t).URL)
	testkit.SeedEvents(t, f.writer.Pool, "a", 1)
	_, err := f.writer.Pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, lease_owner, lease_epoch, lease_expires_at)
		VALUES ('a', 'dash-a', 0, NULL, 0, NULL)`)
	require.NoError(t, err)
	var mu sync.Mutex
	asked := map[string]int{}
	ops, err := web.OpsHandler(f.admin, web.OpsOptions{
		Authorize: func(r *http.Request, p string) bool {
			mu.Lock()
			defer mu.Unlock()
			asked[r.Header.Get("X-User")+"/"+p]++
			return p == "a" || r.Header.Get("X-User") == "root"
		},
		AuthorizeAction: func(r *http.Request, _ web.OpsAction) (string, bool) { return r.Header.Get("X-User"), true },
	})
	require.NoError(t, err)
	srv, client := serveOps(t, ops)
	get := func(user, path string) string {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+path, nil)
		req.Header.Set("X-User", user)
		resp, err := client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		return string(b)
	}
	for _, path := range []string{"/ops/", "/ops/consumers"} {
		page := get("alice", path)
		require.Contains(t, page, `data-consumer="dash-a"`, path)
		for _, hidden := range []string{"laggard", "broken", "task-deleted:", `"p"`} {
			require.NotContains(t, page, hidden, "%s shows project p to a user confined to a", path)
		}
		root := get("root", path)
		require.Contains(t, root, `data-consumer="dash-a"`, path)
		require.Contains(t, root, `data-consumer="broken"`, path)
	}
	mu.Lock()
	require.Positive(t, asked["alice/p"], "the host was asked about p for alice")
	mu.Unlock()

	// A forged post for p, with a valid token, is refused for alice as for any unauthorized one.
	m := csrfField.FindStringSubmatch(get("alice", "/ops/"))
	require.NotNil(t, m)
	form := url.Values{"csrf": {m[1]}, "project": {"p"}, "consumer": {"broken"}, "sequence": {fmt.Sprint(f.poisonQ)}, "reason": {"FN-20"}}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/ops/replay", strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("X-User", "alice")
	resp, err := client.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode)
	require.Equal(t, "dead", testkit.DeliveryOf(t, f.writer.Pool, "broken", f.poisonQ).State)
}

// TestOpsCSRFCookieIsSecureBehindATLSProxy: behind a proxy that terminates TLS the handler
// sees plain HTTP, and the CSRF cookie was sent without Secure, so it also travelled over
// plain HTTP. BehindTLS marks it Secure; without it a plain request keeps it unmarked.
func TestOpsCSRFCookieIsSecureBehindATLSProxy(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	authorize := func(*http.Request, web.OpsAction) (string, bool) { return "oncall", true }
	for _, behind := range []bool{true, false} {
		h, err := web.OpsHandler(outbox.NewAdmin(pool, outbox.AdminOptions{}), web.OpsOptions{AuthorizeAction: authorize, BehindTLS: behind})
		require.NoError(t, err)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "http://ops.example/", nil))
		require.Equal(t, http.StatusOK, rec.Code)
		cookies := rec.Result().Cookies()
		require.Len(t, cookies, 1)
		require.Equal(t, behind, cookies[0].Secure, "BehindTLS=%v: the cookie's Secure flag", behind)
		require.Equal(t, http.SameSiteStrictMode, cookies[0].SameSite)
	}
}

// seedOpsStates makes, with rows only, the states the operations page must tell apart:
//
//	project "fine":   "fine", caught up, its process alive
//	project "stall":  "stalled", 300 events behind (the oldest 40 s old), its lease expired
//	                  11 s ago, no heartbeat for 41 s: the demo's SIGSTOPped observer;
//	                  "slow", 60 events behind (8 s), its process alive
//	project "poison": "poisoned", caught up, with a dead letter (listener_error);
//	                  "onebehind", one event behind, alive
func seedOpsStates(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := testkit.Ctx(t)
	// The events of "stall" occurred over the last 40 s, 133 ms apart, so that the oldest an
	// old cursor has not read is 40 s old, and the 60 newest are 8 s old at most.
	_, err := pool.Exec(ctx, `
INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT 'stall', 'seed-' || g, timestamptz '2030-01-01' + g * interval '1 second', 'task:deleted', false, 1,
       now() - (301 - g) * interval '133 milliseconds', 'writer-0123456789abcdef'
FROM generate_series(1, 300) g`)
	require.NoError(t, err)
	_, err = outbox.Sequence(ctx, pool, []string{"stall"}, 10000)
	require.NoError(t, err)
	testkit.SeedEvents(t, pool, "fine", 5)
	testkit.SeedEvents(t, pool, "poison", 5)
	_, err = pool.Exec(ctx, `
INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, lease_owner, lease_epoch, lease_expires_at, heartbeat_at) VALUES
  ('fine', 'fine', 5, 'fine@0123456789abcdef', 1, now() + interval '25 seconds', now() - interval '2 seconds'),
  ('stall', 'stalled', 0, 'stalled@0123456789abcdef', 3, now() - interval '11 seconds', now() - interval '41 seconds'),
  ('stall', 'slow', 240, 'slow@0123456789abcdef', 1, now() + interval '25 seconds', now() - interval '1 second'),
  ('poison', 'poisoned', 5, 'poisoned@0123456789abcdef', 1, now() + interval '25 seconds', now() - interval '1 second'),
  ('poison', 'onebehind', 4, 'onebehind@0123456789abcdef', 1, now() + interval '25 seconds', now() - interval '1 second')`)
	require.NoError(t, err)
	tag, err := pool.Exec(ctx, `
INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts, last_failure_class, first_failed_at, last_failed_at, parked_at)
SELECT 'poison', 'poisoned', 3, 'task-deleted:seed-3:' || sequence, 'dead', 10, 'listener_error', now() - interval '81 minutes', now() - interval '2 minutes', now() - interval '2 minutes'
FROM lifecycle_outbox_read('poison', 2, 1, NULL, NULL, NULL)`)
	require.NoError(t, err)
	require.Equal(t, int64(1), tag.RowsAffected(), "the dead letter of event 3")
}

// summaryOf is the page's summary section.
func summaryOf(t *testing.T, page string) string {
	t.Helper()
	m := regexp.MustCompile(`(?s)<section id="summary".*?</section>`).FindString(page)
	require.NotEmpty(t, m, "the page has a summary")
	return m
}

// TestOpsPageSummaryPutsTheWorstFirst is issue 29's summary, severity and "why": across every
// project the viewer may see, the stalled consumer (300 events, 40 s behind, no heartbeat) comes
// first in red, then the dead letter, then the consumer a little behind in amber; one event of
// lag is not highlighted at all; each says why, in plain words, and links its runbook section.
func TestOpsPageSummaryPutsTheWorstFirst(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	seedOpsStates(t, pool)
	admin := outbox.NewAdmin(pool, outbox.AdminOptions{})
	ops, err := web.OpsHandler(admin, web.OpsOptions{RunbookURL: "https://git.example/outbox/blob/main/docs/operations.md"})
	require.NoError(t, err)
	srv := httptest.NewServer(ops)
	defer srv.Close()
	status, page := getBody(t, srv.Client(), srv.URL+"/")
	require.Equal(t, http.StatusOK, status)

	summary := summaryOf(t, page)
	order := regexp.MustCompile(`<li class="problem sev-(\w+)" data-project="(\w+)" data-consumer="(\w+)"`).FindAllStringSubmatch(summary, -1)
	var got []string
	for _, m := range order {
		got = append(got, m[1]+" "+m[2]+"/"+m[3])
	}
	require.Equal(t, []string{"crit stall/stalled", "crit poison/poisoned", "warn stall/slow"}, got, "the summary, the worst first")
	require.Contains(t, summary, "300 events behind, the oldest waiting")
	hb := regexp.MustCompile(`no heartbeat for (\d+) s and its lease expired \d+ s ago: the process holding this lease is not running\?`).FindStringSubmatch(summary)
	require.NotNil(t, hb, "the stalled consumer's why: %s", summary)
	secs, err := strconv.Atoi(hb[1])
	require.NoError(t, err)
	require.GreaterOrEqual(t, secs, 41)
	require.Contains(t, summary, "do not retire a consumer that will come back")
	require.Contains(t, summary, `href="https://git.example/outbox/blob/main/docs/operations.md#troubleshooting"`)
	require.Contains(t, summary, `href="https://git.example/outbox/blob/main/docs/operations.md#replaying-after-a-fix"`)
	require.Contains(t, summary, `href="https://git.example/outbox/blob/main/docs/operations.md#lag"`)
	require.Contains(t, summary, "a listener of this consumer returned an error for the event on every attempt", "listener_error in plain words")

	// The rows carry the same severity; one event of lag is ok.
	for consumer, sev := range map[string]string{"stalled": "crit", "poisoned": "crit", "slow": "warn", "onebehind": "ok", "fine": "ok"} {
		require.Regexp(t, `<tr class="consumer sev-`+sev+`[^"]*" data-consumer="`+consumer+`">`, page, consumer)
	}
	require.Regexp(t, `(?s)<td class="failure" data-class="listener_error"><b>a listener returned an error</b>`, page)
	for _, jargon := range []string{"pruned through", "missing_cursor", "never positioned"} {
		require.NotContains(t, page, jargon)
	}

	// Thresholds are options: with a warning from one event, the consumer one behind is amber.
	strict, err := web.OpsHandler(admin, web.OpsOptions{Thresholds: web.OpsThresholds{WarnEvents: 1, CritEvents: 1000, WarnLag: time.Hour, CritLag: 2 * time.Hour}})
	require.NoError(t, err)
	rec := httptest.NewRecorder()
	strict.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/consumers", nil))
	require.Regexp(t, `<tr class="consumer sev-warn[^"]*" data-consumer="onebehind">`, rec.Body.String())
	require.Regexp(t, `<tr class="consumer sev-warn[^"]*" data-consumer="slow">`, rec.Body.String(), "60 events is below the critical 1000")
	require.Contains(t, rec.Body.String(), `href="/docs/operations.md#lag"`, "the default runbook")
	_, err = web.OpsHandler(admin, web.OpsOptions{Thresholds: web.OpsThresholds{WarnEvents: 10, CritEvents: 5}, RunbookURL: "javascript:alert(1)"})
	require.ErrorContains(t, err, "OpsOptions.Thresholds")
	require.ErrorContains(t, err, "OpsOptions.RunbookURL")

	// A viewer confined to the healthy project sees all clear, and nothing of the others.
	fine, err := web.OpsHandler(admin, web.OpsOptions{Authorize: func(_ *http.Request, p string) bool { return p == "fine" }})
	require.NoError(t, err)
	rec = httptest.NewRecorder()
	fine.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	summary = summaryOf(t, rec.Body.String())
	require.Contains(t, summary, "All clear")
	require.Contains(t, summary, "all 1 consumer in 1 project")
	require.NotContains(t, rec.Body.String(), "stalled")
}

// TestOpsRetireNeedsItsConfirmation: Retire says what it does to retention, and a post
// without its confirmation retires nothing; with it, the consumer is retired.
func TestOpsRetireNeedsItsConfirmation(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	seedOpsStates(t, pool)
	ops, err := web.OpsHandler(outbox.NewAdmin(pool, outbox.AdminOptions{}), web.OpsOptions{
		AuthorizeAction: func(*http.Request, web.OpsAction) (string, bool) { return "oncall@example.com", true }})
	require.NoError(t, err)
	srv, browser := serveOps(t, ops)
	_, page := getBody(t, browser, srv.URL+"/ops/")
	require.Regexp(t, `(?s)<details class="retire"><summary>Retire…</summary>.*?Retiring <code>stalled</code> in <code>stall</code> makes retention stop waiting for it: the 300 events it has not read may be deleted`, page)
	require.Contains(t, page, `name="confirm" value="retire" required`)
	m := csrfField.FindStringSubmatch(page)
	require.NotNil(t, m)
	retire := func(form url.Values) *http.Response {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/ops/retire", strings.NewReader(form.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		resp, err := browser.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp
	}
	form := url.Values{"csrf": {m[1]}, "project": {"stall"}, "consumer": {"stalled"}, "reason": {"FN-29"}}
	resp := retire(form)
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	_, page = getBody(t, browser, redirected(t, srv.URL, resp))
	require.Contains(t, page, "retire stalled in stall: not done")
	retired := `SELECT count(*) FROM lifecycle_consumer_cursors WHERE consumer_id = 'stalled' AND retired_at IS NOT NULL`
	require.Equal(t, 0, pgtest.QueryInt(t, pool, retired), "retired without its confirmation")

	form.Set("confirm", "retire")
	resp = retire(form)
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	_, page = getBody(t, browser, redirected(t, srv.URL, resp))
	require.Contains(t, page, "retire stalled in stall: done and audited")
	require.Equal(t, 1, pgtest.QueryInt(t, pool, retired))
}
