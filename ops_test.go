package outbox_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

// hostileTaskID is a valid task ID (printable, no whitespace) that is also markup.
const hostileTaskID = `x"><svg/onload=alert(1)>`

// opsFixture is a database with what the operations page must show: a consumer that parked
// a dead letter (the task with the hostile ID) and a consumer that lags.
type opsFixture struct {
	writer  *process
	admin   *outbox.Admin
	broken  *process
	fixed   func()
	poisonQ int64 // the dead letter's sequence
}

func newOpsFixture(t *testing.T, ctx context.Context, url string) *opsFixture {
	t.Helper()
	f := &opsFixture{writer: startProcess(t, url, processOpts{projects: []string{"p"}})}
	_, err := f.writer.store.CreateMany(ctx, "p", "t", 10)
	require.NoError(t, err)
	_, err = f.writer.store.Create(ctx, "p", hostileTaskID, "hostile", "todo")
	require.NoError(t, err)

	// "laggard" reads the first event and stops; it lags behind everything after.
	laggard := startProcess(t, url, processOpts{id: "laggard", projects: []string{"p"}, cfg: fastConfig(), noStart: true})
	_, err = f.writer.store.Delete(ctx, "p", "t-1")
	require.NoError(t, err)
	laggard.start(t)
	waitCursor(t, ctx, f.writer.pool, "p", "laggard", 1)
	laggard.stop(t)

	cfg := fastConfig()
	cfg.MaxAttempts = 1
	f.broken = startProcess(t, url, processOpts{id: "broken", projects: []string{"p"}, cfg: cfg, noStart: true})
	var mu sync.Mutex
	fixed := false
	f.fixed = func() { mu.Lock(); fixed = true; mu.Unlock() }
	f.broken.rec.setFail(func(ev outbox.ObservedEvent) error {
		mu.Lock()
		defer mu.Unlock()
		if ev.TaskID == hostileTaskID && !fixed {
			return errListener
		}
		return nil
	})
	f.broken.start(t)
	_, err = f.writer.store.Delete(ctx, "p", hostileTaskID)
	require.NoError(t, err)
	f.poisonQ = 2
	for i := 2; i <= 4; i++ {
		_, err := f.writer.store.Delete(ctx, "p", fmt.Sprintf("t-%d", i))
		require.NoError(t, err)
	}
	waitCursor(t, ctx, f.writer.pool, "p", "broken", 5)
	require.Equal(t, "dead", deliveryOf(t, f.writer.pool, "broken", f.poisonQ).State)
	f.admin = outbox.NewAdmin(f.writer.pool, outbox.AdminOptions{Audit: f.writer.store})
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
	ctx := ctxT(t)
	f := newOpsFixture(t, ctx, pgtest.NewDB(t).URL)
	ops, err := outbox.OpsHandler(f.admin, outbox.OpsOptions{EventsURL: "/events"})
	require.NoError(t, err)
	srv := httptest.NewServer(http.StripPrefix("/ops", ops))
	defer srv.Close()

	status, page := getBody(t, srv.Client(), srv.URL+"/ops/")
	require.Equal(t, http.StatusOK, status)
	require.Regexp(t, `<tr class="consumer lagging" data-consumer="laggard">`, page)
	require.Regexp(t, `(?s)data-consumer="laggard">.*?<td class="num lag-events">4</td>`, page)
	require.Regexp(t, `<tr class="consumer has-dead" data-consumer="broken">`, page)
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
	require.Equal(t, "dead", deliveryOf(t, f.writer.pool, "broken", f.poisonQ).State)
}

var csrfField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

