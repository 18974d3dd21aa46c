package quarantine

import (
	"math/big"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"
)

func TestShareAddsUpToTheAmount(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		amount  int64
		weights []int64
		want    []int64
	}{
		{"one line takes all", 1234, []int64{7}, []int64{1234}},
		{"in proportion", 300, []int64{1, 2}, []int64{100, 200}},
		{"the cent left to the largest remainder", 100, []int64{1, 1, 1}, []int64{34, 33, 33}},
		{"two cents left", 200, []int64{1, 1, 1}, []int64{67, 67, 66}},
		{"no weight, no share", 500, []int64{0, 5}, []int64{0, 500}},
		{"nothing to share", 0, []int64{3, 4}, []int64{0, 0}},
		{"no usage at all", 50, []int64{0, 0}, []int64{0, 0}},
		{"a large amount", 1 << 60, []int64{1, 3}, []int64{1 << 58, 3 << 58}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			w := make([]*big.Int, len(c.weights))
			for i, x := range c.weights {
				w[i] = big.NewInt(x)
			}
			require.Equal(t, c.want, share(c.amount, w))
		})
	}
}

// perUnit is a metered per-unit price of unit cents in usd.
func perUnit(unit string) *stripe.Price {
	return &stripe.Price{ID: "price_unit", Currency: "usd", Type: stripe.PriceTypeRecurring, BillingScheme: stripe.PriceBillingSchemePerUnit,
		UnitAmountDecimal: mustFloat(unit), Recurring: &stripe.PriceRecurring{UsageType: stripe.PriceRecurringUsageTypeMetered, Interval: "month", IntervalCount: 1}}
}

// graduated is a metered graduated price: 10 cents each of the first 100
// units, 5 cents each after.
func graduated() *stripe.Price {
	p := perUnit("0")
	p.ID, p.BillingScheme, p.TiersMode = "price_grad", stripe.PriceBillingSchemeTiered, stripe.PriceTiersModeGraduated
	p.Tiers = []*stripe.PriceTier{{UpTo: 100, UnitAmountDecimal: 10}, {UnitAmountDecimal: 5}}
	return p
}

func mustFloat(s string) float64 {
	f, _ := new(big.Float).SetString(s)
	v, _ := f.Float64()
	return v
}

func sumLine(ingested, cancelled, pending, quarantined int64) Line {
	return Line{Ingested: Bucket{Value: ValueOf(ingested)}, Cancelled: Bucket{Value: ValueOf(cancelled)},
		Pending: Bucket{Value: ValueOf(pending)}, Quarantined: Bucket{Value: ValueOf(quarantined)}}
}

// Lines billed by one invoice line are priced on their total, as Stripe
// prices the meter's total, and share the amount by usage; the amount at
// risk is what the total loses without the risky usage, shared by risky
// usage. Cancelled usage bills nothing.
func TestPriceGroupPricesTheTotalAndSharesIt(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name         string
		price        *stripe.Price
		lines        []Line
		amount, risk []int64
	}{
		{"per unit, one line", perUnit("2.5"), []Line{sumLine(100, 20, 10, 0)}, []int64{200}, []int64{25}},
		{"per unit, two lines", perUnit("3"), []Line{sumLine(10, 0, 0, 0), sumLine(30, 0, 0, 5)}, []int64{30, 90}, []int64{0, 15}},
		// 150 units: 100 × 10 + 50 × 5 = 1250; without the 60 risky: 90 × 10 = 900.
		{"graduated, two lines", graduated(), []Line{sumLine(50, 0, 0, 0), sumLine(100, 0, 40, 20)}, []int64{417, 833}, []int64{0, 350}},
		{"all cancelled", perUnit("7"), []Line{sumLine(4, 4, 0, 0)}, []int64{0}, []int64{0}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			idx := make([]int, len(c.lines))
			for i := range idx {
				idx[i] = i
			}
			priceGroup(c.lines, idx, c.price, "usd", "sum")
			for i, l := range c.lines {
				require.NotNil(t, l.Amount, l.AmountNote)
				require.Equal(t, c.amount[i], *l.Amount, "line %d", i)
				require.Equal(t, c.risk[i], *l.AmountAtRisk, "line %d", i)
			}
		})
	}
}

// A price Tally does not model gives every line of its group a note and
// no amount, never a guess.
func TestPriceGroupSaysWhyItCannotPrice(t *testing.T) {
	t.Parallel()
	p := perUnit("1")
	p.CustomUnitAmount = &stripe.PriceCustomUnitAmount{}
	lines := []Line{sumLine(5, 0, 0, 0), sumLine(6, 0, 0, 0)}
	priceGroup(lines, []int{0, 1}, p, "usd", "sum")
	for _, l := range lines {
		require.Nil(t, l.Amount)
		require.Contains(t, l.AmountNote, "custom_unit_amount")
	}
}

