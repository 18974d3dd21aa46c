package console_test

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
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

// reconcileSite is a console with a succeeded reconcile run that found two
// discrepancies: one explained by an uncertain item that landed (its plan
// recovers it to accepted), one of an accepted item Stripe has nothing of.
type reconcileSite struct {
	*site
	run                           int64
	uncertain, accepted           int64
	explainedDiscrepancy, dropped int64
	uncertainToken                int64
}

func newReconcileSite(t *testing.T) *reconcileSite {
	t.Helper()
	env := stagetest.New(t, outbox.Config{})
	env.Feature(t, "api", mappings.Sum, time.Hour)
	_, _, err := env.Maps.PutTenant(env.Ctx, env.Pool, "beta", mappings.TenantInput{StripeCustomerID: "cus_beta"}, "test")
	require.NoError(t, err)
	env.MustIngest(t, stagetest.Ev("b1", "beta", "api", 4, stagetest.Ago(3*time.Hour)),
		stagetest.Ev("b2", "beta", "api", 6, stagetest.Ago(5*time.Hour)))
	env.Pass(t)
	leases, err := env.Outbox.Claim(env.Ctx, env.Pool, outbox.ClaimOptions{Owner: "test", Limit: 10, Policy: outbox.BestEffort})
	require.NoError(t, err)
	require.Len(t, leases, 2)
	_, err = env.Outbox.Record(env.Ctx, env.Pool, []outbox.Outcome{
		{Lease: leases[0], Kind: outbox.Uncertain, Error: outbox.ErrorInfo{Code: "timeout"}},
		{Lease: leases[1], Kind: outbox.Accepted}})
	require.NoError(t, err)
	con, err := console.New(console.Deps{Pool: env.Pool, Outbox: env.Outbox, Mappings: env.Maps,
		Requeuer: &quarantine.Requeuer{Outbox: env.Outbox, Stager: env.Stager}, Settle: 2 * time.Hour,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	require.NoError(t, err)
	srv := httptest.NewServer(api.New(api.Options{Console: con.Handler(), Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)
	s := &reconcileSite{site: &site{env: env, url: srv.URL}, uncertain: leases[0].ID, accepted: leases[1].ID,
		uncertainToken: leases[0].LeaseToken}

	s.run, err = reconcile.Queue(env.Ctx, env.Pool, reconcile.TriggerAPI, "token:otto", reconcile.Options{Settle: time.Hour})
	require.NoError(t, err)
	_, err = env.Pool.Exec(env.Ctx, `UPDATE reconcile_runs SET status = 'succeeded', started_at = clock_timestamp(),
		heartbeat_at = clock_timestamp(), finished_at = clock_timestamp() WHERE id = $1`, s.run)
	require.NoError(t, err)
	hour := time.Now().UTC().Truncate(time.Hour)
	require.NoError(t, env.Pool.QueryRow(env.Ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode,
			event_name, meter, customer, hour, formula, expected, provider, difference, expected_items, uncertain_items,
			explained_by, explanation)
		VALUES ($1, 'acct_1', 'test', 'api', 'mtr_1', 'cus_beta', $2, 'sum', 0, 4, 4, '{}', ARRAY[$3::bigint], ARRAY[$3::bigint],
			'explained') RETURNING id`, s.run, hour.Add(-3*time.Hour), s.uncertain).Scan(&s.explainedDiscrepancy))
	require.NoError(t, env.Pool.QueryRow(env.Ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode,
			event_name, meter, customer, hour, formula, expected, provider, difference, expected_items, uncertain_items,
			explained_by, explanation)
		VALUES ($1, 'acct_1', 'test', 'api', 'mtr_1', 'cus_beta', $2, 'sum', 6, 0, -6, ARRAY[$3::bigint], '{}', '{}',
			'unexplained') RETURNING id`, s.run, hour.Add(-5*time.Hour), s.accepted).Scan(&s.dropped))
	return s
}

func (s *reconcileSite) state(t *testing.T, id int64) outbox.State {
	t.Helper()
	it, err := s.env.Outbox.Get(s.env.Ctx, s.env.Pool, id)
	require.NoError(t, err)
	return it.State
}

// An operator opens a run's page, reviews its recovery plan, confirms it
// and sees each action's result: the uncertain item is accepted, audited
// under the operator's name. Finance then resolves the other discrepancy
// with a reason and a note and sees it resolved (who, when, why), its item
// confirmed.
func TestOperatorAppliesAPlanAndFinanceResolvesFromTheConsole(t *testing.T) {
	t.Parallel()
	s := newReconcileSite(t)
	ctx, consoleErrors := browse(t)
	runPage := fmt.Sprintf("%s/console/reconcile/%d", s.url, s.run)

	require.NoError(t, chromedp.Do(ctx, signIn(s.token(t, "otto", auth.RoleOperator), s.url),
		chromedp.Navigate(runPage), chromedp.WaitVisible(chromedp.CSS(`[data-testid=review-plan]`))))
	require.Contains(t, text(t, ctx, fmt.Sprintf(`#discrepancy-%d`, s.dropped)), "beta", "the discrepancy names its tenant")
	screenshot(t, ctx, "operator-reconcile-plan")
	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(`[data-testid=review-plan]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=apply-plan]`))))
	review := text(t, ctx, `[data-testid=plan-review]`)
	require.Contains(t, review, fmt.Sprint(s.uncertain))
	require.Contains(t, review, "accepted")
	require.Equal(t, outbox.StateUncertain, s.state(t, s.uncertain), "reviewing changes nothing")
	screenshot(t, ctx, "operator-reconcile-plan-review")

	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(`[data-testid=apply-plan]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=plan-results]`))))
	require.Equal(t, 1, count(t, ctx, `[data-testid=plan-results] tr[data-applied=true]`))
	require.Contains(t, text(t, ctx, `[data-testid=plan-results]`), "marked accepted")
	screenshot(t, ctx, "operator-reconcile-plan-applied")
	require.Equal(t, outbox.StateAccepted, s.state(t, s.uncertain))
	var by string
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT actor FROM audit_log WHERE action = 'recover' AND subject = $1`,
		fmt.Sprintf("item:%d", s.uncertain)).Scan(&by))
	require.Equal(t, "console:otto", by)

	require.Empty(t, consoleErrors())

	// Finance, in a browser of its own, resolves the dropped event's
	// discrepancy.
	fin, finErrors := browse(t)
	row := fmt.Sprintf(`#discrepancy-%d`, s.dropped)
	require.NoError(t, chromedp.Do(fin, signIn(s.token(t, "fiona", auth.RoleFinance), s.url),
		chromedp.Navigate(runPage), chromedp.WaitVisible(chromedp.CSS(row+` select[name=reason]`)),
		chromedp.SetValue(chromedp.CSS(row+` select[name=reason]`), "accept_stripe"),
		chromedp.SendKeys(chromedp.CSS(row+` input[name=note]`), "agreed with the customer: ticket 4411"),
		chromedp.Submit(chromedp.CSS(row+` input[name=note]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=notice]`))))
	require.Contains(t, text(t, fin, `[data-testid=notice]`), "Resolved")
	cell := text(t, fin, row+` [data-testid=resolution]`)
	require.Contains(t, cell, "accept_stripe by console:fiona at ")
	require.Contains(t, cell, "agreed with the customer: ticket 4411")
	require.Zero(t, count(t, fin, `[data-testid=review-plan]`), "finance applies no plan")
	screenshot(t, fin, "finance-reconcile-resolved")
	require.Equal(t, outbox.StateConfirmed, s.state(t, s.accepted))
	require.Empty(t, finErrors())
}

