package web

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"fusion/outbox"
)

// The operations page: what an on-call engineer who would rather look than read wants to see,
// server-rendered from the same status and dead-letter calls as outboxctl, with a little
// JavaScript for a live feed of the event stream and a periodic refresh. Everything shown
// that came from the database goes through html/template, which escapes it for its context.

//go:embed ops
var opsFiles embed.FS

var opsTemplates = template.Must(template.New("ops").Funcs(template.FuncMap{
	"when":    opsWhen,
	"seconds": func(s float64) string { return strconv.FormatFloat(s, 'f', 1, 64) },
	"deref": func(p *int64) string {
		if p == nil {
			return "not started"
		}
		return strconv.FormatInt(*p, 10)
	},
	"failure": failureWords,
	"age":     func(d time.Duration) string { return opsAge(d) },
	"lagAge":  func(s float64) string { return opsAge(time.Duration(s * float64(time.Second))) },
	"runbook": func(base, section string) string { return base + section },
	// A lease holder is identity@token: the line may break before the token.
	"owner": func(o string) struct{ ID, Token string } {
		if i := strings.LastIndexByte(o, '@'); i > 0 {
			return struct{ ID, Token string }{o[:i], o[i:]}
		}
		return struct{ ID, Token string }{o, ""}
	},
}).ParseFS(opsFiles, "ops/*.html"))

// OpsOptions configure the operations page.
type OpsOptions struct {
	// EventsURL is the event stream the page's live feed follows: the path, on the page's
	// own origin, where the host mounts its SSEHandler (for example "/events"). Empty: no
	// live feed.
	EventsURL string
	// Authorize, when set, is asked for every project on every request whether r may see it:
	// the page, its refreshed fragment and the actions show and touch only the projects it
	// allows (pass the event stream's SSEOptions.Authorize). Without it every project is
	// shown to anyone who reaches the page: the host owns authentication.
	Authorize func(r *http.Request, projectID string) bool
	// AuthorizeAction enables the replay and retire buttons: each action is carried out only
	// when it returns ok for the request, and is audited under the actor it returns, the
	// signed-in operator as the host's authentication knows them (an identifier: a user name,
	// e-mail or service account). The page has no actor field: an operator cannot act, or
	// be audited, under another name. Nil (the default) makes the page read-only. The host
	// owns authentication; this decides what an authenticated operator may do.
	AuthorizeAction func(r *http.Request, a OpsAction) (actor string, ok bool)
	// BehindTLS says the page is served over HTTPS by a proxy that terminates TLS in front of
	// the host, so that its CSRF cookie is marked Secure even though the request reaching the
	// handler is plain HTTP. Without it the cookie is Secure only when the handler itself
	// serves TLS. Set it for every deployment a browser reaches over HTTPS.
	BehindTLS bool
	// Filter narrows the page to one project or consumer. Defaults to everything.
	Filter outbox.StatusFilter
	// Refresh is how often the page reloads its consumer tables when the live feed is quiet
	// (or absent). Defaults to 5s; 1s to 1h. While the feed shows events the page also
	// reloads them after each, at most once a second, so that the tables keep up with it.
	Refresh time.Duration
	// Thresholds say when a consumer's lag is a warning and when it is critical, and when a
	// heartbeat is stale. Zero fields take the defaults (see OpsThresholds).
	Thresholds OpsThresholds
	// RunbookURL is where the page links each state's runbook section (docs/operations.md;
	// the page appends the section's #anchor). Defaults to DefaultRunbookURL.
	RunbookURL string
	// CSRFKey signs the page's form tokens; at least 32 bytes. Defaults to a random key per
	// handler, so a page rendered before a restart (or by another replica) must be reloaded
	// before its buttons work; give every replica the same key to avoid that.
	CSRFKey []byte
	Logger  *zap.Logger
}

// OpsAction is an operator action the page asks the host to authorize.
type OpsAction struct {
	Kind       string // OpsReplay or OpsRetire
	ProjectID  string
	ConsumerID string
	Sequence   int64  // the dead letter's sequence, for a replay
	Reason     string // as the operator typed it; Admin validates it
}

// The operations page's actions.
const (
	OpsReplay = "replay"
	OpsRetire = "retire"
)

// csrfCookie holds the browser's random secret; forms carry an HMAC of it.
const csrfCookie = "outbox_ops_csrf"

