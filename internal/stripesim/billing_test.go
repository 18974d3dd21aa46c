package stripesim_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

// Monthly periods run from the billing cycle anchor, on its day of month,
// clamped to the last day of shorter months and back: "A monthly
// subscription with a billing cycle anchor date of January 31 bills the
// last day of the month closest to the anchor date, so February 28 (or
// February 29 in a leap year), then March 31, April 30, and so on"
// (docs.stripe.com/billing/subscriptions/billing-cycle). A future anchor
// ends a first, shorter period that started at creation. Each ended period
// makes a draft invoice, billing_reason subscription_cycle, one line per
// metered item with the period's usage, its subscription under
// parent.subscription_details and finalizing an hour later
// (configure-grace-period); the items move to the next period.
func TestBillingCyclesFromAMidMonthAnchorAndThe31st(t *testing.T) {
	t.Parallel()
	created := day(2026, 1, 20, 10, 0)
	sim, ts, clk := newBillingSim(t, created)
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	price := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "3"})
	sim.CreateCustomer(acct, "cus_31st")
	sim.CreateCustomer(acct, "cus_15th")
	sc, ctx := client(ts, testKey), context.Background()

	on31st := subscribe(t, sc, "cus_31st", day(2026, 1, 31, 12, 0), zeroTime, price)
	on15th := subscribe(t, sc, "cus_15th", day(2026, 2, 15, 9, 30), zeroTime, price)
	assert.Equal(t, unix(day(2026, 1, 31, 12, 0)), on31st.BillingCycleAnchor)
	assert.Equal(t, unix(created), on31st.Items.Data[0].CurrentPeriodStart)
	assert.Equal(t, unix(day(2026, 1, 31, 12, 0)), on31st.Items.Data[0].CurrentPeriodEnd, "a first, shorter period up to the anchor")

	// Usage in each period: 2 then 5 then 7 for the 31st; 4 then 6 for
	// the 15th. An event exactly at a period's end belongs to the next.
	clk.Set(day(2026, 1, 25, 0, 0))
	usage(t, sc, "", "api_calls", "cus_31st", 2, clk.Now())
	usage(t, sc, "", "api_calls", "cus_15th", 4, clk.Now())
	clk.Set(day(2026, 2, 10, 0, 0))
	usage(t, sc, "", "api_calls", "cus_31st", 5, clk.Now())
	clk.Set(day(2026, 2, 20, 0, 0))
	usage(t, sc, "", "api_calls", "cus_15th", 6, clk.Now())
	clk.Set(day(2026, 2, 28, 12, 0))
	usage(t, sc, "", "api_calls", "cus_31st", 7, clk.Now())

	clk.Set(day(2026, 4, 1, 0, 0))
	type cycle struct {
		start, end time.Time
		qty        int64
	}
	for _, c := range []struct {
		sub    *stripe.Subscription
		cycles []cycle
		next   cycle
	}{
		{on31st, []cycle{
			{created, day(2026, 1, 31, 12, 0), 2},
			{day(2026, 1, 31, 12, 0), day(2026, 2, 28, 12, 0), 5}, // the 31st clamped to February 28
			{day(2026, 2, 28, 12, 0), day(2026, 3, 31, 12, 0), 7}, // and back to the 31st
		}, cycle{day(2026, 3, 31, 12, 0), day(2026, 4, 30, 12, 0), 0}},
		{on15th, []cycle{
			{created, day(2026, 2, 15, 9, 30), 4},
			{day(2026, 2, 15, 9, 30), day(2026, 3, 15, 9, 30), 6},
		}, cycle{day(2026, 3, 15, 9, 30), day(2026, 4, 15, 9, 30), 0}},
	} {
		invs := invoicesOf(t, sc, c.sub.ID)
		require.Len(t, invs, len(c.cycles), c.sub.ID)
		for i, want := range c.cycles {
			inv := invs[len(invs)-1-i] // newest first
			assert.Equal(t, stripe.InvoiceBillingReasonSubscriptionCycle, inv.BillingReason)
			assert.Equal(t, stripe.InvoiceStatusOpen, inv.Status, "finalized an hour after it was made")
			assert.Equal(t, unix(want.end), inv.Created, "made when the period ended")
			assert.Equal(t, unix(want.end.Add(time.Hour)), inv.StatusTransitions.FinalizedAt)
			assert.Zero(t, inv.AutomaticallyFinalizesAt, "null once finalized")
			assert.Equal(t, unix(want.start), inv.PeriodStart)
			assert.Equal(t, unix(want.end), inv.PeriodEnd)
			assert.Equal(t, c.sub.ID, inv.Parent.SubscriptionDetails.Subscription.ID)
			assert.Equal(t, stripe.InvoiceParentTypeSubscriptionDetails, inv.Parent.Type)
			require.Len(t, inv.Lines.Data, 1)
			l := inv.Lines.Data[0]
			assert.Equal(t, unix(want.start), l.Period.Start)
			assert.Equal(t, unix(want.end), l.Period.End)
			assert.Equal(t, want.qty, l.Quantity)
			assert.Equal(t, 3*want.qty, l.Amount, "3 per unit")
			assert.Equal(t, 3*want.qty, inv.Total)
			assert.Equal(t, 3*want.qty, inv.AmountDue)
			assert.Equal(t, price, l.Pricing.PriceDetails.Price)
			assert.Equal(t, c.sub.Items.Data[0].ID, l.Parent.SubscriptionItemDetails.SubscriptionItem)
		}
		got, err := sc.V1Subscriptions.Retrieve(ctx, c.sub.ID, nil)
		require.NoError(t, err)
		assert.Equal(t, unix(c.next.start), got.Items.Data[0].CurrentPeriodStart)
		assert.Equal(t, unix(c.next.end), got.Items.Data[0].CurrentPeriodEnd)
		assert.Equal(t, invs[0].ID, got.LatestInvoice.ID)
	}
}

