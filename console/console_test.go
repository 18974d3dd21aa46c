package console_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/browser"
	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

func TestMain(m *testing.M) { testdb.Main(m) }

type site struct {
	env *stagetest.Env
	url string
}

// newSite serves the console on a database with two quarantined items:
// usage of tenant acme, which has no customer (no_customer), and of the
// unmapped feature gpu (feature_unmapped, after its window).
func newSite(t *testing.T) *site {
	t.Helper()
	env := stagetest.New(t, outbox.Config{})
	env.Feature(t, "api", mappings.Sum, time.Hour)
	_, _, err := env.Maps.PutTenant(env.Ctx, env.Pool, "beta", mappings.TenantInput{StripeCustomerID: "cus_beta"}, "test")
	require.NoError(t, err)
	env.MustIngest(t, stagetest.Ev("a1", "acme", "api", 5, stagetest.Ago(3*time.Hour)),
		stagetest.Ev("g1", "beta", "gpu", 2, stagetest.Ago(3*time.Hour)),
		stagetest.Ev("b1", "beta", "api", 4, stagetest.Ago(3*time.Hour)))
	env.Pass(t)
	_, err = env.Outbox.Maintain(env.Ctx, env.Pool) // a snapshot for the overview's chart
	require.NoError(t, err)
	con, err := console.New(console.Deps{Pool: env.Pool, Outbox: env.Outbox, Mappings: env.Maps,
		Requeuer: &quarantine.Requeuer{Outbox: env.Outbox, Stager: env.Stager}, Settle: 2 * time.Hour,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	require.NoError(t, err)
	srv := httptest.NewServer(api.New(api.Options{Console: con.Handler(), Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)
	return &site{env: env, url: srv.URL}
}

func (s *site) token(t *testing.T, name string, role auth.Role) string {
	t.Helper()
	tok, err := auth.CreateToken(s.env.Ctx, s.env.Pool, name, role, nil)
	require.NoError(t, err)
	return tok.Secret
}

// artifacts is where the screenshots go: ARTIFACTS_DIR, or artifacts/ at
// the repository's root (ignored by git).
func artifacts(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("ARTIFACTS_DIR")
	if dir == "" {
		dir = filepath.Join("..", "artifacts")
	}
	dir = filepath.Join(dir, "console")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	return dir
}

// browse starts headless Chromium (Debian's, as .ci/run installs it) and
// collects every console error and failed load a page reports.
func browse(t *testing.T) (context.Context, func() []string) {
	t.Helper()
	path, err := exec.LookPath("chromium")
	if err != nil {
		if os.Getenv("TALLY_REQUIRE_BROWSER") != "" {
			t.Fatal("chromium is required (TALLY_REQUIRE_BROWSER) but not on PATH: apt-get install chromium")
		}
		t.Skip("chromium not on PATH (apt-get install chromium); .ci/run installs it")
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(path), chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true), chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(viewW, viewH))
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelCtx := chromedp.NewContext(actx)
	ctx, cancelTimeout := context.WithTimeout(ctx, 3*time.Minute)
	t.Cleanup(func() { cancelTimeout(); cancelCtx(); cancelAlloc() })
	var (
		mu   sync.Mutex
		errs []string
	)
	require.NoError(t, chromedp.Do(ctx)) // start the browser and the tab
	require.NoError(t, chromedp.Listen(ctx, func(ev any) {
		mu.Lock()
		defer mu.Unlock()
		switch e := ev.(type) {
		case *runtime.EventConsoleAPICalled:
			if e.Type == runtime.ConsoleAPICalledTypeError {
				errs = append(errs, fmt.Sprintf("console.error: %v", e.Args))
			}
		case *runtime.EventExceptionThrown:
			errs = append(errs, "exception: "+e.ExceptionDetails.Text)
		case *log.EventEntryAdded:
			if e.Entry.Level == log.EntryLevelError {
				errs = append(errs, fmt.Sprintf("%s: %s %s", e.Entry.Source, e.Entry.Text, e.Entry.URL))
			}
		}
	}))
	require.NoError(t, chromedp.Do(ctx, chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
		if _, err := cdp.Call(ctx, tg, log.Enable, cdp.Empty{}); err != nil {
			return err
		}
		_, err := cdp.Call(ctx, tg, runtime.Enable, cdp.Empty{})
		return err
	})))
	return ctx, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), errs...)
	}
}