func TestOpsActionsNeedTheAuthorizerTheTokenAndTheSameOrigin(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	f := newOpsFixture(t, ctx, pgtest.NewDB(t).URL)
	var mu sync.Mutex
	var asked []outbox.OpsAction
	ops, err := outbox.OpsHandler(f.admin, outbox.OpsOptions{AuthorizeAction: func(r *http.Request, a outbox.OpsAction) (string, bool) {
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, a)
		return "oncall@example.com", r.Header.Get("X-Operator") == "yes"
	}})
	require.NoError(t, err)
	srv := httptest.NewServer(http.StripPrefix("/ops", ops))
	defer srv.Close()
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	browser := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

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
	require.Equal(t, "dead", deliveryOf(t, f.writer.pool, "broken", f.poisonQ).State, "nothing was done")
	mu.Lock()
	require.Len(t, asked, 1, "the authorizer is asked only once the request is known to come from the page")
	require.Equal(t, outbox.OpsAction{Kind: outbox.OpsReplay, ProjectID: "p", ConsumerID: "broken", Sequence: f.poisonQ,
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
	require.Eventually(t, func() bool { return deliveryOf(t, f.writer.pool, "broken", f.poisonQ).State == "resolved" }, waitLimit, 10*time.Millisecond)
	require.Equal(t, 0, pgtest.QueryInt(t, f.writer.pool, `SELECT count(*) FROM run_audit WHERE actor = 'mallory@example.com'`),
		"the audit names the actor the form typed, not the signed-in operator")
	require.Equal(t, 1, pgtest.QueryInt(t, f.writer.pool, `SELECT count(*) FROM run_audit WHERE action = $1 AND actor = 'oncall@example.com'`, outbox.AuditConsumerReplayed))

	resp = post(browser, "/ops/retire", url.Values{"csrf": {token}, "project": {"p"}, "consumer": {"laggard"},
		"reason": {"FN-19"}}, "X-Operator", "yes")
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	require.Equal(t, 1, pgtest.QueryInt(t, f.writer.pool, `SELECT count(*) FROM lifecycle_consumer_cursors WHERE consumer_id = 'laggard' AND retired_at IS NOT NULL`))
	require.Equal(t, 1, pgtest.QueryInt(t, f.writer.pool, `SELECT count(*) FROM run_audit WHERE action = $1`, outbox.AuditConsumerRetired))
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
	_, err := outbox.OpsHandler(nil, outbox.OpsOptions{EventsURL: "https://elsewhere/events", CSRFKey: []byte("short")})
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
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	seedEvents(t, pool, "proj-a", 1)
	seedEvents(t, pool, "proj-b", 1)
	// As in a database upgraded with such a row: its column kept its plain type (migration 0012).
	_, err := pool.Exec(ctx, `ALTER TABLE lifecycle_consumer_cursors ALTER COLUMN lease_expires_at TYPE timestamptz`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, lease_owner, lease_epoch, lease_expires_at)
		VALUES ('proj-a', 'ghost', 0, 'ghost@0000000000000000', 1, 'infinity'), ('proj-b', 'dash', 0, NULL, 0, NULL)`)
	require.NoError(t, err)
	h, err := outbox.OpsHandler(outbox.NewAdmin(pool, outbox.AdminOptions{}), outbox.OpsOptions{})
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
	h, err = outbox.OpsHandler(outbox.NewAdmin(pool, outbox.AdminOptions{}), outbox.OpsOptions{
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
	ctx := ctxT(t)
	f := newOpsFixture(t, ctx, pgtest.NewDB(t).URL)
	seedEvents(t, f.writer.pool, "a", 1)
	_, err := f.writer.pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, lease_owner, lease_epoch, lease_expires_at)
		VALUES ('a', 'dash-a', 0, NULL, 0, NULL)`)
	require.NoError(t, err)
	var mu sync.Mutex
	asked := map[string]int{}
	ops, err := outbox.OpsHandler(f.admin, outbox.OpsOptions{
		Authorize: func(r *http.Request, p string) bool {
			mu.Lock()
			defer mu.Unlock()
			asked[r.Header.Get("X-User")+"/"+p]++
			return p == "a" || r.Header.Get("X-User") == "root"
		},
		AuthorizeAction: func(r *http.Request, _ outbox.OpsAction) (string, bool) { return r.Header.Get("X-User"), true },
	})
	require.NoError(t, err)
	srv := httptest.NewServer(http.StripPrefix("/ops", ops))
	defer srv.Close()
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	client := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
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
	require.Equal(t, "dead", deliveryOf(t, f.writer.pool, "broken", f.poisonQ).State)
}

// TestOpsCSRFCookieIsSecureBehindATLSProxy: behind a proxy that terminates TLS the handler
// sees plain HTTP, and the CSRF cookie was sent without Secure, so it also travelled over
// plain HTTP. BehindTLS marks it Secure; without it a plain request keeps it unmarked.
func TestOpsCSRFCookieIsSecureBehindATLSProxy(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	authorize := func(*http.Request, outbox.OpsAction) (string, bool) { return "oncall", true }
	for _, behind := range []bool{true, false} {
		h, err := outbox.OpsHandler(outbox.NewAdmin(pool, outbox.AdminOptions{}), outbox.OpsOptions{AuthorizeAction: authorize, BehindTLS: behind})
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