// Usage reported during the grace period for the ended period is on the
// invoice: the draft keeps its quantity until it finalizes, and "During
// finalization, Stripe updates the invoice to reflect the latest quantity
// for its billing period" (configure-grace-period). Usage for that period
// reported after finalization is billed by no invoice: the finalized one
// does not change (meters/configure, "If you cancel usage that's included
// on a finalized invoice, we won't update the invoice") and the next one
// bills its own period only.
func TestUsageInTheGracePeriodIsBilledAndAfterFinalizationIsNot(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newBillingSim(t, day(2026, 3, 1, 0, 0))
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	price := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "1"})
	sim.CreateCustomer(acct, "cus_acme")
	sc, ctx := client(ts, testKey), context.Background()
	sub := subscribe(t, sc, "cus_acme", zeroTime, zeroTime, price)

	clk.Set(day(2026, 3, 5, 0, 0))
	usage(t, sc, "", "api_calls", "cus_acme", 10, clk.Now())
	clk.Set(day(2026, 4, 1, 0, 0).Add(30 * time.Second))
	usage(t, sc, "", "api_calls", "cus_acme", 7, day(2026, 3, 31, 23, 59)) // in the grace period
	invs := invoicesOf(t, sc, sub.ID)
	require.Len(t, invs, 1)
	draft := invs[0]
	assert.Equal(t, stripe.InvoiceStatusDraft, draft.Status)
	assert.True(t, draft.AutoAdvance)
	assert.Equal(t, unix(day(2026, 4, 1, 1, 0)), draft.AutomaticallyFinalizesAt, "created plus the hour of grace")
	assert.EqualValues(t, 10, draft.Lines.Data[0].Quantity, "a draft shows what was recorded when it was made")
	assert.Empty(t, draft.Number)

	clk.Set(day(2026, 4, 1, 1, 0).Add(time.Second))
	// This request finalizes the invoice before it records its event.
	usage(t, sc, "", "api_calls", "cus_acme", 100, day(2026, 3, 31, 23, 59))
	clk.Set(day(2026, 4, 2, 0, 0))
	usage(t, sc, "", "api_calls", "cus_acme", 4, clk.Now())
	fin, err := sc.V1Invoices.Retrieve(ctx, draft.ID, nil)
	require.NoError(t, err)
	assert.Equal(t, stripe.InvoiceStatusOpen, fin.Status)
	assert.Equal(t, unix(day(2026, 4, 1, 1, 0)), fin.StatusTransitions.FinalizedAt)
	assert.EqualValues(t, 17, fin.Lines.Data[0].Quantity, "the grace-period usage, not the later")
	assert.EqualValues(t, 17, fin.Total)
	assert.Regexp(t, `^[0-9A-Z]+-0001$`, fin.Number)

	clk.Set(day(2026, 5, 1, 1, 0).Add(time.Second))
	invs = invoicesOf(t, sc, sub.ID)
	require.Len(t, invs, 2)
	assert.EqualValues(t, 4, invs[0].Lines.Data[0].Quantity, "April's usage only: the 100 is on no invoice")
	assert.Regexp(t, `-0002$`, invs[0].Number)
	var billed int64
	for _, inv := range sim.Invoices(acct) {
		billed += inv.Lines[0].Quantity
	}
	assert.EqualValues(t, 21, billed)
}

// Usage before a subscription's start is billed by no invoice, unless the
// subscription is backdated to before it: backdating lets "you ... backdate
// a subscription to include usage in the next invoice"
// (docs.stripe.com/billing/subscriptions/usage-based/manage-billing-setup).
func TestUsageBeforeTheStartIsBilledOnlyWhenBackdated(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newBillingSim(t, day(2026, 3, 2, 0, 0))
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	price := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "1"})
	sim.CreateCustomer(acct, "cus_plain")
	sim.CreateCustomer(acct, "cus_back")
	sc := client(ts, testKey)
	usage(t, sc, "", "api_calls", "cus_plain", 50, clk.Now())
	usage(t, sc, "", "api_calls", "cus_back", 50, clk.Now())

	clk.Set(day(2026, 3, 10, 12, 0))
	plain := subscribe(t, sc, "cus_plain", zeroTime, zeroTime, price)
	back := subscribe(t, sc, "cus_back", zeroTime, day(2026, 3, 1, 0, 0), price)
	clk.Set(day(2026, 3, 11, 0, 0))
	usage(t, sc, "", "api_calls", "cus_plain", 1, clk.Now())
	usage(t, sc, "", "api_calls", "cus_back", 1, clk.Now())

	clk.Set(day(2026, 4, 10, 12, 0))
	sim.AdvanceBilling()
	p, b := invoicesOf(t, sc, plain.ID), invoicesOf(t, sc, back.ID)
	require.Len(t, p, 1)
	require.Len(t, b, 1)
	assert.EqualValues(t, 1, p[0].Lines.Data[0].Quantity, "the 50 before the start is on no invoice")
	assert.EqualValues(t, 51, b[0].Lines.Data[0].Quantity)
	assert.Equal(t, unix(day(2026, 3, 1, 0, 0)), b[0].Lines.Data[0].Period.Start)
	assert.Equal(t, stripe.InvoiceStatusDraft, p[0].Status, "still in its grace period")
}

