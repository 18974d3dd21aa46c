package console_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// Finance opens the open discrepancies of every run: the newest first,
// each with its tenant, feature, period and numbers in words; the
// explained one points at its run's plan, offering no Resolve; a tenant
// filter keeps that tenant's. Finance resolves the other one from this
// page and comes back to it. An operator sees the run's page, its plan
// in words, and its review; a fresh run that confirmed nothing says why.
func TestOpenDiscrepanciesPageAndPlainPlan(t *testing.T) {
	t.Parallel()
	s := newReconcileSite(t)
	fin, finErrors := browse(t)
	open := s.url + "/console/discrepancies"
	explained, dropped := fmt.Sprintf(`#discrepancy-%d`, s.explainedDiscrepancy), fmt.Sprintf(`#discrepancy-%d`, s.dropped)

	require.NoError(t, chromedp.Do(fin, signIn(s.token(t, "fiona", auth.RoleFinance), s.url),
		chromedp.Navigate(open), chromedp.WaitVisible(chromedp.CSS(`[data-testid=open-discrepancies]`))))
	require.Equal(t, 2, count(t, fin, `[data-testid=open-discrepancies] tr[id^=discrepancy-]`))
	require.Equal(t, 1, count(t, fin, `header a[href="/console/discrepancies"]`), "in the nav")
	row := text(t, fin, dropped)
	require.Contains(t, row, "beta")
	require.Contains(t, row, time.Now().UTC().Add(-5*time.Hour).Format("2006-01"))
	require.Contains(t, row, "Tally has a total of 6, Stripe 0: Stripe has 6 less, usage not billed.")
	require.Contains(t, text(t, fin, explained), "Explained")
	require.Zero(t, count(t, fin, explained+` form`), "an explained one offers no Resolve")
	require.Equal(t, 1, count(t, fin, explained+fmt.Sprintf(` a[href="/console/reconcile/%d#plan"]`, s.run)))
	screenshot(t, fin, "finance-discrepancies")

	require.NoError(t, chromedp.Do(fin, chromedp.Navigate(open+"?tenant=nobody"), chromedp.WaitVisible(chromedp.CSS(`[data-testid=open-discrepancies]`))))
	require.Contains(t, text(t, fin, `[data-testid=open-discrepancies]`), "No open discrepancy of tenant nobody.")
	require.NoError(t, chromedp.Do(fin, chromedp.Navigate(open+"?kind=stripe_has_more"), chromedp.WaitVisible(chromedp.CSS(`[data-testid=open-discrepancies]`))))
	require.Equal(t, 1, count(t, fin, `[data-testid=open-discrepancies] tr[id^=discrepancy-]`))
	require.Equal(t, 1, count(t, fin, explained))

	require.NoError(t, chromedp.Do(fin, chromedp.Navigate(open+"?tenant=beta"), chromedp.WaitVisible(chromedp.CSS(dropped+` select[name=reason]`)),
		chromedp.SetValue(chromedp.CSS(dropped+` select[name=reason]`), "accept_stripe"),
		chromedp.SendKeys(chromedp.CSS(dropped+` input[name=note]`), "agreed with the customer: ticket 4411"),
		chromedp.Submit(chromedp.CSS(dropped+` input[name=note]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=notice]`))))
	require.Contains(t, text(t, fin, `[data-testid=notice]`), "Resolved")
	loc, err := chromedp.Run(fin, chromedp.Location())
	require.NoError(t, err)
	require.Contains(t, loc, "/console/discrepancies?notice=resolved&tenant=beta", "back to the page it came from")
	require.Equal(t, 1, count(t, fin, `[data-testid=open-discrepancies] tr[id^=discrepancy-]`), "no longer open")
	screenshot(t, fin, "finance-discrepancies-resolved")
	require.Equal(t, outbox.StateConfirmed, s.state(t, s.accepted))
	require.Empty(t, finErrors())

	op, opErrors := browse(t)
	require.NoError(t, chromedp.Do(op, signIn(s.token(t, "otto", auth.RoleOperator), s.url),
		chromedp.Navigate(open), chromedp.WaitVisible(chromedp.CSS(explained+` [data-testid=plan-link]`))))
	screenshot(t, op, "operator-discrepancies")
	require.NoError(t, chromedp.Do(op, chromedp.Navigate(fmt.Sprintf("%s/console/reconcile/%d", s.url, s.run)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=plan]`))))
	plan := text(t, op, `[data-testid=plan]`)
	require.Contains(t, plan, "no answer came back")
	require.Contains(t, plan, "Marks it accepted")
	require.NotRegexp(t, `\bT\d+\b|[Ll]ease`, text(t, op, `main`), "no state-machine words")
	screenshot(t, op, "operator-reconcile-run-plan")
	require.NoError(t, chromedp.Do(op, chromedp.Click(chromedp.CSS(`[data-testid=review-plan]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=apply-plan]`))))
	require.Contains(t, text(t, op, `[data-testid=plan-summary]`), "Applying marks 1 item accepted")
	require.NotRegexp(t, `\bT\d+\b|[Ll]ease`, text(t, op, `main`))
	screenshot(t, op, "operator-reconcile-plan-review-plain")

	// A fresh run, which confirmed nothing: its page says it is the settle
	// delay.
	fresh, err := reconcile.Queue(s.env.Ctx, s.env.Pool, reconcile.TriggerAPI, "token:otto", reconcile.Options{Settle: 2 * time.Hour})
	require.NoError(t, err)
	_, err = s.env.Pool.Exec(s.env.Ctx, `UPDATE reconcile_runs SET status = 'succeeded', started_at = clock_timestamp(),
		heartbeat_at = clock_timestamp(), finished_at = clock_timestamp() WHERE id = $1`, fresh)
	require.NoError(t, err)
	require.NoError(t, chromedp.Do(op, chromedp.Navigate(fmt.Sprintf("%s/console/reconcile/%d", s.url, fresh)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=settle-note]`))))
	require.Contains(t, text(t, op, `[data-testid=settle-note]`), "This run confirmed nothing. It compares only usage older than its settle delay (2h)")
	screenshot(t, op, "operator-reconcile-fresh-run")

	// The other pages whose words are this file's concern fit too.
	for _, p := range []string{"/console/reconcile", "/console/quarantine", "/console/quarantine?confirm=requeue", "/console/mappings",
		fmt.Sprintf("/console/items/%d", s.accepted)} {
		require.NoError(t, chromedp.Do(op, chromedp.Navigate(s.url+p), chromedp.WaitVisible(chromedp.CSS(`main h1`))))
		fits(t, op, p)
	}
	require.Empty(t, opErrors())
}

