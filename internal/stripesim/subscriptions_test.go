package stripesim_test

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

// POST /v1/subscriptions refuses what Stripe refuses, each with the
// parameter at fault: an unknown or deleted customer or price (another
// account's included), a one-time price, prices of different intervals
// ("Currency and interval fields must match across all plans on this
// subscription. Found mismatch in interval field.") and a quantity for a
// metered price ("You cannot set the quantity for metered plans."), both
// as Stripe's users report them, an anchor in the past or later than the next
// natural billing date ("The anchor must be a future UNIX timestamp before
// the next natural subscription billing date",
// docs.stripe.com/payments/checkout/billing-cycle), a backdate in the
// future. Licensed prices are a simulator limit. Nothing is created and no
// event is recorded.
func TestSubscriptionCreateRefused(t *testing.T) {
	t.Parallel()
	now := day(2026, 3, 10, 12, 0)
	sim, ts, _ := newBillingSim(t, now)
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	storage := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "storage"})
	monthly := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "1"})
	yearly := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: storage.ID, UnitAmountDecimal: "1", Interval: "year"})
	elsewhere := sim.CreatePrice(connected, stripesim.PriceSpec{
		Meter: sim.CreateMeter(connected, stripesim.MeterSpec{EventName: "api_calls"}).ID, UnitAmountDecimal: "1"})
	oneTime := do(t, ts, http.MethodPost, "/v1/prices", testKey,
		url.Values{"currency": {"usd"}, "product_data[name]": {"Setup"}, "unit_amount": {"100"}}, nil).body["id"].(string)
	licensed := do(t, ts, http.MethodPost, "/v1/prices", testKey, url.Values{"currency": {"usd"},
		"product_data[name]": {"Seats"}, "unit_amount": {"100"}, "recurring[interval]": {"month"}}, nil).body["id"].(string)
	sim.CreateCustomer(acct, "cus_acme")
	sim.CreateCustomer(acct, "cus_gone")
	_, err := client(ts, testKey).V1Customers.Delete(context.Background(), "cus_gone", nil)
	require.NoError(t, err)

	ok := url.Values{"customer": {"cus_acme"}, "items[0][price]": {monthly}}
	at := func(days int) string { return strconv.FormatInt(now.AddDate(0, 0, days).Unix(), 10) }
	for _, c := range []struct {
		name       string
		remove     []string
		set        []string
		param, msg string
	}{
		{name: "no customer", remove: []string{"customer"}, param: "customer", msg: "Missing required param: customer."},
		{name: "no items", remove: []string{"items[0][price]"}, param: "items"},
		{name: "unknown customer", set: []string{"customer", "cus_nobody"}, param: "customer", msg: "No such customer: 'cus_nobody'"},
		{name: "deleted customer", set: []string{"customer", "cus_gone"}, param: "customer"},
		{name: "unknown price", set: []string{"items[0][price]", "price_nope"}, param: "items[0][price]", msg: "No such price: 'price_nope'"},
		{name: "another account's price", set: []string{"items[0][price]", elsewhere}, param: "items[0][price]"},
		{name: "one-time price", set: []string{"items[0][price]", oneTime}, param: "items[0][price]"},
		{name: "licensed price", set: []string{"items[0][price]", licensed}, param: "items[0][price]"},
		{name: "mixed intervals", set: []string{"items[1][price]", yearly}, param: "items",
			msg: "Currency and interval fields must match across all plans on this subscription. Found mismatch in interval field."},
		{name: "one price twice", set: []string{"items[1][price]", monthly}, param: "items"},
		{name: "a quantity for a metered price", set: []string{"items[0][quantity]", "3"}, param: "items[0][quantity]",
			msg: "You cannot set the quantity for metered plans."},
		{name: "an anchor in the past", set: []string{"billing_cycle_anchor", at(-1)}, param: "billing_cycle_anchor"},
		{name: "an anchor past the next natural billing date", set: []string{"billing_cycle_anchor", at(32)}, param: "billing_cycle_anchor"},
		{name: "a backdate in the future", set: []string{"backdate_start_date", at(1)}, param: "backdate_start_date"},
		{name: "an unknown parameter", set: []string{"trial_period_days", "3"}, param: "trial_period_days"},
	} {
		r := do(t, ts, http.MethodPost, "/v1/subscriptions", testKey, without(ok, c.remove, c.set...), nil)
		assert.Equal(t, http.StatusBadRequest, r.status, c.name)
		assert.Equal(t, "invalid_request_error", r.errField("type"), c.name)
		assert.Equal(t, c.param, r.errField("param"), c.name)
		if c.msg != "" {
			assert.Equal(t, c.msg, r.errField("message"), c.name)
		}
	}
	r := do(t, ts, http.MethodGet, "/v1/subscriptions", testKey, url.Values{"status": {"all"}}, nil)
	require.Equal(t, http.StatusOK, r.status)
	assert.Empty(t, r.body["data"])
	assert.Empty(t, sim.BillingEvents(acct))
}