// auto_advance=false holds a draft past its automatic finalization ("To
// turn off automatic finalization, set auto_advance to false", stripe-go
// InvoiceUpdateParams) and automatically_finalizes_at is then null ("null
// if the invoice is not scheduled to finalize"); true again puts it back on
// its schedule, which has passed, so it finalizes at the next processing.
// POST /finalize finalizes a draft at once, from the usage recorded until
// then, and refuses a finalized one with Stripe's message.
func TestAutoAdvanceHoldsAndReleasesADraft(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newBillingSim(t, day(2026, 3, 1, 0, 0))
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	price := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "1"})
	sim.CreateCustomer(acct, "cus_hold")
	sim.CreateCustomer(acct, "cus_now")
	sc, ctx := client(ts, testKey), context.Background()
	hold := subscribe(t, sc, "cus_hold", zeroTime, zeroTime, price)
	now := subscribe(t, sc, "cus_now", zeroTime, zeroTime, price)

	clk.Set(day(2026, 4, 1, 0, 10))
	held, manual := invoicesOf(t, sc, hold.ID)[0], invoicesOf(t, sc, now.ID)[0]
	_, err := sc.V1Invoices.Update(ctx, "in_nope", &stripe.InvoiceUpdateParams{AutoAdvance: stripe.Bool(false)})
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode)
	upd, err := sc.V1Invoices.Update(ctx, held.ID, &stripe.InvoiceUpdateParams{AutoAdvance: stripe.Bool(false)})
	require.NoError(t, err)
	assert.False(t, upd.AutoAdvance)
	assert.Zero(t, upd.AutomaticallyFinalizesAt, "not scheduled to finalize")

	usage(t, sc, "", "api_calls", "cus_now", 9, day(2026, 3, 31, 0, 0))
	fin, err := sc.V1Invoices.FinalizeInvoice(ctx, manual.ID, nil)
	require.NoError(t, err)
	assert.Equal(t, stripe.InvoiceStatusOpen, fin.Status)
	assert.Equal(t, unix(day(2026, 4, 1, 0, 10)), fin.StatusTransitions.FinalizedAt)
	assert.EqualValues(t, 9, fin.Lines.Data[0].Quantity, "recomputed when finalized")
	_, err = sc.V1Invoices.FinalizeInvoice(ctx, manual.ID, nil)
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusBadRequest, se.HTTPStatusCode)
	assert.Equal(t, "This invoice is already finalized, you can't re-finalize a non-draft invoice.", se.Msg)

	clk.Set(day(2026, 4, 3, 0, 0))
	got, err := sc.V1Invoices.Retrieve(ctx, held.ID, nil)
	require.NoError(t, err)
	assert.Equal(t, stripe.InvoiceStatusDraft, got.Status, "held two days past its hour")
	upd, err = sc.V1Invoices.Update(ctx, held.ID, &stripe.InvoiceUpdateParams{AutoAdvance: stripe.Bool(true)})
	require.NoError(t, err)
	assert.Equal(t, unix(day(2026, 4, 1, 1, 0)), upd.AutomaticallyFinalizesAt, "back on its schedule, which has passed")
	got, err = sc.V1Invoices.Retrieve(ctx, held.ID, nil)
	require.NoError(t, err)
	assert.Equal(t, stripe.InvoiceStatusOpen, got.Status, "finalized at the next request")
	assert.Equal(t, unix(day(2026, 4, 1, 1, 0)), got.StatusTransitions.FinalizedAt)

	// "You can toggle the auto_advance property on draft and open
	// invoices" (automatic-advancement-collection).
	upd, err = sc.V1Invoices.Update(ctx, held.ID, &stripe.InvoiceUpdateParams{AutoAdvance: stripe.Bool(false)})
	require.NoError(t, err)
	assert.False(t, upd.AutoAdvance)
	assert.Equal(t, stripe.InvoiceStatusOpen, upd.Status)
}

