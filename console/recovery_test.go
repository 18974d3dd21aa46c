package console_test

import (
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// uncertainSite is a console with three uncertain items of tenant beta,
// each sent once with no answer.
type uncertainSite struct {
	*site
	items []int64
}

func newUncertainSite(t *testing.T) *uncertainSite {
	t.Helper()
	env := stagetest.New(t, outbox.Config{})
	env.Feature(t, "api", mappings.Sum, time.Hour)
	_, _, err := env.Maps.PutTenant(env.Ctx, env.Pool, "beta", mappings.TenantInput{StripeCustomerID: "cus_beta"}, "test")
	require.NoError(t, err)
	env.MustIngest(t, stagetest.Ev("b1", "beta", "api", 4, stagetest.Ago(3*time.Hour)),
		stagetest.Ev("b2", "beta", "api", 6, stagetest.Ago(5*time.Hour)),
		stagetest.Ev("b3", "beta", "api", 9, stagetest.Ago(7*time.Hour)))
	env.Pass(t)
	s := &uncertainSite{}
	leases, err := env.Outbox.Claim(env.Ctx, env.Pool, outbox.ClaimOptions{Owner: "test", Limit: 10, Policy: outbox.BestEffort})
	require.NoError(t, err)
	require.Len(t, leases, 3)
	for _, l := range leases {
		require.NoError(t, env.Outbox.MarkUncertain(env.Ctx, env.Pool, l, outbox.ErrorInfo{Code: "timeout", Status: 504}, false))
		s.items = append(s.items, l.ID)
	}
	con, err := console.New(console.Deps{Pool: env.Pool, Outbox: env.Outbox, Mappings: env.Maps,
		Requeuer: &quarantine.Requeuer{Outbox: env.Outbox, Stager: env.Stager}, Settle: 2 * time.Hour,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	require.NoError(t, err)
	srv := httptest.NewServer(api.New(api.Options{Console: con.Handler(), Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)
	s.site = &site{env: env, url: srv.URL}
	return s
}

func (s *site) stateOf(t *testing.T, id int64) outbox.State {
	t.Helper()
	it, err := s.env.Outbox.Get(s.env.Ctx, s.env.Pool, id)
	require.NoError(t, err)
	return it.State
}

func (s *site) recoveries(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT count(*) FROM audit_log WHERE action = 'recover'`).Scan(&n))
	return n
}

// noFollow is c answering redirects instead of following them.
func noFollow(c *http.Client) *http.Client {
	n := *c
	n.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &n
}

// postSeeOther posts form and returns where the 303 sends the browser.
func postSeeOther(t *testing.T, c *http.Client, to string, form url.Values) string {
	t.Helper()
	resp, err := noFollow(c).PostForm(to, form)
	require.NoError(t, err)
	body := readBody(t, resp)
	require.Equal(t, http.StatusSeeOther, resp.StatusCode, body)
	return resp.Header.Get("Location")
}

// A recovery without a chosen outcome is refused with a clear notice and
// changes nothing; the item's page chooses nothing beforehand. A recovery
// at a lease token the item has moved past is refused too. Each answer is
// a redirect, so a reload sends nothing again.
func TestRecoverNeedsAChosenOutcome(t *testing.T) {
	t.Parallel()
	s := newUncertainSite(t)
	id := s.items[0]
	page := fmt.Sprintf("%s/console/items/%d", s.url, id)
	op, csrf := consoleClient(t, s.site, s.token(t, "otto", auth.RoleOperator), page)
	recover := page + "/recover"

	loc := postSeeOther(t, op, recover, url.Values{"csrf": {csrf}, "expect": {"uncertain"}, "reason": {"checked"}})
	require.Equal(t, fmt.Sprintf("/console/items/%d?notice=choose_outcome", id), loc)
	require.Equal(t, outbox.StateUncertain, s.stateOf(t, id))
	require.Zero(t, s.recoveries(t))
	resp, err := op.Get(s.url + loc)
	require.NoError(t, err)
	body := readBody(t, resp)
	require.Contains(t, body, "Not recovered: choose what happened")
	require.Contains(t, body, `data-testid="recover-form"`)
	require.NotRegexp(t, regexp.MustCompile(`name="to"[^>]*checked`), body, "no outcome is chosen beforehand")
	require.Contains(t, body, "no answer came back")

	it, err := s.env.Outbox.Get(s.env.Ctx, s.env.Pool, id)
	require.NoError(t, err)
	loc = postSeeOther(t, op, recover, url.Values{"csrf": {csrf}, "expect": {"uncertain"}, "to": {"accepted"},
		"lease_token": {fmt.Sprint(it.LeaseToken - 1)}})
	require.Equal(t, fmt.Sprintf("/console/items/%d?notice=expected_state", id), loc, "reviewed at an older lease")
	require.Equal(t, outbox.StateUncertain, s.stateOf(t, id))

	loc = postSeeOther(t, op, recover, url.Values{"csrf": {csrf}, "expect": {"uncertain"}, "to": {"rejected"}})
	require.Equal(t, fmt.Sprintf("/console/items/%d?notice=invalid_recovery", id), loc, "abandoning needs a reason")
	require.Zero(t, s.recoveries(t))

	loc = postSeeOther(t, op, recover, url.Values{"csrf": {csrf}, "expect": {"uncertain"}, "to": {"accepted"},
		"lease_token": {fmt.Sprint(it.LeaseToken)}, "reason": {"Stripe shows it"}})
	require.Equal(t, fmt.Sprintf("/console/items/%d?notice=recovered_accepted", id), loc)
	require.Equal(t, outbox.StateAccepted, s.stateOf(t, id))
	require.Equal(t, 1, s.recoveries(t))
}

// A bulk recovery is refused without an outcome, without items, to
// finance, without the CSRF token, and — as a whole, nothing recovered —
// when an item changed between the review and the confirmation; a
// confirmed one recovers every item in one go, each audited, and
// redirects.
func TestBulkRecoverRefusalsThenReviewAndConfirm(t *testing.T) {
	t.Parallel()
	s := newUncertainSite(t)
	op, csrf := consoleClient(t, s.site, s.token(t, "otto", auth.RoleOperator), s.url+"/console/uncertain")
	fin, fcsrf := consoleClient(t, s.site, s.token(t, "fiona", auth.RoleFinance), s.url+"/console/uncertain")
	get := func(c *http.Client, path string) (int, string, string) {
		t.Helper()
		resp, err := noFollow(c).Get(s.url + path)
		require.NoError(t, err)
		body := readBody(t, resp)
		return resp.StatusCode, resp.Header.Get("Location"), body
	}
	review := "/console/uncertain/review?tenant=beta&item=" + fmt.Sprint(s.items[0]) + "&item=" + fmt.Sprint(s.items[1])

	code, loc, _ := get(op, review)
	require.Equal(t, http.StatusSeeOther, code)
	require.Equal(t, "/console/uncertain?notice=choose_outcome&tenant=beta", loc, "no outcome chosen")
	code, loc, _ = get(op, "/console/uncertain/review?to=pending")
	require.Equal(t, http.StatusSeeOther, code)
	require.Equal(t, "/console/uncertain?notice=choose_items", loc, "no item ticked")
	code, _, _ = get(fin, review+"&to=pending")
	require.Equal(t, http.StatusForbidden, code, "finance recovers nothing")
	resp, err := fin.PostForm(s.url+"/console/uncertain/recover", url.Values{"csrf": {fcsrf}, "to": {"pending"},
		"item": {fmt.Sprintf("%d:1", s.items[0])}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode)
	resp, err = op.PostForm(s.url+"/console/uncertain/recover", url.Values{"to": {"pending"}, "item": {fmt.Sprintf("%d:1", s.items[0])}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode, "no CSRF token")

	// The review: every uncertain item of beta, with counts; it changes
	// nothing.
	code, _, body := get(op, "/console/uncertain/review?all=1&tenant=beta&to=pending&reason=no+event+in+Stripe")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "3 items will be recovered as: Stripe does not have it: send it again")
	require.Contains(t, body, "“no event in Stripe”")
	form := url.Values{"csrf": {csrf}, "to": {"pending"}, "reason": {"no event in Stripe"}, "tenant": {"beta"}}
	for _, m := range regexp.MustCompile(`name="item" value="(\d+:\d+)"`).FindAllStringSubmatch(body, -1) {
		form.Add("item", m[1])
	}
	require.Len(t, form["item"], 3)
	for _, id := range s.items {
		require.Equal(t, outbox.StateUncertain, s.stateOf(t, id), "reviewing changes nothing")
	}

	// Meanwhile the second item is recovered and sent again, uncertain
	// once more under a later lease.
	_, err = reconcile.Recover(s.env.Ctx, s.env.Pool, s.env.Outbox, s.items[1], reconcile.Recovery{Expect: outbox.StateUncertain,
		To: outbox.StatePending, By: "someone"})
	require.NoError(t, err)
	leases, err := s.env.Outbox.Claim(s.env.Ctx, s.env.Pool, outbox.ClaimOptions{Owner: "test", Limit: 10, Policy: outbox.BestEffort})
	require.NoError(t, err)
	require.Len(t, leases, 1)
	require.NoError(t, s.env.Outbox.MarkUncertain(s.env.Ctx, s.env.Pool, leases[0], outbox.ErrorInfo{Code: "timeout"}, false))
	before := s.recoveries(t)

	loc = postSeeOther(t, op, s.url+"/console/uncertain/recover", form)
	require.Equal(t, fmt.Sprintf("/console/uncertain?n=%d&notice=bulk_moved&tenant=beta", s.items[1]), loc)
	for _, id := range s.items {
		require.Equal(t, outbox.StateUncertain, s.stateOf(t, id), "all or nothing")
	}
	require.Equal(t, before, s.recoveries(t))
	_, _, body = get(op, loc)
	require.Contains(t, body, fmt.Sprintf("Nothing recovered: item %d changed since you reviewed it", s.items[1]))

	// Reviewed again, confirmed: all three, one audit entry each.
	_, _, body = get(op, "/console/uncertain/review?all=1&tenant=beta&to=pending&reason=no+event+in+Stripe")
	form.Del("item")
	for _, m := range regexp.MustCompile(`name="item" value="(\d+:\d+)"`).FindAllStringSubmatch(body, -1) {
		form.Add("item", m[1])
	}
	loc = postSeeOther(t, op, s.url+"/console/uncertain/recover", form)
	require.Equal(t, "/console/uncertain?n=3&notice=bulk_recovered&tenant=beta", loc)
	for _, id := range s.items {
		require.Equal(t, outbox.StatePending, s.stateOf(t, id))
	}
	require.Equal(t, before+3, s.recoveries(t))
	var actors []string
	rows, err := s.env.Pool.Query(s.env.Ctx, `SELECT DISTINCT actor FROM audit_log WHERE action = 'recover' AND reason = 'no event in Stripe'`)
	require.NoError(t, err)
	for rows.Next() {
		var a string
		require.NoError(t, rows.Scan(&a))
		actors = append(actors, a)
	}
	require.Equal(t, []string{"console:otto"}, actors)
	_, _, body = get(op, loc)
	require.Contains(t, body, "Recovered 3 items")
}

// Every console form answers with a redirect, so a reload never sends it
// again: applying a plan, a bulk requeue of the quarantine and a refused
// mapping included.
func TestFormsRedirect(t *testing.T) {
	t.Parallel()
	s := newReconcileSite(t)
	plan := fmt.Sprintf("%s/console/reconcile/%d/plan", s.url, s.run)
	op, csrf := consoleClient(t, s.site, s.token(t, "otto", auth.RoleOperator), plan)
	loc := postSeeOther(t, op, plan, url.Values{"csrf": {csrf}, "action": {fmt.Sprintf("%d:%d", s.uncertain, s.uncertainToken)}})
	require.Equal(t, fmt.Sprintf("/console/reconcile/%d?applied=%d&refused=#results", s.run, s.uncertain), loc)
	require.Equal(t, outbox.StateAccepted, s.state(t, s.uncertain))
	resp, err := op.Get(s.url + loc)
	require.NoError(t, err)
	body := readBody(t, resp)
	require.Contains(t, body, "marked accepted")
	require.Equal(t, 1, s.recoveries(t), "reading the result applies nothing again")

	loc = postSeeOther(t, op, s.url+"/console/quarantine/requeue", url.Values{"csrf": {csrf}, "reason": {"no_customer"}, "after": {"0"}})
	require.Equal(t, "/console/quarantine?done=1&readdressed=0&reason=no_customer&refused=0&requeued=0", loc)
	resp, err = op.Get(s.url + loc + "&refused_period_closed=2&refused_made_up=7")
	require.NoError(t, err)
	body = readBody(t, resp)
	require.Contains(t, body, `<span data-testid="result-counts">0 requeued, 0 re-addressed, 0 refused</span> · period_closed: 2.`)
	require.NotContains(t, body, "made_up", "the page names only refusals it knows")

	// A refused mapping redirects too; the page says why once.
	loc = postSeeOther(t, op, s.url+"/console/mappings/tenants", url.Values{"csrf": {csrf}, "tenant": {"acme"}, "customer": {"acct_1"}})
	require.Equal(t, "/console/mappings", loc)
	resp, err = op.Get(s.url + loc)
	require.NoError(t, err)
	require.Contains(t, readBody(t, resp), `data-code="invalid_mapping"`)
	resp, err = op.Get(s.url + loc)
	require.NoError(t, err)
	require.NotContains(t, readBody(t, resp), `data-code=`, "a reload no longer says it")
}

// A settle delay as PostgreSQL writes it reads as Go's duration without
// zero tails; anything else is shown as it is.
func TestSettleWords(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{"02:00:00": "2h", "00:30:00": "30m", "01:30:00": "1h30m", "00:00:00.001": "0s",
		"00:00:05": "5s", "3 days": "3 days", "": ""} {
		require.Equal(t, want, console.SettleWords(in), in)
	}
}

// An explained discrepancy points at its plan while its items are
// uncertain; once they moved otherwise (sent again, say), the plan has
// nothing for it and finance may resolve it like any other; once they
// were recovered as accepted, it waits for the next run.
func TestAnExplainedDiscrepancyWhoseItemsMovedIsResolvable(t *testing.T) {
	t.Parallel()
	s := newReconcileSite(t)
	fin, _ := consoleClient(t, s.site, s.token(t, "fiona", auth.RoleFinance), s.url+"/console/discrepancies")
	form := fmt.Sprintf(`action="/console/reconcile/discrepancies/%d/resolve"`, s.explainedDiscrepancy)
	pages := []string{"/console/discrepancies", "/console/reconcile", fmt.Sprintf("/console/reconcile/%d", s.run)}
	page := func(path string) string {
		t.Helper()
		resp, err := fin.Get(s.url + path)
		require.NoError(t, err)
		return readBody(t, resp)
	}
	recover := func(to outbox.State) {
		t.Helper()
		_, err := reconcile.Recover(s.env.Ctx, s.env.Pool, s.env.Outbox, s.uncertain, reconcile.Recovery{Expect: outbox.StateUncertain,
			To: to, By: "someone"})
		require.NoError(t, err)
	}
	for _, p := range pages {
		body := page(p)
		require.NotContains(t, body, form, p)
		require.Contains(t, body, `data-testid="plan-link"`, p)
	}

	recover(outbox.StatePending)
	for _, p := range pages {
		body := page(p)
		require.Contains(t, body, form, p)
		require.Contains(t, body, "Its explaining items are no longer uncertain", p)
	}

	// Sent again with no answer, then recovered as accepted.
	leases, err := s.env.Outbox.Claim(s.env.Ctx, s.env.Pool, outbox.ClaimOptions{Owner: "test", Limit: 10, Policy: outbox.BestEffort})
	require.NoError(t, err)
	require.Len(t, leases, 1)
	require.NoError(t, s.env.Outbox.MarkUncertain(s.env.Ctx, s.env.Pool, leases[0], outbox.ErrorInfo{Code: "timeout"}, false))
	recover(outbox.StateAccepted)
	for _, p := range pages {
		body := page(p)
		require.NotContains(t, body, form, p)
		require.Contains(t, body, "the next run confirms the hour and clears it", p)
	}
}