type opsHandler struct {
	admin  *outbox.Admin
	opts   OpsOptions
	log    *zap.Logger
	static http.Handler
	origin *http.CrossOriginProtection
}

// OpsHandler returns the operations page as an http.Handler, to be mounted under the host's
// own path and authentication, for example
//
//	mux.Handle("/ops/", http.StripPrefix("/ops", ops))
//
// It serves the page at its root, a fragment the page refreshes, its script and stylesheet,
// and (with AuthorizeAction) the POST endpoints of replay and retire, which go through the
// audited outbox.Admin calls. Posts are refused unless they come from the page itself: same origin
// (Sec-Fetch-Site or Origin) and a token bound to a cookie of the page.
func OpsHandler(admin *outbox.Admin, opts OpsOptions) (http.Handler, error) {
	if opts.Refresh == 0 {
		opts.Refresh = 5 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.RunbookURL == "" {
		opts.RunbookURL = DefaultRunbookURL
	}
	opts.Thresholds = opts.Thresholds.withDefaults()
	errs := opts.Thresholds.check()
	if err := checkRunbookURL(opts.RunbookURL); err != nil {
		errs = append(errs, err)
	}
	if admin == nil {
		errs = append(errs, invalid("OpsHandler.admin", "is nil"))
	}
	if u := opts.EventsURL; u != "" && (!strings.HasPrefix(u, "/") || strings.HasPrefix(u, "//") || strings.ContainsAny(u, "\\\r\n")) {
		errs = append(errs, invalid("OpsOptions.EventsURL", "must be a path on the page's origin, such as /events (got %q)", u))
	}
	if opts.Refresh < time.Second || opts.Refresh > time.Hour {
		errs = append(errs, invalid("OpsOptions.Refresh", "must be between 1s and 1h (got %s)", opts.Refresh))
	}
	switch {
	case opts.CSRFKey == nil:
		opts.CSRFKey = make([]byte, 32)
		if _, err := rand.Read(opts.CSRFKey); err != nil {
			return nil, fmt.Errorf("csrf key: %w", err)
		}
	case len(opts.CSRFKey) < 32:
		errs = append(errs, invalid("OpsOptions.CSRFKey", "must be at least 32 bytes (got %d)", len(opts.CSRFKey)))
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("ops page: %w", errors.Join(errs...))
	}
	static, err := fs.Sub(opsFiles, "ops/static")
	if err != nil {
		return nil, fmt.Errorf("ops page: %w", err)
	}
	h := &opsHandler{admin: admin, opts: opts, log: opts.Logger.Named("outbox.ops"),
		static: http.StripPrefix("/static/", http.FileServerFS(static)), origin: http.NewCrossOriginProtection()}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", h.page)
	mux.HandleFunc("GET /consumers", h.fragment)
	mux.Handle("GET /static/", h.static)
	mux.HandleFunc("POST /replay", h.act(OpsReplay))
	mux.HandleFunc("POST /retire", h.act(OpsRetire))
	return securityHeaders(mux), nil
}

// securityHeaders keeps the page to its own scripts, styles and origin.
func securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "same-origin")
		h.Set("Cache-Control", "no-store")
		next.ServeHTTP(w, r)
	})
}

// opsView is what the templates render.
type opsView struct {
	Now           time.Time
	SchemaVersion int
	Projects      []opsProject
	Actions       bool
	CSRF          string
	EventsURL     string
	RefreshMillis int64
	Flash         *opsFlash
	Error         string
	Summary       []opsProblem // every problem shown, the worst first
	Consumers     int          // how many consumers are shown
	Thresholds    OpsThresholds
	Runbook       string // the runbook's URL, without a section
}

type opsProject struct {
	ID            string
	Head          int64
	PrunedThrough int64
	Severity      opsSeverity // of its worst consumer
	Consumers     []opsConsumer
	DeadLetters   []opsConsumerLetters
}

type opsConsumerLetters struct {
	ConsumerID string
	Letters    []outbox.DeadLetter
}

type opsFlash struct {
	OK   bool
	Text string
}

func (h *opsHandler) page(w http.ResponseWriter, r *http.Request) {
	h.render(w, r, "page.html")
}

func (h *opsHandler) fragment(w http.ResponseWriter, r *http.Request) {
	h.render(w, r, "consumers")
}