func signIn(token string, base string) chromedp.Action[chromedp.Void] {
	return chromedp.Steps(
		chromedp.Navigate(base+"/console/"),
		chromedp.WaitVisible(chromedp.CSS(`input[name=token]`)),
		chromedp.SendKeys(chromedp.CSS(`input[name=token]`), token),
		chromedp.Submit(chromedp.CSS(`input[name=token]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=who]`)),
	)
}

// texts is the text of every element sel matches, in order.
func texts(t *testing.T, ctx context.Context, sel string) []string {
	t.Helper()
	out, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](fmt.Sprintf(`[...document.querySelectorAll(%q)].map(e => e.textContent.trim())`, sel)))
	require.NoError(t, err)
	return out
}

// readNames names beta's customer in a simulated Stripe and runs the
// names job's reading against it, as the hourly job would.
func readNames(t *testing.T, s *site) {
	t.Helper()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_beta")
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	_, err = c.Stripe().V1Customers.Update(s.env.Ctx, "cus_beta", &stripe.CustomerUpdateParams{Name: stripe.String("Beta GmbH")})
	require.NoError(t, err)
	res, err := mappings.RefreshNames(s.env.Ctx, s.env.Pool, mappings.StripeMeters{Client: c}, time.Hour, 10)
	require.NoError(t, err)
	require.Equal(t, mappings.NamesRead{Read: 1}, res)
}

func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel)))
	require.NoError(t, err)
	return s
}

func count(t *testing.T, ctx context.Context, css string) int {
	t.Helper()
	n, err := chromedp.Run(ctx, chromedp.Evaluate[int](fmt.Sprintf(`document.querySelectorAll(%q).length`, css)))
	require.NoError(t, err)
	return n
}

// The window every screenshot is taken in: a laptop's.
const viewW, viewH = 1280, 800

// screenshot checks that the page fits a 1280×800 window — nothing wider
// than the window, so nobody scrolls sideways — and photographs the whole
// page at that width.
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	fits(t, ctx, name)
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(artifacts(t), name+".png"), png, 0o644))
}

// fits fails the test when the page overflows the window sideways: the
// document scrolls horizontally, or an element reaches past the window's
// right edge (the first few are named).
func fits(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	require.NoError(t, chromedp.Do(ctx, chromedp.EmulateViewport(viewW, viewH)))
	type overflow struct {
		ScrollWidth, ClientWidth int
		Wide                     []string
	}
	got, err := chromedp.Run(ctx, chromedp.Evaluate[overflow](`(() => {
		const d = document.documentElement, w = d.clientWidth;
		const wide = [];
		for (const e of document.body.querySelectorAll('*')) {
			const r = e.getBoundingClientRect();
			if (r.width > 0 && (r.right > w + 0.5 || r.width > w)) {
				const id = e.getAttribute('data-testid') || e.id || e.className.baseVal || e.className || '';
				wide.push(e.tagName.toLowerCase() + (id ? '[' + id + ']' : '') + ' ' + Math.round(r.right) + 'px');
				if (wide.length === 5) break;
			}
		}
		return {ScrollWidth: d.scrollWidth, ClientWidth: w, Wide: wide};
	})()`))
	require.NoError(t, err)
	require.LessOrEqual(t, got.ScrollWidth, got.ClientWidth, "%s scrolls sideways in a %d-px window: %v", name, viewW, got.Wide)
	require.Empty(t, got.Wide, "%s: elements wider than the %d-px window", name, viewW)
}