// What each price bills for a period's usage, by the simulator's own
// evaluator, every amount worked out by hand from Stripe's pages.
func TestInvoiceAmounts(t *testing.T) {
	t.Parallel()
	stripeTiers := []stripesim.TierSpec{ // tiered pricing's example tiers, stripe.com/docs/billing/subscriptions/tiers
		{UpTo: 5, UnitAmountDecimal: "500"}, {UpTo: 10, UnitAmountDecimal: "400"}, {UpTo: 15, UnitAmountDecimal: "300"},
		{UpTo: 20, UnitAmountDecimal: "200"}, {UnitAmountDecimal: "100"},
	}
	baseFee := []stripesim.TierSpec{{UpTo: 1000, FlatAmountDecimal: "2000", UnitAmountDecimal: "0"}, {UnitAmountDecimal: "1"}}
	for _, c := range []struct {
		name    string
		formula string
		price   stripesim.PriceSpec
		usages  []int64
		qty     int64
		amount  int64
	}{
		// 3 + 4 = 7 units × 25 = 175.
		{name: "per unit", price: stripesim.PriceSpec{UnitAmountDecimal: "25"}, usages: []int64{3, 4}, qty: 7, amount: 175},
		// 30 × 0.05 = 1.5, "which is then rounded up to 2 cents"
		// (decimal-amounts, "Rounding").
		{name: "decimal, Stripe's example", price: stripesim.PriceSpec{UnitAmountDecimal: "0.05"}, usages: []int64{30}, qty: 30, amount: 2},
		// 50 × 0.05 = 2.5: a half, rounded up (not verified: half to even
		// would give 2).
		{name: "decimal, a half", price: stripesim.PriceSpec{UnitAmountDecimal: "0.05"}, usages: []int64{50}, qty: 50, amount: 3},
		// 3 × 0.333333333333 = 0.999999999999, to the nearest: 1.
		{name: "decimal, twelve places", price: stripesim.PriceSpec{UnitAmountDecimal: "0.333333333333"}, usages: []int64{3}, qty: 3, amount: 1},
		// 150 minutes / 60, rounded up = 3 hours × 1000 = 3000: "that
		// customer is charged 30 USD for 3 hours" (transform-quantities).
		{name: "package, up", price: stripesim.PriceSpec{UnitAmountDecimal: "1000", DivideBy: 60, Round: "up"}, usages: []int64{150}, qty: 150, amount: 3000},
		// 150 / 60, rounded down = 2 × 1000.
		{name: "package, down", price: stripesim.PriceSpec{UnitAmountDecimal: "1000", DivideBy: 60, Round: "down"}, usages: []int64{150}, qty: 150, amount: 2000},
		// 5 × 500 + 1 × 400 = 2900: "the total cost for a usage of 6 is
		// $29" (tiers, graduated).
		{name: "graduated, Stripe's example", price: stripesim.PriceSpec{Tiers: stripeTiers, TiersMode: "graduated"}, usages: []int64{6}, qty: 6, amount: 2900},
		// 5×500 + 5×400 + 5×300 + 5×200 + 5×100 = 7500.
		{name: "graduated, every tier", price: stripesim.PriceSpec{Tiers: stripeTiers, TiersMode: "graduated"}, usages: []int64{25}, qty: 25, amount: 7500},
		// 6 × 400 = 2400, "6 … $24" (tiers, volume).
		{name: "volume, Stripe's example", price: stripesim.PriceSpec{Tiers: stripeTiers, TiersMode: "volume"}, usages: []int64{6}, qty: 6, amount: 2400},
		// 25 × 100 = 2500, "25 … $25".
		{name: "volume, the last tier", price: stripesim.PriceSpec{Tiers: stripeTiers, TiersMode: "volume"}, usages: []int64{25}, qty: 25, amount: 2500},
		// A base fee: 2000 flat for the first 1000, then 500 × 1 = 2500.
		{name: "graduated with a flat amount", price: stripesim.PriceSpec{Tiers: baseFee, TiersMode: "graduated"}, usages: []int64{1500}, qty: 1500, amount: 2500},
		// No usage reaches the first tier: its flat 2000 (not verified,
		// the worst plausible reading).
		{name: "graduated flat amount, no usage", price: stripesim.PriceSpec{Tiers: baseFee, TiersMode: "graduated"}, qty: 0, amount: 2000},
		// 20 falls in the second tier: 20 × 50 + 1000 flat = 2000.
		{name: "volume with flat amounts", price: stripesim.PriceSpec{TiersMode: "volume", Tiers: []stripesim.TierSpec{
			{UpTo: 10, UnitAmountDecimal: "100", FlatAmountDecimal: "500"}, {UnitAmountDecimal: "50", FlatAmountDecimal: "1000"}}},
			usages: []int64{12, 8}, qty: 20, amount: 2000},
		// 3 × 0.5 = 1.5, rounded once for the line: 2.
		{name: "graduated with a decimal tier", price: stripesim.PriceSpec{TiersMode: "graduated", Tiers: []stripesim.TierSpec{
			{UnitAmountDecimal: "0.5"}}}, usages: []int64{3}, qty: 3, amount: 2},
		// 5 - 9 = -4: "If the overall cycle usage is negative, Stripe
		// reports the invoice line item usage quantity as 0".
		{name: "negative usage", price: stripesim.PriceSpec{UnitAmountDecimal: "10"}, usages: []int64{5, -9}, qty: 0, amount: 0},
		// count: 3 events × 10 = 30, whatever their values.
		{name: "count", formula: "count", price: stripesim.PriceSpec{UnitAmountDecimal: "10"}, usages: []int64{5, -9, 3}, qty: 3, amount: 30},
		// last: the latest event's 2 × 10 = 20.
		{name: "last", formula: "last", price: stripesim.PriceSpec{UnitAmountDecimal: "10"}, usages: []int64{4, 9, 2}, qty: 2, amount: 20},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			sim, ts, clk := newBillingSim(t, day(2026, 3, 1, 0, 0))
			meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "units", Formula: c.formula})
			c.price.Meter = meter.ID
			price := sim.CreatePrice(acct, c.price)
			sim.CreateCustomer(acct, "cus_acme")
			sc := client(ts, testKey)
			sub := subscribe(t, sc, "cus_acme", zeroTime, zeroTime, price)
			for i, v := range c.usages {
				clk.Set(day(2026, 3, 2+i, 0, 0))
				usage(t, sc, "", "units", "cus_acme", v, clk.Now())
			}
			clk.Set(day(2026, 4, 1, 1, 0))
			invs := invoicesOf(t, sc, sub.ID)
			require.Len(t, invs, 1)
			inv := invs[0]
			assert.Equal(t, stripe.InvoiceStatusOpen, inv.Status)
			lines := linesOf(t, sc, inv.ID)
			require.Len(t, lines, 1)
			assert.Equal(t, c.qty, lines[0].Quantity)
			assert.Equal(t, c.amount, lines[0].Amount)
			assert.Equal(t, c.amount, inv.Total)
			assert.Equal(t, c.amount, inv.AmountDue)
			assert.Equal(t, c.amount, inv.Subtotal)
		})
	}
}

