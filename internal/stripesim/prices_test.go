package stripesim_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

// POST /v1/prices refuses what Stripe refuses, each with the parameter at
// fault: a metered price needs a meter since 2025-03-31.basil ("You can no
// longer create a price with a usage_type of metered without a specified
// meter", changelog "Removes legacy usage-based billing"), and an active
// one of the account and mode; transform_quantity "Cannot be combined with
// tiers" and the interval is at most three years (stripe-go
// PriceCreateParams); a tier without an amount answers Stripe's "An entry
// in the tiers array is missing an amount." (as Stripe's users report it).
// Nothing is created.
func TestPriceCreateRefused(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newBillingSim(t, day(2026, 3, 1, 0, 0))
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	old := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "old_calls"})
	require.NoError(t, sim.DeactivateMeter(acct, old.ID))
	elsewhere := sim.CreateMeter(connected, stripesim.MeterSpec{EventName: "api_calls"})
	live := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls", Livemode: true})

	ok := map[string][]string{
		"currency": {"usd"}, "product_data[name]": {"API calls"}, "unit_amount": {"5"},
		"recurring[interval]": {"month"}, "recurring[usage_type]": {"metered"}, "recurring[meter]": {meter.ID},
	}
	tiered := without(ok, []string{"unit_amount"}, "billing_scheme", "tiered", "tiers_mode", "graduated",
		"tiers[0][up_to]", "10", "tiers[0][unit_amount]", "5", "tiers[1][up_to]", "inf", "tiers[1][unit_amount]", "2")
	for _, c := range []struct {
		name       string
		form       map[string][]string
		remove     []string
		set        []string
		param, msg string
	}{
		{name: "no currency", form: ok, remove: []string{"currency"}, param: "currency", msg: "Missing required param: currency."},
		{name: "bad currency", form: ok, set: []string{"currency", "US"}, param: "currency"},
		{name: "no product", form: ok, remove: []string{"product_data[name]"}, param: "product"},
		{name: "product and product_data", form: ok, set: []string{"product", "prod_x"}, param: "product_data",
			msg: "You may only specify one of these parameters: product, product_data."},
		{name: "unknown product", form: without(ok, []string{"product_data[name]"}, "product", "prod_nope"),
			param: "product", msg: "No such product: 'prod_nope'"},
		{name: "per unit without an amount", form: ok, remove: []string{"unit_amount"}, param: "unit_amount"},
		{name: "both unit amounts", form: ok, set: []string{"unit_amount_decimal", "5.5"}, param: "unit_amount_decimal"},
		{name: "thirteen decimal places", form: ok, remove: []string{"unit_amount"},
			set: []string{"unit_amount_decimal", "0.0000000000001"}, param: "unit_amount_decimal"},
		{name: "negative amount", form: ok, set: []string{"unit_amount", "-1"}, param: "unit_amount"},
		{name: "tiers on a per-unit price", form: ok, set: []string{"tiers[0][up_to]", "inf", "tiers[0][unit_amount]", "1"}, param: "tiers"},
		{name: "tiered without tiers_mode", form: tiered, remove: []string{"tiers_mode"}, param: "tiers_mode"},
		{name: "tiered without tiers", form: tiered, remove: []string{"tiers[0][up_to]", "tiers[0][unit_amount]",
			"tiers[1][up_to]", "tiers[1][unit_amount]"}, param: "tiers"},
		{name: "tier without an amount", form: tiered, remove: []string{"tiers[1][unit_amount]"},
			param: "tiers[1][unit_amount]", msg: "An entry in the tiers array is missing an amount."},
		{name: "tiers not increasing", form: tiered, set: []string{"tiers[1][up_to]", "5", "tiers[2][up_to]", "inf",
			"tiers[2][unit_amount]", "1"}, param: "tiers[1][up_to]"},
		{name: "last tier not inf", form: tiered, set: []string{"tiers[1][up_to]", "20"}, param: "tiers[1][up_to]"},
		{name: "unit amount on a tiered price", form: tiered, set: []string{"unit_amount", "5"}, param: "unit_amount"},
		{name: "transform with tiers", form: tiered, set: []string{"transform_quantity[divide_by]", "10",
			"transform_quantity[round]", "up"}, param: "transform_quantity"},
		{name: "transform rounding sideways", form: ok, set: []string{"transform_quantity[divide_by]", "10",
			"transform_quantity[round]", "sideways"}, param: "transform_quantity[round]"},
		{name: "transform dividing by zero", form: ok, set: []string{"transform_quantity[divide_by]", "0",
			"transform_quantity[round]", "up"}, param: "transform_quantity[divide_by]"},
		{name: "fortnightly", form: ok, set: []string{"recurring[interval]", "fortnight"}, param: "recurring[interval]"},
		{name: "37 months", form: ok, set: []string{"recurring[interval_count]", "37"}, param: "recurring[interval_count]"},
		{name: "metered without a meter", form: ok, remove: []string{"recurring[meter]"}, param: "recurring[meter]"},
		{name: "licensed with a meter", form: ok, set: []string{"recurring[usage_type]", "licensed"}, param: "recurring[meter]"},
		{name: "unknown meter", form: ok, set: []string{"recurring[meter]", "mtr_nope"}, param: "recurring[meter]",
			msg: "No such billing meter: 'mtr_nope'"},
		{name: "inactive meter", form: ok, set: []string{"recurring[meter]", old.ID}, param: "recurring[meter]"},
		{name: "another account's meter", form: ok, set: []string{"recurring[meter]", elsewhere.ID}, param: "recurring[meter]"},
		{name: "a live meter for a test price", form: ok, set: []string{"recurring[meter]", live.ID}, param: "recurring[meter]"},
		{name: "unknown parameter", form: ok, set: []string{"aggregate_usage", "sum"}, param: "aggregate_usage",
			msg: "Received unknown parameter: aggregate_usage"},
	} {
		r := do(t, ts, http.MethodPost, "/v1/prices", testKey, without(c.form, c.remove, c.set...), nil)
		assert.Equal(t, http.StatusBadRequest, r.status, c.name)
		assert.Equal(t, "invalid_request_error", r.errField("type"), c.name)
		assert.Equal(t, c.param, r.errField("param"), c.name)
		if c.msg != "" {
			assert.Equal(t, c.msg, r.errField("message"), c.name)
		}
	}
	r := do(t, ts, http.MethodGet, "/v1/prices", testKey, nil, nil)
	require.Equal(t, http.StatusOK, r.status)
	assert.Empty(t, r.body["data"], "nothing was created")
}