func (h *opsHandler) render(w http.ResponseWriter, r *http.Request, name string) {
	v := opsView{Now: time.Now().UTC(), SchemaVersion: outbox.SchemaVersion, Actions: h.opts.AuthorizeAction != nil,
		EventsURL: h.opts.EventsURL, RefreshMillis: h.opts.Refresh.Milliseconds(), Flash: flashFrom(r.URL.Query())}
	if v.Actions {
		v.CSRF = h.token(h.cookie(w, r))
	}
	projects, err := h.load(r)
	var partial *outbox.ProjectErrors
	switch {
	case errors.As(err, &partial):
		// One project's unreadable rows cost only that project: the others are shown.
		h.log.Warn("ops page: some projects unavailable", zap.Strings("projects", partial.Projects()), zap.Error(err))
		v.Error = "status unavailable for " + strings.Join(partial.Projects(), ", ") + " (see the host's log); the other projects are shown"
	case err != nil:
		h.log.Warn("ops page: status unavailable", zap.Error(err))
		v.Error = "status unavailable: the database did not answer (see the host's log)"
	}
	v.Projects = projects
	v.Summary, v.Thresholds, v.Runbook = opsSummary(projects), h.opts.Thresholds, h.opts.RunbookURL
	for _, p := range projects {
		v.Consumers += len(p.Consumers)
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := opsTemplates.ExecuteTemplate(w, name, v); err != nil {
		h.log.Warn("ops page: render", zap.Error(err))
	}
}

// load reads the status and the dead letters of the projects r may see and groups them per
// project and consumer. When some projects' status cannot be read it returns the others with a
// *outbox.ProjectErrors naming the unreadable ones r may see.
func (h *opsHandler) load(r *http.Request) ([]opsProject, error) {
	status, statusErr := h.admin.Status(r.Context(), h.opts.Filter)
	var partial *outbox.ProjectErrors
	if statusErr != nil && !errors.As(statusErr, &partial) {
		return nil, statusErr
	}
	letters, err := h.admin.DeadLetters(r.Context(), h.opts.Filter)
	if err != nil {
		return nil, err
	}
	// Every read asks the host, project by project, once per project per request.
	allowed := map[string]bool{}
	allow := func(p string) bool {
		if h.opts.Authorize == nil {
			return true
		}
		ok, asked := allowed[p]
		if !asked {
			ok = h.opts.Authorize(r, p)
			allowed[p] = ok
		}
		return ok
	}
	if partial != nil {
		visible := &outbox.ProjectErrors{Op: partial.Op, Failed: map[string]error{}}
		for p, err := range partial.Failed {
			if allow(p) {
				visible.Failed[p] = err
			}
		}
		statusErr = nil
		if len(visible.Failed) > 0 {
			statusErr = visible
		}
	}
	var out []opsProject
	index := map[string]int{}
	project := func(id string) *opsProject {
		i, ok := index[id]
		if !ok {
			i = len(out)
			index[id] = i
			out = append(out, opsProject{ID: id})
		}
		return &out[i]
	}
	type key struct{ project, consumer string }
	byConsumer := map[key][]outbox.DeadLetter{}
	for _, d := range letters {
		if !allow(d.ProjectID) {
			continue
		}
		byConsumer[key{d.ProjectID, d.ConsumerID}] = append(byConsumer[key{d.ProjectID, d.ConsumerID}], d)
	}
	// Ages are judged on the clock the status was read on: the database's, shifted as the
	// Admin's clock shifts it.
	now := h.admin.Now()
	for _, s := range status {
		if !allow(s.ProjectID) {
			continue
		}
		p := project(s.ProjectID)
		p.Head, p.PrunedThrough = max(p.Head, s.Head), max(p.PrunedThrough, s.PrunedThrough)
		c := opsAssess(s, byConsumer[key{s.ProjectID, s.ConsumerID}], h.opts.Thresholds, h.opts.RunbookURL, now)
		p.Severity = max(p.Severity, c.Severity)
		p.Consumers = append(p.Consumers, c)
	}
	for _, d := range letters {
		if !allow(d.ProjectID) {
			continue
		}
		p := project(d.ProjectID)
		if n := len(p.DeadLetters); n == 0 || p.DeadLetters[n-1].ConsumerID != d.ConsumerID {
			p.DeadLetters = append(p.DeadLetters, opsConsumerLetters{ConsumerID: d.ConsumerID})
		}
		l := &p.DeadLetters[len(p.DeadLetters)-1]
		l.Letters = append(l.Letters, d)
	}
	return out, statusErr
}

// cookie returns the browser's CSRF secret, setting a new one when it has none.
func (h *opsHandler) cookie(w http.ResponseWriter, r *http.Request) string {
	if c, err := r.Cookie(csrfCookie); err == nil && validSecret(c.Value) {
		return c.Value
	}
	var b [32]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand panics rather than return short)
	v := base64.RawURLEncoding.EncodeToString(b[:])
	http.SetCookie(w, &http.Cookie{Name: csrfCookie, Value: v, Path: "/", HttpOnly: true, Secure: r.TLS != nil || h.opts.BehindTLS,
		SameSite: http.SameSiteStrictMode})
	return v
}