// DELETE /v1/subscriptions/{id} cancels at once. With invoice_now "a final
// invoice that invoices for any un-invoiced metered usage" bills the
// partial period; without it (the default, false) that usage is billed by
// no invoice (stripe-go SubscriptionCancelParams.InvoiceNow). Cancelling
// again answers "No such subscription" (a Stripe engineer, on stripe-go's
// tracker), and a canceled subscription "can only update its
// cancellation_details and metadata" (as Stripe's users report it). With cancel_at_period_end, "Any
// metered usage is charged for in a final invoice when the subscription
// cancels at the end of the billing period". Listing without a status
// leaves canceled subscriptions out.
func TestCancelSubscriptions(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newBillingSim(t, day(2026, 3, 1, 0, 0))
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	price := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "1"})
	for _, c := range []string{"cus_now", "cus_drop", "cus_end"} {
		sim.CreateCustomer(acct, c)
	}
	sc, ctx := client(ts, testKey), context.Background()
	invoiceNow := subscribe(t, sc, "cus_now", zeroTime, zeroTime, price)
	drop := subscribe(t, sc, "cus_drop", zeroTime, zeroTime, price)
	atEnd := subscribe(t, sc, "cus_end", zeroTime, zeroTime, price)
	clk.Set(day(2026, 3, 10, 0, 0))
	for _, c := range []string{"cus_now", "cus_drop", "cus_end"} {
		usage(t, sc, "", "api_calls", c, 8, clk.Now())
	}

	clk.Set(day(2026, 3, 15, 0, 0))
	got, err := sc.V1Subscriptions.Cancel(ctx, invoiceNow.ID, &stripe.SubscriptionCancelParams{InvoiceNow: stripe.Bool(true)})
	require.NoError(t, err)
	assert.Equal(t, stripe.SubscriptionStatusCanceled, got.Status)
	assert.Equal(t, unix(clk.Now()), got.CanceledAt)
	assert.Equal(t, unix(clk.Now()), got.EndedAt)
	assert.Equal(t, stripe.SubscriptionCancellationDetailsReasonCancellationRequested, got.CancellationDetails.Reason)
	final := invoicesOf(t, sc, invoiceNow.ID)
	require.Len(t, final, 1)
	assert.Equal(t, stripe.InvoiceBillingReasonSubscriptionUpdate, final[0].BillingReason)
	assert.EqualValues(t, 8, final[0].Lines.Data[0].Quantity)
	assert.Equal(t, unix(day(2026, 3, 1, 0, 0)), final[0].Lines.Data[0].Period.Start)
	assert.Equal(t, unix(clk.Now()), final[0].Lines.Data[0].Period.End)

	_, err = sc.V1Subscriptions.Cancel(ctx, drop.ID, nil)
	require.NoError(t, err)
	_, err = sc.V1Subscriptions.Cancel(ctx, drop.ID, nil)
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusNotFound, se.HTTPStatusCode, "cancelling twice")
	assert.Equal(t, stripe.ErrorCodeResourceMissing, se.Code)
	_, err = sc.V1Subscriptions.Update(ctx, drop.ID, &stripe.SubscriptionUpdateParams{CancelAtPeriodEnd: stripe.Bool(true)})
	se = stripeErr(t, err)
	assert.Equal(t, http.StatusBadRequest, se.HTTPStatusCode)
	assert.Equal(t, "A canceled subscription can only update its cancellation_details and metadata.", se.Msg)
	upd, err := sc.V1Subscriptions.Update(ctx, drop.ID, &stripe.SubscriptionUpdateParams{Metadata: map[string]string{"why": "test"}})
	require.NoError(t, err)
	assert.Equal(t, "test", upd.Metadata["why"])

	upd, err = sc.V1Subscriptions.Update(ctx, atEnd.ID, &stripe.SubscriptionUpdateParams{CancelAtPeriodEnd: stripe.Bool(true)})
	require.NoError(t, err)
	assert.True(t, upd.CancelAtPeriodEnd)
	assert.Equal(t, stripe.SubscriptionStatusActive, upd.Status)

	var active []string
	for sub, err := range sc.V1Subscriptions.List(ctx, nil) {
		require.NoError(t, err)
		active = append(active, sub.ID)
	}
	assert.Equal(t, []string{atEnd.ID}, active, "canceled ones are left out without a status")

	clk.Set(day(2026, 4, 1, 2, 0))
	assert.Empty(t, invoicesOf(t, sc, drop.ID), "its usage billed by no invoice")
	assert.Len(t, invoicesOf(t, sc, invoiceNow.ID), 1, "no invoice after the cancellation")
	ended := invoicesOf(t, sc, atEnd.ID)
	require.Len(t, ended, 1)
	assert.Equal(t, stripe.InvoiceBillingReasonSubscriptionCycle, ended[0].BillingReason)
	assert.EqualValues(t, 8, ended[0].Lines.Data[0].Quantity)
	got, err = sc.V1Subscriptions.Retrieve(ctx, atEnd.ID, nil)
	require.NoError(t, err)
	assert.Equal(t, stripe.SubscriptionStatusCanceled, got.Status)
	assert.Equal(t, unix(day(2026, 4, 1, 0, 0)), got.EndedAt)
	assert.Equal(t, unix(day(2026, 3, 15, 0, 0)), got.CanceledAt, "the time of the update request")

	var canceled []string
	for sub, err := range sc.V1Subscriptions.List(ctx, &stripe.SubscriptionListParams{Status: stripe.String("canceled")}) {
		require.NoError(t, err)
		canceled = append(canceled, sub.ID)
	}
	assert.ElementsMatch(t, []string{invoiceNow.ID, drop.ID, atEnd.ID}, canceled)
	r := do(t, ts, http.MethodGet, "/v1/subscriptions", testKey, url.Values{"status": {"all"}}, nil)
	assert.Len(t, r.body["data"], 3)
}

