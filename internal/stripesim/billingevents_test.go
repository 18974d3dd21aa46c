package stripesim_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"
	"github.com/stripe/stripe-go/v82/webhook"

	"github.com/tallymeter/tally/internal/stripesim"
)

// eventsOf lists, through stripe-go, the v1 events params selects.
func eventsOf(t *testing.T, sc *stripe.Client, params *stripe.EventListParams) []*stripe.Event {
	t.Helper()
	var out []*stripe.Event
	for ev, err := range sc.V1Events.List(context.Background(), params) {
		require.NoError(t, err)
		out = append(out, ev)
	}
	return out
}

func typesOf(evs []*stripe.Event) []stripe.EventType {
	out := make([]stripe.EventType, len(evs))
	for i, ev := range evs {
		out[i] = ev.Type
	}
	return out
}

// A subscription's life is told in v1 snapshot events (stripe-go's
// EventTypeCustomerSubscription* and EventTypeInvoice*), data.object the
// object as it was, an update's data.previous_attributes the fields it
// changed — the items' periods at a renewal ("previous_attributes on the
// customer.subscription.updated webhook now include that the subscription
// item's billing period has changed", changelog 2025-03-31.basil). GET
// /v1/events lists them with the meter events, newest first, by type
// ("a group of events using * as a wildcard") or types, "going back up to
// 30 days" (stripe-go EventListParams); an event caused by a request names
// it. A connected account's events carry "account" and are its own.
func TestBillingEventsEmittedAndListed(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newBillingSim(t, day(2026, 3, 1, 0, 0))
	meter := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	price := sim.CreatePrice(acct, stripesim.PriceSpec{Meter: meter.ID, UnitAmountDecimal: "1"})
	sim.CreateCustomer(acct, "cus_acme")
	theirs := sim.CreatePrice(connected, stripesim.PriceSpec{
		Meter: sim.CreateMeter(connected, stripesim.MeterSpec{EventName: "api_calls"}).ID, UnitAmountDecimal: "1"})
	sim.CreateCustomer(connected, "cus_acme")
	sc, ctx := client(ts, testKey), context.Background()

	anchor := day(2026, 3, 10, 0, 0)
	cp := &stripe.SubscriptionCreateParams{Customer: stripe.String("cus_acme"), BillingCycleAnchor: stripe.Int64(unix(anchor)),
		Items: []*stripe.SubscriptionCreateItemParams{{Price: stripe.String(price)}}}
	cp.SetIdempotencyKey("create-sub-1")
	sub, err := sc.V1Subscriptions.Create(ctx, cp)
	require.NoError(t, err)
	theirSub := sim.CreateSubscription(connected, stripesim.SubscriptionSpec{Customer: "cus_acme", Prices: []string{theirs},
		BillingCycleAnchor: anchor})
	clk.Set(day(2026, 3, 2, 0, 0))
	usage(t, sc, "", "api_calls", "cus_acme", 3, clk.Now())
	clk.Set(anchor.Add(time.Hour + time.Second))

	evs := eventsOf(t, sc, nil)
	assert.Equal(t, []stripe.EventType{
		stripe.EventTypeInvoiceFinalized, stripe.EventTypeCustomerSubscriptionUpdated, stripe.EventTypeInvoiceCreated,
		stripe.EventTypeCustomerSubscriptionCreated, stripe.EventTypeBillingMeterCreated,
	}, typesOf(evs), "newest first, the meter's event too")
	for _, ev := range evs {
		assert.Regexp(t, `^evt_test_`, ev.ID)
		assert.Equal(t, "event", ev.Object)
		assert.Empty(t, ev.Account, "the key's own account")
	}

	created := evs[3]
	assert.Regexp(t, `^req_`, created.Request.ID, "caused by the create request")
	assert.Equal(t, "create-sub-1", created.Request.IdempotencyKey)
	var s stripe.Subscription
	require.NoError(t, json.Unmarshal(created.Data.Raw, &s))
	assert.Equal(t, sub.ID, s.ID)
	assert.Equal(t, unix(day(2026, 3, 1, 0, 0)), s.Items.Data[0].CurrentPeriodStart, "as it was")

	renewed := evs[1]
	assert.Empty(t, renewed.Request.ID, "Stripe's own doing")
	assert.Equal(t, unix(anchor), renewed.Created)
	assert.Contains(t, renewed.Data.PreviousAttributes, "items")
	assert.Contains(t, renewed.Data.PreviousAttributes, "latest_invoice")
	assert.NotContains(t, renewed.Data.PreviousAttributes, "customer", "only what changed")
	require.NoError(t, json.Unmarshal(renewed.Data.Raw, &s))
	assert.Equal(t, unix(anchor), s.Items.Data[0].CurrentPeriodStart)

	var inv stripe.Invoice
	require.NoError(t, json.Unmarshal(evs[2].Data.Raw, &inv))
	assert.Equal(t, stripe.InvoiceStatusDraft, inv.Status)
	require.NoError(t, json.Unmarshal(evs[0].Data.Raw, &inv))
	assert.Equal(t, stripe.InvoiceStatusOpen, inv.Status)
	assert.EqualValues(t, 3, inv.Total)
	assert.Equal(t, sub.ID, inv.Parent.SubscriptionDetails.Subscription.ID)
	assert.Equal(t, unix(anchor.Add(time.Hour)), evs[0].Created)

	assert.Equal(t, []stripe.EventType{stripe.EventTypeInvoiceFinalized, stripe.EventTypeInvoiceCreated},
		typesOf(eventsOf(t, sc, &stripe.EventListParams{Type: stripe.String("invoice.*")})))
	assert.Equal(t, []stripe.EventType{stripe.EventTypeCustomerSubscriptionUpdated, stripe.EventTypeCustomerSubscriptionCreated},
		typesOf(eventsOf(t, sc, &stripe.EventListParams{Types: stripe.StringSlice([]string{
			"customer.subscription.created", "customer.subscription.updated"})})))
	assert.Len(t, eventsOf(t, sc, &stripe.EventListParams{CreatedRange: &stripe.RangeQueryParams{
		GreaterThanOrEqual: unix(anchor)}}), 3)
	assert.Len(t, eventsOf(t, sc, &stripe.EventListParams{ListParams: stripe.ListParams{Limit: stripe.Int64(2)}}), 5, "two to a page")
	r := do(t, ts, http.MethodGet, "/v1/events", testKey, url.Values{"type": {"invoice.created"}, "types[0]": {"invoice.created"}}, nil)
	assert.Equal(t, http.StatusBadRequest, r.status, "type or types, not both")

	got, err := sc.V1Events.Retrieve(ctx, evs[2].ID, nil)
	require.NoError(t, err)
	assert.Equal(t, stripe.EventTypeInvoiceCreated, got.Type)
	_, err = sc.V1Events.Retrieve(ctx, "evt_nope", nil)
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode)
	assert.Empty(t, eventsOf(t, client(ts, liveKey), nil), "a live key sees no test events")

	lp := &stripe.EventListParams{}
	lp.SetStripeAccount(connected)
	theirEvs := eventsOf(t, sc, lp)
	require.Len(t, theirEvs, 5)
	for _, ev := range theirEvs {
		assert.Equal(t, connected, ev.Account)
	}
	require.NoError(t, json.Unmarshal(theirEvs[3].Data.Raw, &s))
	assert.Equal(t, theirSub, s.ID)
	_, err = sc.V1Events.Retrieve(ctx, theirEvs[0].ID, nil)
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode, "another account's event")

	clk.Set(day(2026, 4, 5, 0, 0))
	assert.Len(t, eventsOf(t, sc, nil), 3, "the events of March 1 are more than 30 days old, March 10's are not")
	_, err = sc.V1Events.Retrieve(ctx, created.ID, nil)
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode)
}

