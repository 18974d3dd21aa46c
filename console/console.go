// Package console is the web console at /console/: server-rendered pages
// (html/template, assets embedded, no script) for finance and operators —
// the outbox at a glance, the quarantine, items with their attempts,
// evidence and audit trail, uncertain and rejected items, mappings,
// reconciliation and completeness — with the actions an operator takes,
// and a banner on every page while export is stalled (why, and what waits
// in the ledger meanwhile).
//
// Sign-in exchanges an API token (finance or above) for a session, kept by
// package auth: a random id in an HttpOnly, SameSite=Strict cookie, only
// its hash stored. The sign-in form is accepted only from this site's own
// page (Origin, or Referer), failed sign-ins are throttled per client
// address and in all on each node, and sign-ins, refusals and sign-outs
// are audited. A session ends at its absolute expiry or when unused for
// its idle timeout. Every action is a POST carrying the session's CSRF
// token; what a page shows and allows follows the role. It changes nothing
// itself: every action goes through the package that owns it (quarantine,
// reconcile, mappings), which audits it. It runs no SQL of its own either:
// every page reads through the read functions of the packages that own the
// tables (outbox, quarantine, meter, mappings, reconcile, audit, auth).
// It must never show a token, a key or a provider body.
package console

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Deps are what the console reads and acts through.
type Deps struct {
	Pool     *pgxpool.Pool
	Outbox   *outbox.Store
	Mappings *mappings.Store
	Requeuer *quarantine.Requeuer
	// Reconcile starts runs: nil without a Stripe key.
	Reconcile func(ctx context.Context, tx pgx.Tx, runID int64) error
	// Settle is the default settle delay of a run started here.
	Settle time.Duration
	// SessionTTL is how long a session lasts at most. Defaults to
	// DefaultSessionTTL.
	SessionTTL time.Duration
	// SessionIdle is how long a session lasts unused. Defaults to
	// DefaultSessionIdle.
	SessionIdle time.Duration
	Logger      *slog.Logger
	// ReadLimit, when set, bounds the expensive pages in flight
	// (completeness, mappings, quarantine and its CSV, reconciliation, open
	// discrepancies, a bulk recovery's review).
	ReadLimit ReadLimiter
	// Reports answers the completeness page from its snapshots; nil
	// computes it whenever no computation of the month runs.
	Reports *quarantine.Reports
	// ExportStalls says why export is stalled, for the banner every page
	// shows meanwhile; nil shows none.
	ExportStalls func(ctx context.Context) []ExportStall
	// Runbook is the address of docs/operations.md that the banner links
	// each stall's alert section to. Defaults to DefaultRunbook.
	Runbook string
}

// DefaultRunbook is the runbook the banner links to by default: the
// repository's docs/operations.md, which every alert's runbook annotation
// names. The console serves no docs of its own.
const DefaultRunbook = "https://github.com/tallymeter/tally/blob/main/docs/operations.md"

// stallAlerts names the alert (deploy/prometheus/alerts.yml) that fires on
// each stall reason; its section in docs/operations.md says what to do.
var stallAlerts = map[string]string{
	"no_key":             "TallyExportNoKey",
	"key_refused":        "TallyExportKeyRefused",
	"stripe_unreachable": "TallyExportStripeUnreachable",
	"retrying":           "TallyExportRetrying",
	"account_refused":    "TallyConnectedAccountRefused",
	"meter_deactivated":  "TallyMeterDeactivated",
}

// ExportStall is one reason export is stalled, as the banner shows it.
type ExportStall struct {
	// Reason is its code (tally_export_stalled's reason label).
	Reason string
	// Text says what it means, without content.
	Text string
}

// stallBanner is the banner of a page drawn while export is stalled: the
// reasons, the alerts they fire, and the usage waiting meanwhile.
type stallBanner struct {
	Reasons []stallLine
	// Alerts are the reasons' alerts, each once, with their runbook
	// sections.
	Alerts []stallAlert
	// Pending counts the outbox's pending items and PendingOldest says how
	// long the oldest has waited; PendingKnown false when the outbox could
	// not be read.
	Pending       int64
	PendingOldest string
	PendingKnown  bool
	// Waiting counts the ledger's unstaged events, with its verb (at
	// least, at the count's cap) and Oldest how long ago the oldest was received; Known false
	// when the ledger could not be read.
	Waiting string
	Oldest  string
	Known   bool
}

// stallLine is one reason on the banner.
type stallLine struct {
	ExportStall
	Alert string
}

// stallAlert is an alert the banner names, with its runbook section.
type stallAlert struct {
	Name, URL string
}

