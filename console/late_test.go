package console_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// An operator meets late usage: the quarantine page lists it as
// period_closed with a tick box; requeued without the tick it is refused
// and the page says why, with it it is sent; the completeness page shows
// it in its own column throughout.
func TestOperatorRequeuesLateUsageOnlyKnowingly(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	s.env.Target.LateUsage, s.env.Target.InvoiceGrace = meter.LateQuarantine, time.Hour
	s.env.Feature(t, "calls", mappings.Count, time.Hour)
	anchor := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour).Add(30 * time.Minute)
	_, _, err := s.env.Maps.PutTenant(s.env.Ctx, s.env.Pool, "late", mappings.TenantInput{StripeCustomerID: "cus_late", PeriodAnchor: &anchor}, "test")
	require.NoError(t, err)
	closed := anchor.Add(-20 * time.Minute)
	s.env.MustIngest(t, stagetest.Ev("l1", "late", "calls", 1, &closed))
	var id int64
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT id FROM outbox_items WHERE quarantine_reason = 'period_closed'`).Scan(&id))

	ctx, consoleErrors := browse(t)
	require.NoError(t, chromedp.Do(ctx, signIn(s.token(t, "otto", auth.RoleOperator), s.url)))
	month := meter.PeriodStart(closed, anchor).Format("2006-01")
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/completeness?tenant=late&refresh=1&period="+month),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=period-closed]`))))
	require.Equal(t, "1", text(t, ctx, `[data-testid=period-closed]`))

	row := fmt.Sprintf(`[data-testid=item-%d]`, id)
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/quarantine?reason=period_closed"),
		chromedp.WaitVisible(chromedp.CSS(row))))
	require.Contains(t, text(t, ctx, row), "period_closed")
	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(fmt.Sprintf(`[data-testid=requeue-%d]`, id))),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=flash]`))))
	require.Contains(t, text(t, ctx, `[data-testid=flash]`), "invoice has closed")
	it, err := s.env.Outbox.Get(s.env.Ctx, s.env.Pool, id)
	require.NoError(t, err)
	require.Equal(t, outbox.StateQuarantined, it.State, "refused without the tick")

	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/quarantine?reason=period_closed"),
		chromedp.WaitVisible(chromedp.CSS(row)),
		chromedp.Click(chromedp.CSS(fmt.Sprintf(`[data-testid=accept-period-closed-%d]`, id))),
		chromedp.Click(chromedp.CSS(fmt.Sprintf(`[data-testid=requeue-%d]`, id))),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=flash]`))))
	require.Contains(t, text(t, ctx, `[data-testid=flash]`), "Requeued")
	screenshot(t, ctx, "operator-requeue-late-usage")
	it, err = s.env.Outbox.Get(s.env.Ctx, s.env.Pool, id)
	require.NoError(t, err)
	require.Equal(t, outbox.StatePending, it.State)
	require.Empty(t, consoleErrors())
}