// DeliverBillingEvents posts an account's billing events, oldest first, as
// signed snapshot events that stripe-go's webhook.ConstructEvent reads, each
// once; an invoice.updated tells an auto_advance change, and a connected
// account's events carry "account".
func TestDeliverBillingEvents(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newBillingSim(t, day(2026, 3, 1, 0, 0))
	price := sim.CreatePrice(connected, stripesim.PriceSpec{
		Meter: sim.CreateMeter(connected, stripesim.MeterSpec{EventName: "api_calls"}).ID, UnitAmountDecimal: "1"})
	sim.CreateCustomer(connected, "cus_acme")
	sub := sim.CreateSubscription(connected, stripesim.SubscriptionSpec{Customer: "cus_acme", Prices: []string{price}})
	clk.Set(day(2026, 4, 1, 0, 30))
	sc := client(ts, testKey)
	inv := sim.Invoices(connected)[0]
	up := &stripe.InvoiceUpdateParams{AutoAdvance: stripe.Bool(false)}
	up.SetStripeAccount(connected)
	_, err := sc.V1Invoices.Update(context.Background(), inv.ID, up)
	require.NoError(t, err)

	const secret = "whsec_test_billing"
	var mu sync.Mutex
	var got []stripe.Event
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		ev, err := webhook.ConstructEvent(body, r.Header.Get("Stripe-Signature"), secret)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		mu.Lock()
		got = append(got, ev)
		mu.Unlock()
	}))
	defer recv.Close()
	n, err := sim.DeliverBillingEvents(context.Background(), connected, recv.URL, secret)
	require.NoError(t, err)
	assert.Equal(t, 4, n)
	n, err = sim.DeliverBillingEvents(context.Background(), connected, recv.URL, secret)
	require.NoError(t, err)
	assert.Zero(t, n, "delivered once")
	require.Len(t, got, 4)
	assert.Equal(t, []stripe.EventType{stripe.EventTypeCustomerSubscriptionCreated, stripe.EventTypeInvoiceCreated,
		stripe.EventTypeCustomerSubscriptionUpdated, stripe.EventTypeInvoiceUpdated}, typesOf([]*stripe.Event{&got[0], &got[1], &got[2], &got[3]}))
	for _, ev := range got {
		assert.Equal(t, connected, ev.Account)
	}
	assert.Equal(t, sub, got[0].Data.Object["id"])
	assert.Equal(t, false, got[3].Data.Object["auto_advance"])
	assert.Equal(t, true, got[3].Data.PreviousAttributes["auto_advance"])
	assert.Len(t, sim.BillingEvents(connected), 4)
	assert.Empty(t, sim.BillingEvents(acct))
}