func validSecret(s string) bool {
	b, err := base64.RawURLEncoding.DecodeString(s)
	return err == nil && len(b) == 32
}

// token is the form token bound to a cookie secret.
func (h *opsHandler) token(secret string) string {
	m := hmac.New(sha256.New, h.opts.CSRFKey)
	m.Write([]byte("outbox-ops\x00"))
	m.Write([]byte(secret))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// act handles one action's POST: same origin, a valid token, authorized, then the audited
// Admin call; it answers with a redirect to the page and a flash naming the outcome.
func (h *opsHandler) act(kind string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if h.opts.AuthorizeAction == nil {
			http.Error(w, "this operations page is read-only", http.StatusForbidden)
			return
		}
		if err := h.origin.Check(r); err != nil {
			http.Error(w, "cross-origin request refused", http.StatusForbidden)
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, 16<<10)
		if err := r.ParseForm(); err != nil {
			http.Error(w, "bad form", http.StatusBadRequest)
			return
		}
		c, err := r.Cookie(csrfCookie)
		if err != nil || !validSecret(c.Value) || !hmac.Equal([]byte(h.token(c.Value)), []byte(r.PostForm.Get("csrf"))) {
			http.Error(w, "stale or missing form token: reload the page", http.StatusForbidden)
			return
		}
		a := OpsAction{Kind: kind, ProjectID: r.PostForm.Get("project"), ConsumerID: r.PostForm.Get("consumer"),
			Reason: strings.TrimSpace(r.PostForm.Get("reason"))}
		if kind == OpsReplay {
			a.Sequence, err = strconv.ParseInt(r.PostForm.Get("sequence"), 10, 64)
			if err != nil {
				http.Error(w, "bad sequence", http.StatusBadRequest)
				return
			}
		}
		// Retiring is for a consumer gone for good, and costs it what retention then prunes:
		// the form's confirmation box says so, and a post without it does nothing.
		if kind == OpsRetire && r.PostForm.Get("confirm") != "retire" {
			q := url.Values{"action": {kind}, "project": {a.ProjectID}, "consumer": {a.ConsumerID}, "outcome": {"unconfirmed"}}
			w.Header().Set("Location", "./?"+q.Encode())
			w.WriteHeader(http.StatusSeeOther)
			return
		}
		// An action touches one project the operator may see: the page posts the project of
		// the row, and a forged post for another project (or, when Authorize is set, for
		// every project at once) gets the same answer as an unauthorized one.
		if h.opts.Authorize != nil && (a.ProjectID == "" || !h.opts.Authorize(r, a.ProjectID)) {
			http.Error(w, "not authorized", http.StatusForbidden)
			return
		}
		actor, ok := h.opts.AuthorizeAction(r, a)
		if !ok {
			http.Error(w, "not authorized", http.StatusForbidden)
			return
		}
		// The audit names whom the host says is signed in, never what a form says.
		op := outbox.Operator{Actor: actor, Reason: a.Reason}
		q := url.Values{"action": {kind}, "project": {a.ProjectID}, "consumer": {a.ConsumerID}}
		switch kind {
		case OpsReplay:
			q.Set("sequence", strconv.FormatInt(a.Sequence, 10))
			_, err = h.admin.RequestReplay(r.Context(), outbox.ReplayRequest{ProjectID: a.ProjectID, ConsumerID: a.ConsumerID, Sequence: a.Sequence, Operator: op})
		case OpsRetire:
			_, err = h.admin.RetireConsumer(r.Context(), outbox.RetireRequest{ConsumerID: a.ConsumerID, ProjectID: a.ProjectID, Operator: op})
		}
		q.Set("outcome", outcomeOf(err))
		if o := outcomeOf(err); o == "error" || o == "invalid-actor" {
			h.log.Warn("ops page: action failed", zap.String("action", kind), zap.String("project_id", a.ProjectID),
				zap.String("consumer_id", a.ConsumerID), zap.Error(err))
		}
		if err == nil {
			h.log.Info("ops page: action done", zap.String("action", kind), zap.String("project_id", a.ProjectID),
				zap.String("consumer_id", a.ConsumerID), zap.Int64("sequence", a.Sequence), zap.String("actor", op.Actor))
		}
		// A relative Location, resolved by the browser against the URL it posted to: the
		// handler does not know the path it is mounted under (http.Redirect would make it
		// absolute from the stripped path).
		w.Header().Set("Location", "./?"+q.Encode())
		w.WriteHeader(http.StatusSeeOther)
	}
}