// Items added during a period bill their usage from the time they were
// added ("the invoice includes usage from January 16 to January 31 at price
// C for that subscription item"); a deleted item's usage is billed by no
// invoice ("After deletion, the invoice doesn't reflect any usage from that
// item"), both manage-billing-setup in classic billing mode, the default of
// the API version stripe-go v82 sends. The last item cannot be removed, and
// an item's price must share the subscription's interval.
func TestSubscriptionItemsAddedAndDeleted(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newBillingSim(t, day(2026, 3, 1, 0, 0))
	calls := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	storage := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "storage"})
	callsPrice := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: calls.ID, UnitAmountDecimal: "1"})
	storagePrice := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: storage.ID, UnitAmountDecimal: "2"})
	yearly := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: storage.ID, UnitAmountDecimal: "2", Interval: "year"})
	sim.CreateCustomer(acct, "cus_acme")
	sc, ctx := client(ts, testKey), context.Background()
	sub := subscribe(t, sc, "cus_acme", zeroTime, zeroTime, callsPrice)
	callsItem := sub.Items.Data[0].ID

	clk.Set(day(2026, 3, 3, 0, 0))
	usage(t, sc, "", "api_calls", "cus_acme", 6, clk.Now())
	usage(t, sc, "", "storage", "cus_acme", 40, clk.Now()) // before the item: billed by none

	clk.Set(day(2026, 3, 10, 0, 0))
	_, err := sc.V1Subscriptions.Update(ctx, sub.ID, &stripe.SubscriptionUpdateParams{
		Items: []*stripe.SubscriptionUpdateItemParams{{Price: stripe.String(yearly)}}})
	assert.Equal(t, http.StatusBadRequest, stripeErr(t, err).HTTPStatusCode, "a yearly price on a monthly subscription")
	_, err = sc.V1Subscriptions.Update(ctx, sub.ID, &stripe.SubscriptionUpdateParams{
		Items: []*stripe.SubscriptionUpdateItemParams{{Price: stripe.String(callsPrice)}}})
	assert.Equal(t, http.StatusBadRequest, stripeErr(t, err).HTTPStatusCode, "the same price twice")
	upd, err := sc.V1Subscriptions.Update(ctx, sub.ID, &stripe.SubscriptionUpdateParams{
		Items: []*stripe.SubscriptionUpdateItemParams{{Price: stripe.String(storagePrice)}}})
	require.NoError(t, err)
	require.Len(t, upd.Items.Data, 2)
	storageItem := upd.Items.Data[1]
	assert.Equal(t, storagePrice, storageItem.Price.ID)
	assert.Equal(t, unix(clk.Now()), storageItem.CurrentPeriodStart)
	assert.Equal(t, unix(day(2026, 4, 1, 0, 0)), storageItem.CurrentPeriodEnd)

	clk.Set(day(2026, 3, 12, 0, 0))
	usage(t, sc, "", "storage", "cus_acme", 5, clk.Now())
	clk.Set(day(2026, 3, 20, 0, 0))
	del, err := sc.V1SubscriptionItems.Delete(ctx, callsItem, nil)
	require.NoError(t, err)
	assert.True(t, del.Deleted)
	_, err = sc.V1SubscriptionItems.Delete(ctx, storageItem.ID, nil)
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusBadRequest, se.HTTPStatusCode, "the last item")
	_, err = sc.V1SubscriptionItems.Delete(ctx, "si_nope", nil)
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode)
	usage(t, sc, "", "api_calls", "cus_acme", 100, clk.Now()) // after deletion: billed by none

	clk.Set(day(2026, 4, 1, 0, 0))
	invs := invoicesOf(t, sc, sub.ID)
	require.Len(t, invs, 1)
	require.Len(t, invs[0].Lines.Data, 1, "the deleted item has no line")
	l := invs[0].Lines.Data[0]
	assert.Equal(t, storageItem.ID, l.Parent.SubscriptionItemDetails.SubscriptionItem)
	assert.EqualValues(t, 5, l.Quantity)
	assert.EqualValues(t, 10, l.Amount)
	assert.Equal(t, unix(day(2026, 3, 10, 0, 0)), l.Period.Start)

	// Deleting through the subscription, as items[n][id] with deleted.
	upd, err = sc.V1Subscriptions.Update(ctx, sub.ID, &stripe.SubscriptionUpdateParams{
		Items: []*stripe.SubscriptionUpdateItemParams{{Price: stripe.String(callsPrice)}, {ID: stripe.String(storageItem.ID), Deleted: stripe.Bool(true)}}})
	require.NoError(t, err)
	require.Len(t, upd.Items.Data, 1)
	assert.Equal(t, callsPrice, upd.Items.Data[0].Price.ID)
}