// A subscription is answered in API version 2025-03-31.basil's shape: its
// items embed the full price and carry current_period_start and
// current_period_end ("Subscription items now track their respective
// billing periods directly", changelog "Adds subscription item-level
// billing periods"). Without an anchor the period starts now and the
// anchor is now; a backdated one starts at backdate_start_date (start_date)
// and runs to one interval after now, its billing cycle anchor "the current
// date" (docs.stripe.com/billing/subscriptions/backdating).
func TestSubscriptionCreateRetrieveList(t *testing.T) {
	t.Parallel()
	now := day(2026, 3, 10, 12, 0)
	sim, ts, _ := newBillingSim(t, now)
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	price := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "2"})
	sim.CreateCustomer(acct, "cus_acme")
	sim.CreateCustomer(acct, "cus_beta")
	sc, ctx := client(ts, testKey), context.Background()

	plain := subscribe(t, sc, "cus_acme", zeroTime, zeroTime, price)
	assert.Regexp(t, `^sub_`, plain.ID)
	assert.Equal(t, stripe.SubscriptionStatusActive, plain.Status)
	assert.Equal(t, "cus_acme", plain.Customer.ID)
	assert.Equal(t, unix(now), plain.StartDate)
	assert.Equal(t, unix(now), plain.BillingCycleAnchor)
	require.Len(t, plain.Items.Data, 1)
	it := plain.Items.Data[0]
	assert.Regexp(t, `^si_`, it.ID)
	assert.Equal(t, price, it.Price.ID)
	assert.Equal(t, meter.ID, it.Price.Recurring.Meter, "the full price")
	assert.Equal(t, unix(now), it.CurrentPeriodStart)
	assert.Equal(t, unix(day(2026, 4, 10, 12, 0)), it.CurrentPeriodEnd)
	assert.Equal(t, plain.ID, it.Subscription)

	back := subscribe(t, sc, "cus_beta", zeroTime, day(2026, 3, 1, 0, 0), price)
	assert.Equal(t, unix(day(2026, 3, 1, 0, 0)), back.StartDate)
	assert.Equal(t, unix(now), back.BillingCycleAnchor)
	assert.Equal(t, unix(day(2026, 3, 1, 0, 0)), back.Items.Data[0].CurrentPeriodStart)
	assert.Equal(t, unix(day(2026, 4, 10, 12, 0)), back.Items.Data[0].CurrentPeriodEnd)

	got, err := sc.V1Subscriptions.Retrieve(ctx, back.ID, nil)
	require.NoError(t, err)
	assert.Equal(t, back.Items.Data[0].ID, got.Items.Data[0].ID)
	_, err = sc.V1Subscriptions.Retrieve(ctx, "sub_nope", nil)
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode)
	_, err = client(ts, liveKey).V1Subscriptions.Retrieve(ctx, back.ID, nil)
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode, "a test subscription is unknown to a live key")

	third := sim.CreateSubscription(acct, stripesim.SubscriptionSpec{Customer: "cus_acme", Prices: []string{price}})
	var ids []string
	for sub, err := range sc.V1Subscriptions.List(ctx, &stripe.SubscriptionListParams{ListParams: stripe.ListParams{Limit: stripe.Int64(2)}}) {
		require.NoError(t, err)
		ids = append(ids, sub.ID)
	}
	assert.Equal(t, []string{third, back.ID, plain.ID}, ids, "newest first, two to a page")
	r := do(t, ts, http.MethodGet, "/v1/subscriptions", testKey, url.Values{"customer": {"cus_acme"}, "limit": {"1"}}, nil)
	require.Equal(t, http.StatusOK, r.status)
	assert.Equal(t, true, r.body["has_more"])
	assert.Equal(t, third, r.body["data"].([]any)[0].(map[string]any)["id"])
	r = do(t, ts, http.MethodGet, "/v1/subscriptions", testKey, url.Values{"customer": {"cus_acme"}, "starting_after": {third}}, nil)
	assert.Equal(t, plain.ID, r.body["data"].([]any)[0].(map[string]any)["id"])
	assert.Equal(t, false, r.body["has_more"])
	r = do(t, ts, http.MethodGet, "/v1/subscriptions", testKey, url.Values{"status": {"sleeping"}}, nil)
	assert.Equal(t, http.StatusBadRequest, r.status)
	assert.Equal(t, "status", r.errField("param"))
}