// The totals add the priced lines per currency and per customer, never
// two currencies together, and count the lines without an amount.
func TestSumAmountsKeepsCurrenciesApart(t *testing.T) {
	t.Parallel()
	n := func(v int64) *int64 { return &v }
	c := Completeness{Lines: []Line{
		{Customer: "cus_a", Currency: "usd", Amount: n(100), AmountAtRisk: n(10)},
		{Customer: "cus_a", Currency: "eur", Amount: n(50), AmountAtRisk: n(0)},
		{Customer: "cus_b", Currency: "usd", Amount: n(7), AmountAtRisk: n(7)},
		{AmountNote: "no subscription item of the customer bills the feature's meter"},
	}}
	c.sumAmounts()
	require.Equal(t, []Amount{{Currency: "eur", Amount: 50, Lines: 1}, {Currency: "usd", Amount: 107, AtRisk: 17, Lines: 2}}, c.Amounts)
	require.Equal(t, []CustomerAmount{
		{Customer: "cus_a", Amount: Amount{Currency: "eur", Amount: 50, Lines: 1}},
		{Customer: "cus_a", Amount: Amount{Currency: "usd", Amount: 100, AtRisk: 10, Lines: 1}},
		{Customer: "cus_b", Amount: Amount{Currency: "usd", Amount: 7, AtRisk: 7, Lines: 1}},
	}, c.Customers)
	require.Equal(t, 1, c.UnpricedLines)
}

// A line says why it has no amount: no subscription item bills its
// meter, then its price has not been read from Stripe, and a tenant
// filter sums the tenant's lines alone.
func TestReportSaysWhyALineHasNoAmount(t *testing.T) {
	t.Parallel()
	e := newSnapshotEnv(t)
	e.post(t, "acme", 5)
	e.post(t, "beta", 6)
	reports, err := NewReports(0, nil)
	require.NoError(t, err)
	report := func(tenant string) Completeness {
		t.Helper()
		c, err := reports.Completeness(e.Ctx, e.Pool, e.month, tenant, true)
		require.NoError(t, err)
		return c
	}
	c := report("")
	require.Len(t, c.Lines, 2)
	for _, l := range c.Lines {
		require.Nil(t, l.Amount)
		require.Equal(t, "no subscription item of the customer bills the feature's meter", l.AmountNote)
	}
	require.Equal(t, 2, c.UnpricedLines)
	require.Empty(t, c.Amounts)

	_, err = e.Pool.Exec(e.Ctx, `INSERT INTO stripe_meters (account, mode, id, event_name, status, formula)
		VALUES ('', 'test', 'mtr_api', 'api', 'active', 'sum')`)
	require.NoError(t, err)
	_, err = e.Pool.Exec(e.Ctx, `INSERT INTO stripe_subscription_items (account, item, customer, subscription, status, price, meter,
		currency, billing_interval, interval_count, billing_cycle_anchor, current_period_start, current_period_end, start_date)
		VALUES ('', 'si_1', 'cus_acme', 'sub_1', 'active', 'price_api', 'mtr_api', 'usd', 'month', 1, '2000-01-01', '2000-01-01',
		'2000-02-01', '2000-01-01')`)
	require.NoError(t, err)
	acme := report("acme")
	require.Len(t, acme.Lines, 1)
	require.Equal(t, "price price_api has not been read from Stripe yet", acme.Lines[0].AmountNote)

	_, err = e.Pool.Exec(e.Ctx, `INSERT INTO stripe_prices (account, price, body) VALUES ('', 'price_api', '{"id": "price_api",
		"object": "price", "currency": "usd", "type": "recurring", "billing_scheme": "per_unit", "unit_amount_decimal": "150",
		"recurring": {"usage_type": "metered", "interval": "month", "interval_count": 1}}')`)
	require.NoError(t, err)
	c = report("")
	for _, l := range c.Lines {
		if l.Tenant == "acme" {
			require.NotNil(t, l.Amount, l.AmountNote)
			require.Equal(t, int64(750), *l.Amount)
			require.Equal(t, int64(750), *l.AmountAtRisk, "not yet staged: all of it at risk")
			require.Equal(t, "price_api", l.Price)
		} else {
			require.Nil(t, l.Amount)
		}
	}
	require.Equal(t, []Amount{{Currency: "usd", Amount: 750, AtRisk: 750, Lines: 1}}, c.Amounts)
	require.Equal(t, 1, c.UnpricedLines)
	beta := report("beta")
	require.Empty(t, beta.Amounts, "the filter sums the tenant's lines alone")
	require.Equal(t, 1, beta.UnpricedLines)
}