// Connect: prices, subscriptions, invoices and the usage they bill belong
// to one account. The same customer id in two accounts is two customers,
// and a price of one account is unknown to the other.
func TestBillingOfConnectedAccountsIsIsolated(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newBillingSim(t, day(2026, 3, 1, 0, 0))
	own := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	theirs := sim.CreateMeter(connected, stripesim.MeterSpec{EventName: "api_calls"})
	ownPrice := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: own.ID, UnitAmountDecimal: "1"})
	theirPrice := sim.CreatePrice(connected, stripesim.PriceSpec{Meter: theirs.ID, UnitAmountDecimal: "1"})
	sim.CreateCustomer(acct, "cus_shared")
	sim.CreateCustomer(connected, "cus_shared")
	sc, ctx := client(ts, testKey), context.Background()

	p := &stripe.SubscriptionCreateParams{Customer: stripe.String("cus_shared"),
		Items: []*stripe.SubscriptionCreateItemParams{{Price: stripe.String(ownPrice)}}}
	p.SetStripeAccount(connected)
	_, err := sc.V1Subscriptions.Create(ctx, p)
	assert.Equal(t, http.StatusBadRequest, stripeErr(t, err).HTTPStatusCode, "the platform's price is unknown there")
	p.Items[0].Price = stripe.String(theirPrice)
	theirSub, err := sc.V1Subscriptions.Create(ctx, p)
	require.NoError(t, err)
	ownSub := subscribe(t, sc, "cus_shared", zeroTime, zeroTime, ownPrice)

	clk.Set(day(2026, 3, 5, 0, 0))
	usage(t, sc, "", "api_calls", "cus_shared", 30, clk.Now())
	usage(t, sc, connected, "api_calls", "cus_shared", 4, clk.Now())
	clk.Set(day(2026, 4, 1, 2, 0))

	mine := invoicesOf(t, sc, ownSub.ID)
	require.Len(t, mine, 1)
	assert.EqualValues(t, 30, mine[0].Total)
	assert.Empty(t, invoicesOf(t, sc, theirSub.ID), "not the platform's")
	lp := &stripe.InvoiceListParams{}
	lp.SetStripeAccount(connected)
	var theirs2 []*stripe.Invoice
	for inv, err := range sc.V1Invoices.List(ctx, lp) {
		require.NoError(t, err)
		theirs2 = append(theirs2, inv)
	}
	require.Len(t, theirs2, 1)
	assert.EqualValues(t, 4, theirs2[0].Total)
	assert.Equal(t, theirSub.ID, theirs2[0].Parent.SubscriptionDetails.Subscription.ID)
	_, err = sc.V1Invoices.Retrieve(ctx, theirs2[0].ID, nil)
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode)
	require.Len(t, sim.Invoices(connected), 1)
	n := 0
	for _, err := range client(ts, liveKey).V1Invoices.List(ctx, nil) {
		require.NoError(t, err)
		n++
	}
	assert.Zero(t, n, "test invoices are unknown to a live key")
}

