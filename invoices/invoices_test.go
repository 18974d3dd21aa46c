package invoices_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
)

// storedLine is a kept line as the test compares it.
type storedLine struct {
	Item         string
	Start, End   time.Time
	Quantity     int64
	Amount       int64
	Gone         bool
	Status       string
	AutoAdvance  bool
	FinalizedSet bool
}

func linesOf(t *testing.T, pool *pgxpool.Pool, invoice string) []storedLine {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
		SELECT coalesce(l.subscription_item, ''), l.period_start, l.period_end, l.quantity, l.amount, l.gone_at IS NOT NULL,
		       i.status, i.auto_advance, i.finalized_at IS NOT NULL
		FROM stripe_invoice_lines l JOIN stripe_invoices i USING (account, invoice)
		WHERE l.invoice = $1 ORDER BY l.line`, invoice)
	require.NoError(t, err)
	defer rows.Close()
	var out []storedLine
	for rows.Next() {
		var l storedLine
		require.NoError(t, rows.Scan(&l.Item, &l.Start, &l.End, &l.Quantity, &l.Amount, &l.Gone, &l.Status, &l.AutoAdvance, &l.FinalizedSet))
		l.Start, l.End = l.Start.UTC(), l.End.UTC()
		out = append(out, l)
	}
	require.NoError(t, rows.Err())
	return out
}

// Two billing cycles of a subscription anchored mid-month: each invoice is
// read when its events say so, kept as a draft with the usage Stripe had at
// the period's end, and again once finalized with the usage reported in the
// grace. The kept lines are the simulator's, quantity and amount. An
// invoice of a customer no tenant maps is not read; one Stripe does not
// have is not recorded; Stripe failing the read is an error to retry.
func TestInvoicesKeptAsStripeBillsThem(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	clock := &stripesim.MovedClock{}
	sim := stripesim.New(stripesim.Options{Now: clock.Now})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(srv.Close)
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	sc := c.Stripe()
	pool := testdb.New(t)

	meter := sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "api_calls"})
	cus := sim.CreateCustomer(stripesim.DefaultAccount, "")
	stranger := sim.CreateCustomer(stripesim.DefaultAccount, "")
	price := sim.CreatePrice(stripesim.DefaultAccount, stripesim.PriceSpec{UnitAmountDecimal: "2", Meter: meter.ID})
	anchor := clock.Now().UTC().Add(3 * 24 * time.Hour).Truncate(time.Second)
	sim.CreateSubscription(stripesim.DefaultAccount, stripesim.SubscriptionSpec{Customer: cus, Prices: []string{price}, BillingCycleAnchor: anchor})
	sim.CreateSubscription(stripesim.DefaultAccount, stripesim.SubscriptionSpec{Customer: stranger, Prices: []string{price}, BillingCycleAnchor: anchor})
	_, _, err = (&mappings.Store{}).PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: cus}, "alice")
	require.NoError(t, err)

	// use reports usage at a time, moving Stripe's clock there first when
	// it is behind (Stripe takes no usage from the future).
	use := func(customer string, value int64, at time.Time) {
		t.Helper()
		if d := at.Sub(clock.Now()); d > 0 {
			clock.Add(d + time.Second)
		}
		_, err := sc.V1BillingMeterEvents.Create(ctx, &stripe.BillingMeterEventCreateParams{EventName: stripe.String("api_calls"),
			Timestamp: stripe.Int64(at.Unix()), Payload: map[string]string{"stripe_customer_id": customer, "value": fmt.Sprint(value)}})
		require.NoError(t, err)
	}
	reader := invoices.Stripe{Client: c}
	receive := func(customer, id string) invoices.Received {
		t.Helper()
		r, err := invoices.Receive(ctx, pool, reader, &mappings.Store{}, customer, id)
		require.NoError(t, err)
		return r
	}
	invoiceOf := func(customer string, n int) stripesim.Invoice {
		t.Helper()
		var mine []stripesim.Invoice
		for _, inv := range sim.Invoices(stripesim.DefaultAccount) {
			if inv.Customer == customer {
				mine = append(mine, inv)
			}
		}
		require.Len(t, mine, n)
		return mine[n-1]
	}
	// want is what the simulator's invoice says of its one line.
	want := func(inv stripesim.Invoice, status string) []storedLine {
		require.Len(t, inv.Lines, 1)
		l := inv.Lines[0]
		return []storedLine{{Item: l.SubscriptionItem, Start: l.PeriodStart.UTC(), End: l.PeriodEnd.UTC(), Quantity: l.Quantity,
			Amount: l.Amount, Status: status, AutoAdvance: inv.AutoAdvance, FinalizedSet: status != "draft"}}
	}

	start := clock.Now().UTC()
	use(cus, 5, start.Add(time.Hour))
	use(cus, 7, start.Add(48*time.Hour))
	use(stranger, 100, start.Add(time.Hour))

	// The period ends: a draft with the usage Stripe has.
	clock.Add(anchor.Sub(clock.Now()) + time.Minute)
	first := invoiceOf(cus, 1)
	require.Equal(t, "draft", first.Status)
	require.Equal(t, invoices.Received{Accounts: 1, Recorded: 1}, receive(cus, first.ID))
	got := linesOf(t, pool, first.ID)
	require.Equal(t, want(first, "draft"), got)
	require.Equal(t, int64(12), got[0].Quantity)
	require.Equal(t, int64(24), got[0].Amount, "12 units at 2 cents")
	require.True(t, anchor.Equal(got[0].End))

	// Usage of the period reported in the grace is on it once finalized;
	// usage reported after is on no invoice.
	use(cus, 3, anchor.Add(-time.Hour))
	clock.Add(time.Hour)
	first = invoiceOf(cus, 1)
	require.Equal(t, "open", first.Status)
	receive(cus, first.ID)
	got = linesOf(t, pool, first.ID)
	require.Equal(t, want(first, "open"), got)
	require.Equal(t, int64(15), got[0].Quantity)
	use(cus, 4, anchor.Add(-30*time.Minute))

	// The second cycle: a month from the anchor.
	use(cus, 10, anchor.Add(24*time.Hour))
	clock.Add(stagetest.AddMonths(anchor, 1).Sub(clock.Now()) + time.Minute)
	second := invoiceOf(cus, 2)
	receive(cus, second.ID)
	clock.Add(time.Hour)
	second = invoiceOf(cus, 2)
	receive(cus, second.ID)
	got = linesOf(t, pool, second.ID)
	require.Equal(t, want(second, "open"), got)
	require.Equal(t, int64(10), got[0].Quantity, "the late 4 are on no invoice")
	require.True(t, anchor.Equal(got[0].Start))
	require.True(t, stagetest.AddMonths(anchor, 1).Equal(got[0].End))
	receive(cus, first.ID)
	require.Equal(t, int64(15), linesOf(t, pool, first.ID)[0].Quantity, "a finalized invoice stays as it was")

	// Not read: another customer's, one Stripe does not have.
	require.Equal(t, invoices.Received{}, receive(stranger, invoiceOf(stranger, 2).ID))
	require.Equal(t, invoices.Received{Accounts: 1}, receive(cus, "in_nope123"))
	var kept int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM stripe_invoices`).Scan(&kept))
	require.Equal(t, 2, kept)

	sim.Configure(stripesim.DefaultAccount, stripesim.Limits{Faults: stripesim.Faults{ReadFault: 1}})
	_, err = invoices.Receive(ctx, pool, reader, &mappings.Store{}, cus, second.ID)
	var se *stripeapi.Error
	require.ErrorAs(t, err, &se, "a read Stripe fails is retried")
}