// Console serves /console/.
type Console struct {
	Deps
	pool     *pgxpool.Pool
	pages    map[string]*template.Template
	login    *template.Template
	throttle *signInThrottle
}

// New parses the templates.
func New(d Deps) (*Console, error) {
	if d.Logger == nil {
		d.Logger = slog.Default()
	}
	if d.SessionTTL <= 0 {
		d.SessionTTL = DefaultSessionTTL
	}
	if d.SessionIdle <= 0 {
		d.SessionIdle = DefaultSessionIdle
	}
	if d.Runbook == "" {
		d.Runbook = DefaultRunbook
	}
	if d.Reports == nil {
		d.Reports, _ = quarantine.NewReports(0, nil) // no registry: cannot fail
	}
	c := &Console{Deps: d, pool: d.Pool, pages: map[string]*template.Template{}, throttle: newSignInThrottle(defaultSignInLimits())}
	funcs := template.FuncMap{"kindLabel": func(kind string) string { return kindLabels[kind] },
		"period": periodText, "window": func(d mappings.Duration) string { return durationWords(time.Duration(d)) },
		"gateWords": gateWords}
	layout, err := template.New("layout").Funcs(funcs).ParseFS(templateFS, "templates/layout.html")
	if err != nil {
		return nil, err
	}
	for _, page := range []string{"overview", "quarantine", "item", "uncertain", "mappings", "reconcile", "completeness", "discrepancies", "invoices"} {
		t, err := template.Must(layout.Clone()).ParseFS(templateFS, "templates/"+page+".html")
		if err != nil {
			return nil, err
		}
		c.pages[page] = t
	}
	if c.login, err = template.ParseFS(templateFS, "templates/login.html"); err != nil {
		return nil, err
	}
	return c, nil
}

// filesOnly serves an FS's files and no directory: opening one is
// fs.ErrNotExist, so the file server answers 404 instead of a listing.
type filesOnly struct{ fs.FS }

// Open opens name unless it is a directory.
func (f filesOnly) Open(name string) (fs.File, error) {
	file, err := f.FS.Open(name)
	if err != nil {
		return nil, err
	}
	if st, err := file.Stat(); err != nil || st.IsDir() {
		_ = file.Close()
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
	return file, nil
}

// Handler is the console's routes, to mount at /console.
func (c *Console) Handler() http.Handler {
	r := chi.NewRouter()
	r.Use(securityHeaders)
	static, _ := fs.Sub(staticFS, "static")
	r.Get("/static/*", http.StripPrefix("/console/static/", http.FileServer(http.FS(filesOnly{static}))).ServeHTTP)
	r.Get("/login", c.getLogin)
	r.Post("/login", c.postLogin)
	r.Group(func(r chi.Router) {
		r.Use(c.requireSession)
		r.Get("/", c.overview)
		r.Get("/items/{id}", c.item)
		r.Get("/uncertain", c.uncertain)
		c.reconcileRoutes(r)
		c.recoveryRoutes(r)
		r.Group(func(r chi.Router) {
			r.Use(c.limitReads)
			r.Get("/quarantine", c.quarantine)
			r.Get("/quarantine.csv", c.quarantineCSV)
			r.Get("/mappings", c.mappingsPage)
			r.Get("/reconcile", c.reconcilePage)
			r.Get("/reconcile/{id}", c.reconcilePage)
			r.Get("/completeness", c.completeness)
			r.Get("/completeness.csv", c.completenessCSV)
			r.Get("/invoices", c.invoicesPage)
		})
		r.With(requireRole(auth.RoleFinance)).Post("/invoices/checks/{id}/resolve", c.resolveInvoiceCheck)
		r.Post("/logout", c.logout)
		r.Group(func(r chi.Router) {
			r.Use(requireRole(auth.RoleOperator))
			r.Post("/items/{id}/requeue", c.requeue)
			r.Post("/quarantine/requeue", c.requeueMatching)
			r.Post("/items/{id}/recover", c.recover)
			r.Post("/mappings/features", c.putFeature)
			r.Post("/mappings/tenants", c.putTenant)
			r.Post("/reconcile/runs", c.startRun)
		})
	})
	return r
}

// securityHeaders: no script runs, nothing is framed, types are what they
// say.
func securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "same-origin")
		h.Set("Cache-Control", "no-store")
		next.ServeHTTP(w, r)
	})
}

