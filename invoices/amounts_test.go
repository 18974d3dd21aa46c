package invoices_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
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
	for i, c := range cases {
		b.ledger(fmt.Sprintf("e%d", i), c.name, c.usage, 24*time.Hour)
		b.stripeGets(c.name, c.usage, 24*time.Hour)
	}
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
}