// Finance signs in, filters the quarantine, downloads the CSV and sees no
// action anywhere; every page renders without a console error and is
// photographed.
func TestFinanceReadsWithoutActions(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	ctx, consoleErrors := browse(t)
	download := t.TempDir()
	require.NoError(t, chromedp.Do(ctx, signIn(s.token(t, "fiona", auth.RoleFinance), s.url)))
	_, err := chromedp.CallBrowser(ctx, browser.SetDownloadBehavior, browser.SetDownloadBehaviorParams{
		Behavior: browser.SetDownloadBehaviorBehaviorAllow, DownloadPath: download})
	require.NoError(t, err)
	require.Equal(t, "fiona · finance", text(t, ctx, `[data-testid=who]`))

	for _, p := range []struct{ path, name string }{
		{"/console/", "overview"}, {"/console/quarantine", "quarantine"}, {"/console/uncertain", "uncertain"},
		{"/console/mappings", "mappings"}, {"/console/reconcile", "reconcile"}, {"/console/completeness?period=" + time.Now().UTC().Add(-3*time.Hour).Format("2006-01"), "completeness"},
	} {
		require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+p.path), chromedp.WaitVisible(chromedp.CSS(`main`))))
		require.Zero(t, count(t, ctx, `main form[method=post]`), "finance sees no action on %s", p.path)
		screenshot(t, ctx, "finance-"+p.name)
	}

	// The completeness page says when its snapshot was taken, and computes
	// it anew when asked.
	month := time.Now().UTC().Add(-3 * time.Hour).Format("2006-01")
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/completeness?period="+month), chromedp.WaitVisible(chromedp.CSS(`[data-testid=as-of]`))))
	before := text(t, ctx, `[data-testid=as-of]`)
	require.Regexp(t, `^As of \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z `, before)
	attr, err := chromedp.Run(ctx, chromedp.AttributeValue(chromedp.CSS(`[data-testid=as-of] a`), "href"))
	require.NoError(t, err)
	href := attr.Value
	require.Contains(t, href, "refresh=1")
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+href), chromedp.WaitVisible(chromedp.CSS(`[data-testid=as-of]`))))
	after := text(t, ctx, `[data-testid=as-of]`)
	require.Greater(t, after, before, "computed anew: a later snapshot")
	require.Contains(t, text(t, ctx, `[data-testid=audit]`), "never audited", "no audit of the month yet")

	// Filter the quarantine by reason.
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/quarantine"),
		chromedp.SetValue(chromedp.CSS(`select[name=reason]`), "no_customer"), chromedp.Submit(chromedp.CSS(`select[name=reason]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=items]`))))
	loc, err := chromedp.Run(ctx, chromedp.Location())
	require.NoError(t, err)
	require.Contains(t, loc, "reason=no_customer")
	require.Equal(t, 1, count(t, ctx, `[data-testid=items] tr[data-testid^=item-]`))
	var item int64
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT id FROM outbox_items WHERE quarantine_reason = 'no_customer'`).Scan(&item))
	screenshot(t, ctx, "finance-quarantine-filtered")

	// The item page.
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(fmt.Sprintf("%s/console/items/%d", s.url, item)), chromedp.WaitVisible(chromedp.CSS(`main h1`))))
	screenshot(t, ctx, "finance-item")

	// Download the CSV of the filtered report.
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/quarantine?reason=no_customer"),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=csv]`)), chromedp.Click(chromedp.CSS(`[data-testid=csv]`))))
	var csv []byte
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(filepath.Join(download, "tally-quarantine.csv"))
		csv = b
		return err == nil && len(b) > 0
	}, 15*time.Second, 100*time.Millisecond)
	require.Equal(t, "reason,tenant,feature,period,items,events,value", strings.SplitN(string(csv), "\n", 2)[0])
	require.Contains(t, string(csv), "no_customer,acme,api,")
	require.NotContains(t, string(csv), "feature_unmapped")

	require.Empty(t, consoleErrors())
}