// The operator opens an uncertain item, whose page says what happened and
// chooses nothing; then ticks two items of the list, chooses what
// happened, reviews the counts and confirms: both recovered, the list
// saying so.
func TestBulkRecoverInTheBrowser(t *testing.T) {
	t.Parallel()
	s := newUncertainSite(t)
	ctx, consoleErrors := browse(t)
	require.NoError(t, chromedp.Do(ctx, signIn(s.token(t, "otto", auth.RoleOperator), s.url),
		chromedp.Navigate(fmt.Sprintf("%s/console/items/%d", s.url, s.items[0])),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=recover-form]`))))
	require.Contains(t, text(t, ctx, `[data-testid=state-words]`), "no answer came back")
	require.Zero(t, count(t, ctx, `[data-testid=recover-form] input[name=to]:checked`), "nothing chosen beforehand")
	screenshot(t, ctx, "operator-item-recover")

	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/uncertain"),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=bulk-form]`))))
	require.Equal(t, "", func() string {
		v, err := chromedp.Run(ctx, chromedp.Value(chromedp.CSS(`[data-testid=bulk-to]`)))
		require.NoError(t, err)
		return v
	}(), "no outcome chosen beforehand")
	screenshot(t, ctx, "operator-uncertain-bulk")
	require.NoError(t, chromedp.Do(ctx,
		chromedp.Click(chromedp.CSS(fmt.Sprintf(`[data-testid=tick-%d]`, s.items[0]))),
		chromedp.Click(chromedp.CSS(fmt.Sprintf(`[data-testid=tick-%d]`, s.items[2]))),
		chromedp.SetValue(chromedp.CSS(`[data-testid=bulk-to]`), "accepted"),
		chromedp.SendKeys(chromedp.CSS(`[data-testid=bulk-reason]`), "Stripe's dashboard shows them"),
		chromedp.Click(chromedp.CSS(`[data-testid=review-ticked]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=confirm-recover]`))))
	require.Contains(t, text(t, ctx, `[data-testid=review-counts]`), "2 items will be recovered as: Stripe has it")
	require.Equal(t, outbox.StateUncertain, s.stateOf(t, s.items[0]), "the review changes nothing")
	screenshot(t, ctx, "operator-uncertain-review")
	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(`[data-testid=confirm-recover]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=notice]`))))
	require.Contains(t, text(t, ctx, `[data-testid=notice]`), "Recovered 2 items")
	screenshot(t, ctx, "operator-uncertain-recovered")
	require.Equal(t, outbox.StateAccepted, s.stateOf(t, s.items[0]))
	require.Equal(t, outbox.StateUncertain, s.stateOf(t, s.items[1]))
	require.Equal(t, outbox.StateAccepted, s.stateOf(t, s.items[2]))
	require.Empty(t, consoleErrors())
}