// requireSession sends a browser without a session to the sign-in page
// (saying so when the one it had has ended), and refuses a POST whose CSRF
// token is missing or wrong.
func (c *Console) requireSession(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s, ok, had := c.lookup(r.Context(), r)
		if !ok {
			if had {
				clearCookie(w)
			}
			if r.Method != http.MethodGet {
				http.Error(w, "sign in first", http.StatusUnauthorized)
				return
			}
			to := "/console/login"
			if had {
				to += "?ended=1"
			}
			http.Redirect(w, r, to, http.StatusSeeOther)
			return
		}
		if r.Method == http.MethodPost {
			r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
			if !checkCSRF(r, s) {
				http.Error(w, "the form's CSRF token is missing or wrong: reload the page and try again", http.StatusForbidden)
				return
			}
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), sessionKey{}, s)))
	})
}

func requireRole(min auth.Role) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if s, _ := sessionOf(r); !s.Role.Allows(min) {
				http.Error(w, "your role may not do this", http.StatusForbidden)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
}

func (c *Console) getLogin(w http.ResponseWriter, r *http.Request) {
	var notice string
	if r.URL.Query().Get("ended") != "" {
		notice = "Your session has ended: sign in again."
	}
	c.renderLogin(w, http.StatusOK, loginPage{Notice: notice})
}

// loginPage is what the sign-in page says: an error, or a notice.
type loginPage struct{ Error, Notice string }

func (c *Console) renderLogin(w http.ResponseWriter, status int, p loginPage) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_ = c.login.ExecuteTemplate(w, "login", p)
}

// postLogin signs in: only a form posted from this site's own page, and
// only while the client's address (and every address together) is under
// its limit of failed sign-ins — over it the token is not even looked at.
func (c *Console) postLogin(w http.ResponseWriter, r *http.Request) {
	if !fromThisSite(r, true) {
		c.renderLogin(w, http.StatusForbidden, loginPage{Error: "Refused: this sign-in did not come from the console's own sign-in page. " +
			"Open the console's address yourself and sign in there."})
		return
	}
	addr := clientAddr(r)
	attempt, wait := c.throttle.admit(addr)
	if wait > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(int(wait/time.Second)))
		c.renderLogin(w, http.StatusTooManyRequests, loginPage{Error: fmt.Sprintf(
			"Too many failed sign-ins: try again in %d seconds.", int(wait/time.Second))})
		return
	}
	failed := true
	defer func() { attempt.finish(failed) }()
	r.Body = http.MaxBytesReader(w, r.Body, 8<<10)
	token := strings.TrimSpace(r.PostFormValue("token"))
	if token == "" {
		failed = false // no token was tried
		c.renderLogin(w, http.StatusBadRequest, loginPage{Error: "Enter an API token."})
		return
	}
	_, err := c.signIn(w, r, token, addr)
	switch {
	case errors.Is(err, auth.ErrUnknownToken):
		c.renderLogin(w, http.StatusUnauthorized, loginPage{Error: "Unknown, revoked or expired token."})
	case errors.Is(err, errIngestOnly):
		c.renderLogin(w, http.StatusForbidden, loginPage{Error: "An ingest token cannot sign in: use a finance, operator or admin token."})
	case err != nil:
		failed = false // the server failed, not the client
		c.fail(w, r, err)
	default:
		failed = false
		http.Redirect(w, r, "/console/", http.StatusSeeOther)
	}
}

func (c *Console) logout(w http.ResponseWriter, r *http.Request) {
	if err := c.signOut(w, r); err != nil {
		c.fail(w, r, err)
		return
	}
	http.Redirect(w, r, "/console/login", http.StatusSeeOther)
}

// fail logs an unexpected error and answers 500 without its text.
func (c *Console) fail(w http.ResponseWriter, r *http.Request, err error) {
	c.Logger.ErrorContext(r.Context(), "console request failed", "route", chi.RouteContext(r.Context()).RoutePattern(), "error", err)
	http.Error(w, "the server failed; see its log", http.StatusInternalServerError)
}

type navItem struct {
	Href, Label string
	Active      bool
}

type flash struct {
	Text  string
	Error bool
}

type page struct {
	Title   string
	Nav     []navItem
	Session auth.Session
	CanAct  bool
	Flash   *flash
	// Stall is set while export is stalled.
	Stall *stallBanner
	Data  any
}