// Finance reads the completeness page per customer, by name once Stripe's
// is read (beta), else plainly by tenant id (acme has no mapping), with
// units, YYYY-MM periods, thousands separators, totals by feature and
// counts that link to their items; and an overview of this month's usage
// and the open discrepancies, without the outbox's states.
func TestFinanceReadsCompletenessByCustomer(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	ctx, consoleErrors := browse(t)
	require.NoError(t, chromedp.Do(ctx, signIn(s.token(t, "fiona", auth.RoleFinance), s.url)))
	month := time.Now().UTC().Add(-3 * time.Hour).Format("2006-01")
	s.env.MustIngest(t, stagetest.Ev("b2", "beta", "api", 1234560, stagetest.Ago(3*time.Hour)))
	s.env.Pass(t)
	page := s.url + "/console/completeness?period=" + month
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(page), chromedp.WaitVisible(chromedp.CSS(`[data-testid=completeness]`))))
	require.Equal(t, []string{"acme", "beta", "beta"}, texts(t, ctx, `[data-testid=customer]`), "no name read yet: the tenant ids")
	readNames(t, s)
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(page), chromedp.WaitVisible(chromedp.CSS(`[data-testid=completeness]`))))
	require.Equal(t, []string{"acme", "Beta GmbH", "Beta GmbH"}, texts(t, ctx, `[data-testid=customer]`))
	require.Equal(t, []string{"beta", "beta"}, texts(t, ctx, `[data-testid=tenant]`), "the tenant id beside the name")
	require.Equal(t, []string{"sum of api", "sum of api", "no mapping"}, texts(t, ctx, `[data-testid=unit]`))
	for _, p := range texts(t, ctx, `[data-testid=period]`) {
		require.Regexp(t, `^\d{4}-\d\d$`, p, "a calendar month, not a timestamp")
	}
	require.Contains(t, text(t, ctx, `[data-testid=line]:nth-child(2)`), "1,234,564", "thousands separated")
	require.Equal(t, 2, count(t, ctx, `[data-testid=total]`), "a total a feature")
	require.Contains(t, text(t, ctx, `[data-testid=total]`), "1,234,569")
	quarantined, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector('[data-testid=line] a[href^="/console/quarantine"]').getAttribute('href')`))
	require.NoError(t, err)
	require.Equal(t, "/console/quarantine?feature=api&period="+month+"&tenant=acme", quarantined, "acme's quarantined usage")
	screenshot(t, ctx, "finance-completeness-names")
	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(`[data-testid=line]:nth-child(2) a[href*="items=pending"]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=line-items]`))))
	require.Contains(t, text(t, ctx, `[data-testid=line-items] h2`), "pending items of Beta GmbH (beta) · api · "+month)
	require.Equal(t, 2, count(t, ctx, `[data-testid=line-item]`), "the window's item and its supplement")
	require.Equal(t, 2, count(t, ctx, `[data-testid=line]`), "the report narrowed to the tenant")
	screenshot(t, ctx, "finance-completeness-items")

	// The overview shows finance this month's usage and the open
	// discrepancies, not the outbox's states.
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/"), chromedp.WaitVisible(chromedp.CSS(`[data-testid=usage]`))))
	if time.Now().UTC().Format("2006-01") == month {
		require.Equal(t, "sum of api", text(t, ctx, `[data-testid=usage-api] [data-testid=unit]`))
		require.Equal(t, "1,234,569", text(t, ctx, `[data-testid=usage-api] [data-testid=usage-value]`))
		require.Equal(t, "4", text(t, ctx, `[data-testid=usage-total] th.num`), "events of every feature")
	}
	open, err := chromedp.Run(ctx, chromedp.AttributeValue(chromedp.CSS(`[data-testid=open-total]`), "href"))
	require.NoError(t, err)
	require.Equal(t, "/console/discrepancies", open.Value)
	require.Zero(t, count(t, ctx, `[data-testid=states]`), "no outbox states for finance")
	screenshot(t, ctx, "finance-overview-usage")

	require.Empty(t, consoleErrors())
}

// The operator fixes the missing customer in the mappings page, requeues
// the item under the new version and watches it leave the quarantine; the
// audit trail shows both actions.
func TestOperatorFixesAndRequeues(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	ctx, consoleErrors := browse(t)
	require.NoError(t, chromedp.Do(ctx, signIn(s.token(t, "otto", auth.RoleOperator), s.url)))

	var item int64
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT id FROM outbox_items WHERE quarantine_reason = 'no_customer'`).Scan(&item))
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/mappings"), chromedp.WaitVisible(chromedp.CSS(`[data-testid=tenant-form]`))))
	screenshot(t, ctx, "operator-mappings")
	require.NoError(t, chromedp.Do(ctx,
		chromedp.SendKeys(chromedp.CSS(`[data-testid=tenant-form] input[name=tenant]`), "acme"),
		chromedp.SendKeys(chromedp.CSS(`[data-testid=tenant-form] input[name=customer]`), "cus_acme"),
		chromedp.Submit(chromedp.CSS(`[data-testid=tenant-form] input[name=tenant]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=flash]`))))
	require.Equal(t, "Tenant mapping saved.", text(t, ctx, `[data-testid=flash]`))

	sel := fmt.Sprintf(`[data-testid=requeue-%d]`, item)
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/quarantine"), chromedp.WaitVisible(chromedp.CSS(sel))))
	label := text(t, ctx, sel)
	screenshot(t, ctx, "operator-quarantine")
	tn, err := s.env.Maps.GetTenant(s.env.Ctx, s.env.Pool, "acme")
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("Requeue under v%d", tn.Version), label, "the button shows the current mapping version")
	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(sel)), chromedp.WaitVisible(chromedp.CSS(`[data-testid=flash]`))))
	require.Contains(t, text(t, ctx, `[data-testid=flash]`), "Re-addressed")
	require.Zero(t, count(t, ctx, fmt.Sprintf(`[data-testid=item-%d]`, item)), "the item left the quarantine")
	screenshot(t, ctx, "operator-requeued")

	var state string
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT state FROM outbox_items WHERE id = $1`, item).Scan(&state))
	require.Equal(t, "superseded", state)
	var actors []string
	rows, err := s.env.Pool.Query(s.env.Ctx, `SELECT actor || ' ' || action FROM audit_log WHERE actor LIKE 'console:%' ORDER BY id`)
	require.NoError(t, err)
	for rows.Next() {
		var a string
		require.NoError(t, rows.Scan(&a))
		actors = append(actors, a)
	}
	require.Equal(t, []string{"console:otto session.open", "console:otto mapping.tenant", "console:otto readdress"}, actors,
		"the sign-in, then the actions")

	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(fmt.Sprintf("%s/console/items/%d", s.url, item)), chromedp.WaitVisible(chromedp.CSS(`main h1`))))
	require.Equal(t, 1, count(t, ctx, `[data-testid=successor]`), "the page links to the successor")
	screenshot(t, ctx, "operator-item-audit")

	// The operator's views of the other pages, with their actions; and a
	// reconcile run's page.
	run, err := reconcile.Queue(s.env.Ctx, s.env.Pool, reconcile.TriggerAPI, "token:otto", reconcile.Options{Settle: time.Hour})
	require.NoError(t, err)
	for _, p := range []struct{ path, name, action string }{
		{"/console/uncertain", "operator-uncertain", ""},
		{"/console/reconcile", "operator-reconcile", `main form[action="/console/reconcile/runs"]`},
		{fmt.Sprintf("/console/reconcile/%d", run), "operator-reconcile-run", `[data-testid=discrepancies]`},
		{"/console/", "operator-overview", `[data-testid=states]`},
		{"/console/completeness?period=" + time.Now().UTC().Add(-3*time.Hour).Format("2006-01"), "operator-completeness", ""},
	} {
		require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+p.path), chromedp.WaitVisible(chromedp.CSS(`main h1`))))
		if p.action != "" {
			require.Equal(t, 1, count(t, ctx, p.action), p.path)
		}
		screenshot(t, ctx, p.name)
	}
	require.Empty(t, consoleErrors())
}

// The operator maps the unmapped feature gpu in the feature form, choosing
// the v2 stream exporter in its select: the table shows it (and "node
// default" for api), the history shows the change, and the quarantined gpu
// item, requeued under the new version, is re-addressed to that exporter. An
// exporter the select does not offer is refused and stores nothing.
func TestOperatorSetsFeatureExporter(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	ctx, consoleErrors := browse(t)
	require.NoError(t, chromedp.Do(ctx, signIn(s.token(t, "olive", auth.RoleOperator), s.url)))
	form := `[data-testid=feature-form] `
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/mappings"), chromedp.WaitVisible(chromedp.CSS(form+`select[name=exporter]`))))
	options, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](
		`[...document.querySelectorAll('[data-testid=feature-form] select[name=exporter] option')].map(o => o.value)`))
	require.NoError(t, err)
	require.Equal(t, []string{"", "stripe_meter_events", "stripe_meter_event_stream"}, options, "node default first, then both exporters")
	require.Equal(t, "node default", text(t, ctx, `[data-testid=feature-api] [data-testid=exporter]`))

	require.NoError(t, chromedp.Do(ctx,
		chromedp.SendKeys(chromedp.CSS(form+`input[name=feature]`), "gpu"),
		chromedp.SendKeys(chromedp.CSS(form+`input[name=event_name]`), "gpu_seconds"),
		chromedp.SetValue(chromedp.CSS(form+`select[name=exporter]`), "stripe_meter_event_stream"),
		chromedp.Submit(chromedp.CSS(form+`input[name=feature]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=flash]`))))
	require.Equal(t, "Feature mapping saved.", text(t, ctx, `[data-testid=flash]`))
	require.Equal(t, "stripe_meter_event_stream", text(t, ctx, `[data-testid=feature-gpu] [data-testid=exporter]`))
	require.Contains(t, text(t, ctx, `[data-testid=feature-gpu]`), "1h", "the window as a duration")
	require.Equal(t, "stripe_customer_id", text(t, ctx, `[data-testid=feature-gpu] [data-testid=customer-key]`), "no checker: Stripe's default keys")
	require.Equal(t, "value", text(t, ctx, `[data-testid=feature-gpu] [data-testid=value-key]`))
	require.Contains(t, text(t, ctx, `main`), "exporter stripe_meter_event_stream", "the history shows the exporter")
	screenshot(t, ctx, "operator-feature-exporter")
	gpu, err := s.env.Maps.GetFeature(s.env.Ctx, s.env.Pool, "gpu")
	require.NoError(t, err)
	require.Equal(t, mappings.ExporterStripeMeterEventStream, gpu.Exporter)

	// A value the select does not offer (a forged form) is refused. (A fresh
	// page first: the one shown still has the flash of the save.)
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/mappings"), chromedp.WaitVisible(chromedp.CSS(form+`select[name=exporter]`))))
	require.Zero(t, count(t, ctx, `[data-testid=flash]`))
	forged, err := chromedp.Run(ctx, chromedp.Evaluate[string](`(() => {
		const sel = document.querySelector('[data-testid=feature-form] select[name=exporter]');
		sel.add(new Option('kafka', 'kafka', true, true));
		return sel.value;
	})()`))
	require.NoError(t, err)
	require.Equal(t, "kafka", forged)
	require.NoError(t, chromedp.Do(ctx,
		chromedp.SendKeys(chromedp.CSS(form+`input[name=feature]`), "gpu"),
		chromedp.SendKeys(chromedp.CSS(form+`input[name=event_name]`), "gpu_seconds"),
		chromedp.Submit(chromedp.CSS(form+`input[name=feature]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=flash]`))))
	require.Contains(t, text(t, ctx, `[data-testid=flash]`), "Not saved")
	again, err := s.env.Maps.GetFeature(s.env.Ctx, s.env.Pool, "gpu")
	require.NoError(t, err)
	require.Equal(t, gpu.Version, again.Version, "nothing stored")
	require.Equal(t, mappings.ExporterStripeMeterEventStream, again.Exporter)

	var item int64
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT id FROM outbox_items WHERE quarantine_reason = 'feature_unmapped'`).Scan(&item))
	sel := fmt.Sprintf(`[data-testid=requeue-%d]`, item)
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/quarantine"), chromedp.WaitVisible(chromedp.CSS(sel)),
		chromedp.Click(chromedp.CSS(sel)), chromedp.WaitVisible(chromedp.CSS(`[data-testid=flash]`))))
	require.Contains(t, text(t, ctx, `[data-testid=flash]`), "Re-addressed")
	var exporter string
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT s.exporter FROM outbox_items o JOIN outbox_items s ON s.id = o.superseded_by
		WHERE o.id = $1`, item).Scan(&exporter))
	require.Equal(t, mappings.ExporterStripeMeterEventStream, exporter, "the successor goes to the feature's exporter")
	require.Empty(t, consoleErrors())
}

// A POST without the session's CSRF token is refused, and so is one from
// another origin; a finance session may not act at all; no session is
// sent to sign in.
func TestActionsNeedCSRFAndRole(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	client := func(token string) *http.Client {
		jar, err := cookiejar.New(nil)
		require.NoError(t, err)
		c := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		resp, err := postSignIn(c, s.url, token)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusSeeOther, resp.StatusCode)
		cookies := jar.Cookies(mustURL(t, s.url+"/console/"))
		require.Len(t, cookies, 1)
		return c
	}
	var item int64
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT id FROM outbox_items WHERE quarantine_reason = 'no_customer'`).Scan(&item))
	requeue := fmt.Sprintf("%s/console/items/%d/requeue", s.url, item)

	op := client(s.token(t, "olga", auth.RoleOperator))
	resp, err := op.PostForm(requeue, url.Values{"mapping_version": {"1"}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode, "no CSRF token")
	resp, err = op.PostForm(requeue, url.Values{"mapping_version": {"1"}, "csrf": {"guess"}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode, "a wrong CSRF token")

	fin := client(s.token(t, "fred", auth.RoleFinance))
	resp, err = fin.PostForm(requeue, url.Values{"mapping_version": {"1"}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode)

	resp, err = http.PostForm(requeue, url.Values{"mapping_version": {"1"}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err = noRedirect.Get(s.url + "/console/quarantine")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	require.Equal(t, "/console/login", resp.Header.Get("Location"))

	ing := s.token(t, "svc", auth.RoleIngest)
	resp, err = postSignIn(http.DefaultClient, s.url, ing)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode, "an ingest token may not sign in")

	var state string
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT state FROM outbox_items WHERE id = $1`, item).Scan(&state))
	require.Equal(t, "quarantined", state, "nothing was done")
}

// postSignIn posts the sign-in form as the console's own page does: with
// the site's origin.
func postSignIn(c *http.Client, base, token string) (*http.Response, error) {
	req, err := http.NewRequest(http.MethodPost, base+"/console/login", strings.NewReader(url.Values{"token": {token}}.Encode()))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", base)
	return c.Do(req)
}

func mustURL(t *testing.T, s string) *url.URL {
	t.Helper()
	u, err := url.Parse(s)
	require.NoError(t, err)
	return u
}