// A price is answered in the shape stripe-go decodes: a decimal unit amount
// leaves unit_amount null ("the response contains unit_amount = null and
// unit_amount_decimal = 0.05", docs.stripe.com/billing/subscriptions/decimal-amounts);
// tiers and currency_options only when expanded, as the Price object's
// example leaves both out; inf is an up_to of null. Prices list newest
// first, filtered, and a mode never sees the other's.
func TestPriceCreateRetrieveList(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newBillingSim(t, day(2026, 3, 1, 0, 0))
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	other := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "storage"})
	sc, ctx := client(ts, testKey), context.Background()

	dec, err := sc.V1Prices.Create(ctx, &stripe.PriceCreateParams{
		Currency: stripe.String("usd"), ProductData: &stripe.PriceCreateProductDataParams{Name: stripe.String("API calls")},
		UnitAmountDecimal: stripe.Float64(0.05),
		Recurring: &stripe.PriceCreateRecurringParams{Interval: stripe.String("month"), UsageType: stripe.String("metered"),
			Meter: stripe.String(meter.ID)},
		CurrencyOptions: map[string]*stripe.PriceCreateCurrencyOptionsParams{"eur": {UnitAmountDecimal: stripe.Float64(0.04)}},
	})
	require.NoError(t, err)
	assert.Regexp(t, `^price_`, dec.ID)
	assert.Equal(t, "price", dec.Object)
	assert.Zero(t, dec.UnitAmount, "null: not a whole amount")
	assert.InDelta(t, 0.05, dec.UnitAmountDecimal, 1e-12)
	assert.Equal(t, stripe.PriceBillingSchemePerUnit, dec.BillingScheme)
	assert.Equal(t, stripe.PriceTypeRecurring, dec.Type)
	assert.Equal(t, meter.ID, dec.Recurring.Meter)
	assert.Equal(t, stripe.PriceRecurringUsageTypeMetered, dec.Recurring.UsageType)
	assert.EqualValues(t, 1, dec.Recurring.IntervalCount)
	assert.Regexp(t, `^prod_`, dec.Product.ID, "product_data made a product")
	assert.Nil(t, dec.CurrencyOptions, "includable: left out")

	p := &stripe.PriceRetrieveParams{}
	p.AddExpand("currency_options")
	got, err := sc.V1Prices.Retrieve(ctx, dec.ID, p)
	require.NoError(t, err)
	require.Len(t, got.CurrencyOptions, 2, "the option and the price's own currency")
	assert.InDelta(t, 0.04, got.CurrencyOptions["eur"].UnitAmountDecimal, 1e-12)

	tiered, err := sc.V1Prices.Create(ctx, &stripe.PriceCreateParams{
		Currency: stripe.String("usd"), Product: stripe.String(dec.Product.ID),
		BillingScheme: stripe.String("tiered"), TiersMode: stripe.String("volume"),
		Tiers: []*stripe.PriceCreateTierParams{
			{UpTo: stripe.Int64(100), UnitAmount: stripe.Int64(10)},
			{UpToInf: stripe.Bool(true), UnitAmountDecimal: stripe.Float64(2.5), FlatAmount: stripe.Int64(300)},
		},
		Recurring: &stripe.PriceCreateRecurringParams{Interval: stripe.String("year"), UsageType: stripe.String("metered"),
			Meter: stripe.String(other.ID)},
	})
	require.NoError(t, err)
	assert.Equal(t, dec.Product.ID, tiered.Product.ID)
	assert.Equal(t, stripe.PriceTiersModeVolume, tiered.TiersMode)
	assert.Nil(t, tiered.Tiers, "includable: left out")
	p = &stripe.PriceRetrieveParams{}
	p.AddExpand("tiers")
	got, err = sc.V1Prices.Retrieve(ctx, tiered.ID, p)
	require.NoError(t, err)
	require.Len(t, got.Tiers, 2)
	assert.EqualValues(t, 100, got.Tiers[0].UpTo)
	assert.EqualValues(t, 10, got.Tiers[0].UnitAmount)
	assert.Zero(t, got.Tiers[1].UpTo, "inf")
	assert.InDelta(t, 2.5, got.Tiers[1].UnitAmountDecimal, 1e-12)
	assert.EqualValues(t, 300, got.Tiers[1].FlatAmount)

	var listed []string
	for pr, err := range sc.V1Prices.List(ctx, &stripe.PriceListParams{ListParams: stripe.ListParams{Limit: stripe.Int64(1)}}) {
		require.NoError(t, err)
		listed = append(listed, pr.ID)
	}
	assert.Equal(t, []string{tiered.ID, dec.ID}, listed, "newest first, a page at a time")
	listed = nil
	for pr, err := range sc.V1Prices.List(ctx, &stripe.PriceListParams{Recurring: &stripe.PriceListRecurringParams{Meter: stripe.String(meter.ID)}}) {
		require.NoError(t, err)
		listed = append(listed, pr.ID)
	}
	assert.Equal(t, []string{dec.ID}, listed)

	_, err = sc.V1Prices.Retrieve(ctx, "price_nope", nil)
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusNotFound, se.HTTPStatusCode)
	assert.Equal(t, stripe.ErrorCodeResourceMissing, se.Code)
	_, err = client(ts, liveKey).V1Prices.Retrieve(ctx, dec.ID, nil)
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode, "a test price is unknown to a live key")

	id := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "25"})
	helper, err := sc.V1Prices.Retrieve(ctx, id, nil)
	require.NoError(t, err)
	assert.EqualValues(t, 25, helper.UnitAmount)
	assert.Equal(t, stripe.PriceRecurringIntervalMonth, helper.Recurring.Interval)
	assert.Panics(t, func() { sim.CreatePrice(acct, stripesim.PriceSpec{UnitAmountDecimal: "1"}) }, "no meter")
}