// flashes are the messages an action may redirect with: by code, so that
// a link cannot make the console say anything else.
var flashes = map[string]flash{
	"requeued":         {Text: "Requeued: the item is pending again."},
	"readdressed":      {Text: "Re-addressed: a successor item carries the usage under the current mapping."},
	"feature_saved":    {Text: "Feature mapping saved."},
	"tenant_saved":     {Text: "Tenant mapping saved."},
	"run_queued":       {Text: "Reconcile run queued."},
	"mapping_changed":  {Text: "Not requeued: the mapping changed since the page was drawn; look again.", Error: true},
	"still_ineligible": {Text: "Not requeued: the item would be quarantined again; fix its cause first.", Error: true},
	"period_closed":    {Text: "Not requeued: the item's billing period's invoice has closed, so Stripe would bill it on no invoice. To send it anyway, tick 'its invoice has closed: send it knowingly' and requeue again.", Error: true},
	"may_have_reached": {Text: "Not re-addressed: an attempt may have reached Stripe; it keeps its identifier (see recovery).", Error: true},
	"not_quarantined":  {Text: "Not requeued: the item is no longer quarantined.", Error: true},
	"requeue_refused":  {Text: "Not requeued: the outbox refused it; see the item's page.", Error: true},
	"no_stripe":        {Text: "No Stripe key is configured: there is nothing to reconcile against.", Error: true},
	"invalid_settle":   {Text: "The settle delay must be a duration such as 2h.", Error: true},
}

func (c *Console) render(w http.ResponseWriter, r *http.Request, name, title string, data any) {
	s, _ := sessionOf(r)
	p := page{Title: title, Session: s, CanAct: s.Role.Allows(auth.RoleOperator), Data: data}
	if f, ok := flashes[r.URL.Query().Get("flash")]; ok {
		p.Flash = &f
	}
	p.Stall = c.stallBanner(r.Context())
	for _, n := range []navItem{{"/console/", "Overview", false}, {"/console/quarantine", "Quarantine", false},
		{"/console/uncertain", "Uncertain & rejected", false}, {"/console/mappings", "Mappings", false},
		{"/console/reconcile", "Reconciliation", false}, {"/console/completeness", "Completeness", false},
		{"/console/discrepancies", "Open discrepancies", false}, {"/console/invoices", "Invoices", false}} {
		n.Active = n.Href == r.URL.Path || (n.Href != "/console/" && strings.HasPrefix(r.URL.Path, n.Href))
		p.Nav = append(p.Nav, n)
	}
	var b strings.Builder
	if err := c.pages[name].ExecuteTemplate(&b, "layout", p); err != nil {
		c.fail(w, r, err)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_, _ = w.Write([]byte(b.String()))
}

// stallBanner reads why export is stalled and, if it is, what waits in the
// outbox and the ledger; nil when it is not.
func (c *Console) stallBanner(ctx context.Context) *stallBanner {
	if c.ExportStalls == nil {
		return nil
	}
	reasons := c.ExportStalls(ctx)
	if len(reasons) == 0 {
		return nil
	}
	b := &stallBanner{}
	named := map[string]bool{}
	for _, r := range reasons {
		alert := stallAlerts[r.Reason]
		b.Reasons = append(b.Reasons, stallLine{ExportStall: r, Alert: alert})
		if alert != "" && !named[alert] {
			named[alert] = true
			// The anchor is the heading's as GitHub and most renderers make
			// it: the alert's name in lower case.
			b.Alerts = append(b.Alerts, stallAlert{Name: alert, URL: c.Runbook + "#" + strings.ToLower(alert)})
		}
	}
	if g, err := c.Outbox.ReadGauge(ctx, c.pool); err == nil {
		b.PendingKnown, b.Pending = true, g.Counts[outbox.StatePending]
		b.PendingOldest = (time.Duration(g.OldestPendingAgeSeconds) * time.Second).String()
	}
	if bl, err := meter.ReadBacklog(ctx, c.pool); err == nil {
		b.Known, b.Oldest = true, bl.OldestAge.Round(time.Second).String()
		switch {
		case bl.Events >= meter.BacklogCountCap:
			b.Waiting = "at least " + strconv.FormatInt(bl.Events, 10) + " events wait"
		case bl.Events == 1:
			b.Waiting = "1 event waits"
		default:
			b.Waiting = strconv.FormatInt(bl.Events, 10) + " events wait"
		}
	}
	return b
}

// back redirects after an action with a flash code.
func back(w http.ResponseWriter, r *http.Request, to, code string) {
	u, _ := url.Parse(to)
	q := u.Query()
	q.Set("flash", code)
	u.RawQuery = q.Encode()
	http.Redirect(w, r, u.String(), http.StatusSeeOther)
}

func itemID(r *http.Request) (int64, bool) {
	id, err := strconv.ParseInt(chi.URLParam(r, "id"), 10, 64)
	return id, err == nil && id > 0
}

func actor(r *http.Request) string {
	s, _ := sessionOf(r)
	return "console:" + s.Name
}

func prettyJSON(v any) string {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}