// outcomeOf is an action's outcome as a code: the redirect carries codes, never error text,
// so that a crafted link cannot put words on the page.
func outcomeOf(err error) string {
	var verr *outbox.ValidationError
	switch {
	case err == nil:
		return "done"
	case errors.As(err, &verr):
		return "invalid-" + formField(verr.Field)
	case errors.Is(err, outbox.ErrNotDeadLetter):
		return "not-dead-letter"
	case errors.Is(err, outbox.ErrUnknownConsumer):
		return "unknown-consumer"
	}
	return "error"
}

// flashFrom turns a redirect's codes back into a sentence; anything unexpected shows nothing.
func flashFrom(q url.Values) *opsFlash {
	action, outcome := q.Get("action"), q.Get("outcome")
	project, consumer := q.Get("project"), q.Get("consumer")
	// The identifier rules (the project's, whose length limit a consumer's only narrows): a
	// flash names nothing else.
	if (action != OpsReplay && action != OpsRetire) || outcome == "" || outbox.ValidateProjectID(project) != nil && project != "" ||
		outbox.ValidateProjectID(consumer) != nil {
		return nil
	}
	what := "retire " + consumer
	if project != "" {
		what += " in " + project
	}
	if action == OpsReplay {
		seq, err := strconv.ParseInt(q.Get("sequence"), 10, 64)
		if err != nil {
			return nil
		}
		what = fmt.Sprintf("replay of sequence %d of %s for %s", seq, project, consumer)
	}
	switch outcome {
	case "done":
		if action == OpsReplay {
			return &opsFlash{OK: true, Text: what + " requested: the consumer re-delivers it on its next scan and audits it"}
		}
		return &opsFlash{OK: true, Text: what + ": done and audited"}
	case "unconfirmed":
		return &opsFlash{Text: what + ": not done. Tick the box that confirms retention may then delete the events it has not read and its dead letters"}
	case "not-dead-letter":
		return &opsFlash{Text: what + ": not a dead letter (already replayed or resolved?)"}
	case "unknown-consumer":
		return &opsFlash{Text: what + ": no such consumer"}
	case "invalid-actor":
		return &opsFlash{Text: what + ": the host named no valid actor for you (see the host's log)"}
	case "invalid-reason":
		return &opsFlash{Text: what + ": the reason must be a ticket reference or short code, not prose"}
	case "error":
		return &opsFlash{Text: what + ": failed (see the host's log)"}
	}
	if strings.HasPrefix(outcome, "invalid-") {
		return &opsFlash{Text: what + ": invalid input"}
	}
	return nil
}

// opsWhen renders a time as UTC with how long ago (or ahead) it is; the date only when it is
// not within a day, so that the tables stay narrow.
func opsWhen(t *time.Time) string {
	if t == nil {
		return "—"
	}
	d := time.Until(*t).Round(time.Second)
	rel := "in " + opsAge(d)
	if d <= 0 {
		rel = opsAge(-d) + " ago"
	}
	layout := "15:04:05Z"
	if d > 24*time.Hour || d < -24*time.Hour {
		layout = "2006-01-02 15:04Z"
	}
	return t.UTC().Format(layout) + " (" + rel + ")"
}

// formField is the form's name for a field an outbox.ValidationError names by its Go path
// ("Operator.Actor" is the form's "actor").
func formField(goPath string) string {
	if i := strings.LastIndexByte(goPath, '.'); i >= 0 {
		goPath = goPath[i+1:]
	}
	return strings.ToLower(goPath)
}