// A plan applied after its item moved (claimed again under a later lease)
// refuses that action and changes nothing; finance may not apply a plan;
// a resolution without a reason is refused with a notice.
func TestConsoleRefusesAStalePlanAndABadResolution(t *testing.T) {
	t.Parallel()
	s := newReconcileSite(t)
	plan := fmt.Sprintf("%s/console/reconcile/%d/plan", s.url, s.run)
	op, csrf := consoleClient(t, s.site, s.token(t, "otto", auth.RoleOperator), plan)

	// Reviewed at token N, applied as if reviewed at N-1: the item moved.
	resp, err := op.PostForm(plan, url.Values{"csrf": {csrf}, "action": {fmt.Sprintf("%d:%d", s.uncertain, s.uncertainToken-1)}})
	require.NoError(t, err)
	body := readBody(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, body)
	require.Contains(t, body, `data-applied="false"`)
	require.Contains(t, body, "changed since you reviewed the plan")
	require.Equal(t, outbox.StateUncertain, s.state(t, s.uncertain))
	resp, err = op.PostForm(plan, url.Values{"csrf": {csrf}, "action": {"x"}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)

	fin, fcsrf := consoleClient(t, s.site, s.token(t, "fiona", auth.RoleFinance), fmt.Sprintf("%s/console/reconcile/%d", s.url, s.run))
	resp, err = fin.PostForm(plan, url.Values{"csrf": {fcsrf}, "action": {fmt.Sprintf("%d:%d", s.uncertain, s.uncertainToken)}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode)
	require.Equal(t, outbox.StateUncertain, s.state(t, s.uncertain))

	resolve := fmt.Sprintf("%s/console/reconcile/discrepancies/%d/resolve", s.url, s.dropped)
	resp, err = fin.PostForm(resolve, url.Values{"csrf": {fcsrf}, "run": {fmt.Sprint(s.run)}, "reason": {""}, "note": {"n"}})
	require.NoError(t, err)
	body = readBody(t, resp)
	require.Contains(t, body, "Not resolved: choose a reason")
	require.Equal(t, outbox.StateAccepted, s.state(t, s.accepted))
}

// consoleClient signs in with token and reads the CSRF token of page.
func consoleClient(t *testing.T, s *site, token, page string) (*http.Client, string) {
	t.Helper()
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar}
	resp, err := postSignIn(c, s.url, token)
	require.NoError(t, err)
	resp.Body.Close()
	resp, err = c.Get(page)
	require.NoError(t, err)
	body := readBody(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, body)
	m := csrfPattern.FindStringSubmatch(body)
	require.NotNil(t, m, body)
	return c, m[1]
}

func readBody(t *testing.T, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return strings.TrimSpace(string(b))
}
