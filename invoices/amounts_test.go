package invoices_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/quarantine"
)

// What the ledger's usage should bill, by package pricing from the price
// Tally kept, equals what the simulator's invoice bills, for every kind
// of price: per unit, decimal, package (whose line quantity the simulator
// shows as the usage), graduated and volume tiers, and a flat base fee.
// Each is a meter of its own on one subscription.
func TestCheckAmountsMatchTheSimulatorsInvoices(t *testing.T) {
	t.Parallel()
	tiers := []stripesim.TierSpec{{UpTo: 5, UnitAmountDecimal: "500"}, {UpTo: 10, UnitAmountDecimal: "400"},
		{UpTo: 15, UnitAmountDecimal: "300"}, {UpTo: 20, UnitAmountDecimal: "200"}, {UnitAmountDecimal: "100"}}
	baseFee := []stripesim.TierSpec{{UpTo: 1000, FlatAmountDecimal: "2000", UnitAmountDecimal: "0"}, {UnitAmountDecimal: "1"}}
	cases := []struct {
		name   string
		price  stripesim.PriceSpec
		usage  int64
		amount int64
	}{
		{"per_unit", stripesim.PriceSpec{UnitAmountDecimal: "25"}, 7, 175},
		{"decimal", stripesim.PriceSpec{UnitAmountDecimal: "0.05"}, 30, 2},
		{"decimal_twelve", stripesim.PriceSpec{UnitAmountDecimal: "0.333333333333"}, 3, 1},
		{"package_up", stripesim.PriceSpec{UnitAmountDecimal: "1000", DivideBy: 60, Round: "up"}, 150, 3000},
		{"package_down", stripesim.PriceSpec{UnitAmountDecimal: "1000", DivideBy: 60, Round: "down"}, 150, 2000},
		{"graduated", stripesim.PriceSpec{Tiers: tiers, TiersMode: "graduated"}, 6, 2900},
		{"volume", stripesim.PriceSpec{Tiers: tiers, TiersMode: "volume"}, 6, 2400},
		{"base_fee", stripesim.PriceSpec{Tiers: baseFee, TiersMode: "graduated"}, 1500, 2500},
	}
	b := newBilling(t)
	var prices []string
	for _, c := range cases {
		m := b.sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: c.name})
		_, err := b.env.Pool.Exec(b.ctx, `INSERT INTO stripe_meters (account, mode, id, event_name, status, formula)
			VALUES ('', 'test', $1, $2, 'active', 'sum')`, m.ID, c.name)
		require.NoError(t, err)
		b.env.Feature(t, c.name, mappings.Sum, time.Hour)
		spec := c.price
		spec.Meter = m.ID
		prices = append(prices, b.sim.CreatePrice(stripesim.DefaultAccount, spec))
	}
	b.subscribe(prices...)
	_, err := b.env.Maps.SyncCustomer(b.ctx, b.env.Pool, mappings.StripeMeters{Client: b.client}, b.cus)
	require.NoError(t, err)
	for i, c := range cases {
		b.ledger(fmt.Sprintf("e%d", i), c.name, c.usage, 24*time.Hour)
		b.stripeGets(c.name, c.usage, 24*time.Hour)
	}
	read, err := invoices.KeepItemPrices(b.ctx, b.env.Pool, b.reader, 100)
	require.NoError(t, err)
	require.Equal(t, len(cases), read, "the subscription items' prices")
	read, err = invoices.KeepItemPrices(b.ctx, b.env.Pool, b.reader, 100)
	require.NoError(t, err)
	require.Zero(t, read, "a kept price is not read again")
	b.reportAmounts(cases, prices, "the subscription items' prices")
	b.invoice(b.anchor.Sub(b.clock.Now()) + time.Minute)
	final, r := b.invoice(time.Hour)
	require.Equal(t, "open", final.Status)
	checks := byName(r.Checks)
	require.Len(t, checks, len(cases))
	lineAmount := map[string]int64{}
	for _, l := range final.Lines {
		lineAmount[l.SubscriptionItem] += l.Amount
	}
	for _, c := range cases {
		ch := checks[c.name]
		require.Equal(t, invoices.Matches, ch.Status, "%s: %+v", c.name, ch)
		require.Equal(t, "usd", ch.Currency, c.name)
		require.NotNil(t, ch.ExpectedAmount, "%s: %s", c.name, ch.AmountNote)
		require.Equal(t, c.amount, *ch.ExpectedAmount, "%s: Tally's pricing", c.name)
		require.Equal(t, c.amount, *ch.InvoicedAmount, "%s: the simulator's invoice", c.name)
	}
	var total int64
	for _, a := range lineAmount {
		total += a
	}
	var want int64
	for _, c := range cases {
		want += c.amount
	}
	require.Equal(t, want, total, "the invoice's lines")
	rep := b.reportAmounts(cases, prices, "the invoice's prices")
	require.Equal(t, []quarantine.Amount{{Currency: "usd", Amount: total, AtRisk: rep.Amounts[0].AtRisk, Lines: len(cases)}}, rep.Amounts)
	require.Equal(t, []quarantine.CustomerAmount{{Customer: b.cus, Amount: rep.Amounts[0]}}, rep.Customers)
}

// reportAmounts checks that the completeness report prices every line as
// the simulator's invoice bills it; all of it is at risk, the usage being
// staged but not sent, except a flat fee Stripe bills with no usage.
func (b *billing) reportAmounts(cases []struct {
	name   string
	price  stripesim.PriceSpec
	usage  int64
	amount int64
}, prices []string, from string) quarantine.Completeness {
	b.t.Helper()
	reports, err := quarantine.NewReports(0, nil)
	require.NoError(b.t, err)
	rep, err := reports.Completeness(b.ctx, b.env.Pool, stagetest.AddMonths(b.anchor, -1).Format("2006-01"), "acme", true)
	require.NoError(b.t, err)
	lines := map[string]quarantine.Line{}
	for _, l := range rep.Lines {
		lines[l.Feature] = l
	}
	for i, c := range cases {
		l := lines[c.name]
		require.NotNil(b.t, l.Amount, "%s from %s: %s", c.name, from, l.AmountNote)
		require.Equal(b.t, c.amount, *l.Amount, "%s from %s", c.name, from)
		require.Equal(b.t, prices[i], l.Price, c.name)
		require.Equal(b.t, "usd", l.Currency, c.name)
		require.Equal(b.t, b.cus, l.Customer, c.name)
		risk := c.amount
		if c.name == "base_fee" {
			risk = c.amount - 2000
		}
		require.Equal(b.t, risk, *l.AmountAtRisk, "%s from %s", c.name, from)
	}
	require.Zero(b.t, rep.UnpricedLines)
	return rep
}