// Options.InvoiceGrace sets the grace period of the drafts ("You can set a
// delay of up to 72 hours", configure-grace-period), and AdvanceBilling and
// the readbacks apply what is due without a request.
func TestInvoiceGraceOption(t *testing.T) {
	t.Parallel()
	clk := &clock{t: day(2026, 3, 1, 0, 0)}
	sim := stripesim.New(stripesim.Options{Now: clk.Now, InvoiceGrace: 72 * time.Hour})
	meter := sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "api_calls"})
	price := sim.CreatePrice(stripesim.DefaultAccount, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "1"})
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_acme")
	sim.CreateSubscription(stripesim.DefaultAccount, stripesim.SubscriptionSpec{Customer: "cus_acme", Prices: []string{price}})

	clk.Set(day(2026, 4, 3, 23, 59))
	invs := sim.Invoices(stripesim.DefaultAccount)
	require.Len(t, invs, 1)
	assert.Equal(t, stripesim.InvoiceDraft, invs[0].Status)
	assert.Equal(t, day(2026, 4, 4, 0, 0), invs[0].AutomaticallyFinalizesAt.UTC())
	clk.Set(day(2026, 4, 4, 0, 0))
	sim.AdvanceBilling()
	invs = sim.Invoices(stripesim.DefaultAccount)
	assert.Equal(t, stripesim.InvoiceOpen, invs[0].Status)
	assert.Equal(t, day(2026, 4, 4, 0, 0), invs[0].FinalizedAt.UTC())
	assert.Equal(t, "cus_acme", invs[0].Customer)
	assert.Equal(t, price, invs[0].Lines[0].Price)
	assert.Equal(t, meter.ID, invs[0].Lines[0].Meter)
}

// On a MovedClock, whose times have fractions of a second, periods still
// start and end on whole seconds, as Stripe's timestamps do, so that usage
// timestamped on a period's last second is billed in it.
func TestBillingOnAMovedClock(t *testing.T) {
	t.Parallel()
	clk := &stripesim.MovedClock{}
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{testKey: acct}, Now: clk.Now})
	ts := httptest.NewServer(sim.Handler())
	t.Cleanup(ts.Close)
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	price := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "1", Interval: "day"})
	sim.CreateCustomer(acct, "cus_acme")
	sc := client(ts, testKey)
	sub := subscribe(t, sc, "cus_acme", zeroTime, zeroTime, price)
	it := sub.Items.Data[0]
	assert.Equal(t, sub.Created, it.CurrentPeriodStart)
	assert.Equal(t, it.CurrentPeriodStart+86400, it.CurrentPeriodEnd)

	usage(t, sc, "", "api_calls", "cus_acme", 2, time.Unix(it.CurrentPeriodStart, 0))
	clk.Add(24*time.Hour - time.Minute)
	usage(t, sc, "", "api_calls", "cus_acme", 3, time.Unix(it.CurrentPeriodEnd-1, 0))
	clk.Add(2 * time.Hour)
	invs := invoicesOf(t, sc, sub.ID)
	require.Len(t, invs, 1)
	assert.EqualValues(t, 5, invs[0].Lines.Data[0].Quantity, "the period's first and last seconds")
	assert.Equal(t, stripe.InvoiceStatusOpen, invs[0].Status)
}

// GET /v1/invoices lists "with the most recently created invoices appearing
// first" (stripe-go InvoiceListParams), filtered by customer, subscription,
// status and created, a page at a time; an unknown status is refused.
func TestInvoiceListFilters(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newBillingSim(t, day(2026, 3, 1, 0, 0))
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	price := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "1"})
	sim.CreateCustomer(acct, "cus_a")
	sim.CreateCustomer(acct, "cus_b")
	sc, ctx := client(ts, testKey), context.Background()
	subA := subscribe(t, sc, "cus_a", zeroTime, zeroTime, price)
	subscribe(t, sc, "cus_b", day(2026, 3, 15, 0, 0), zeroTime, price)
	clk.Set(day(2026, 4, 1, 0, 30)) // cus_b: March 15 (open), April 15 not yet; cus_a: April 1 (draft)

	list := func(p *stripe.InvoiceListParams) []string {
		var ids []string
		for inv, err := range sc.V1Invoices.List(ctx, p) {
			require.NoError(t, err)
			ids = append(ids, inv.Customer.ID+"/"+string(inv.Status))
		}
		return ids
	}
	assert.Equal(t, []string{"cus_a/draft", "cus_b/open"}, list(&stripe.InvoiceListParams{ListParams: stripe.ListParams{Limit: stripe.Int64(1)}}))
	assert.Equal(t, []string{"cus_b/open"}, list(&stripe.InvoiceListParams{Customer: stripe.String("cus_b")}))
	assert.Equal(t, []string{"cus_a/draft"}, list(&stripe.InvoiceListParams{Subscription: stripe.String(subA.ID)}))
	assert.Equal(t, []string{"cus_b/open"}, list(&stripe.InvoiceListParams{Status: stripe.String("open")}))
	assert.Equal(t, []string{"cus_a/draft"}, list(&stripe.InvoiceListParams{CreatedRange: &stripe.RangeQueryParams{
		GreaterThan: unix(day(2026, 3, 15, 0, 0))}}))
	assert.Empty(t, list(&stripe.InvoiceListParams{Status: stripe.String("paid")}))

	r := do(t, ts, http.MethodGet, "/v1/invoices", testKey, url.Values{"status": {"late"}}, nil)
	assert.Equal(t, http.StatusBadRequest, r.status)
	assert.Equal(t, "status", r.errField("param"))
	r = do(t, ts, http.MethodGet, "/v1/invoices/in_nope/lines", testKey, nil, nil)
	assert.Equal(t, http.StatusNotFound, r.status)
}
