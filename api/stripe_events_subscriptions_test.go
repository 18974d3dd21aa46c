package api_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// A customer.subscription.* event from the snapshot destination makes
// Tally read the customer's subscriptions at once: a new subscription's
// anchor becomes its tenant's. A customer no tenant maps is foreign, a read
// Stripe fails is a 502 for Stripe to deliver again, and without a reader
// the event is ignored.
func TestSubscriptionEventsReadTheCustomersSubscriptions(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{stripesim.DefaultKey: "acct_1"}})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	meter := sim.CreateMeter("acct_1", stripesim.MeterSpec{EventName: "api_calls"})
	cus := sim.CreateCustomer("acct_1", "")
	stranger := sim.CreateCustomer("acct_1", "")
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	lister := mappings.StripeMeters{Client: client}
	read := true
	h := newHarnessWith(t, true, func(d *api.Deps) {
		dest := func() (exporter.Destination, error) {
			return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: "acct_1", Mode: outbox.ModeTest}, nil
		}
		connected := func(context.Context, pgdb.Querier) ([]string, error) { return nil, nil }
		events, err := reconcile.NewEvents(reconcile.EventsConfig{Outbox: d.Outbox, Destination: dest, Connected: connected,
			Logger: slog.New(slog.DiscardHandler)})
		require.NoError(t, err)
		d.Webhook = &api.WebhookDeps{Secret: webhookSecret + ", " + snapshotSecret, Events: events, Fetch: client.Event,
			Subscriptions: func(ctx context.Context, db pgdb.Beginner, customer string) (int, error) {
				if !read {
					return 0, &mappings.ErrProviderUnavailable{Code: "api_error", Status: 500}
				}
				return d.Mappings.SyncCustomer(ctx, db, lister, customer)
			}}
	})
	_, err = h.pool.Exec(h.ctx, `INSERT INTO stripe_meters (account, mode, id, event_name, status, formula)
		VALUES ('acct_1', 'test', $1, 'api_calls', 'active', 'sum')`, meter.ID)
	require.NoError(t, err)
	maps := h.parts.Mappings
	_, _, err = maps.PutFeature(h.ctx, h.pool, "api", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum}, "alice")
	require.NoError(t, err)
	_, _, err = maps.PutTenant(h.ctx, h.pool, "acme", mappings.TenantInput{StripeCustomerID: cus}, "alice")
	require.NoError(t, err)

	anchor := time.Now().UTC().Add(9 * 24 * time.Hour).Truncate(time.Second)
	price := sim.CreatePrice("acct_1", stripesim.PriceSpec{Currency: "usd", UnitAmountDecimal: "3", Meter: meter.ID})
	sim.CreateSubscription("acct_1", stripesim.SubscriptionSpec{Customer: cus, Prices: []string{price}, BillingCycleAnchor: anchor})
	created := lastBillingEvent(t, sim, stripesim.EventSubscriptionCreated)

	post := func(e stripesim.BillingEvent) response {
		t.Helper()
		body, sig := stripesim.SignedBillingEvent(e, snapshotSecret, time.Now())
		return postSigned(t, h, body, sig)
	}
	read = false
	resp := post(created)
	require.Equal(t, http.StatusBadGateway, resp.status, "%s", resp)
	read = true
	resp = post(created)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.JSONEq(t, `{"status":"subscriptions_read"}`, string(resp.body))
	tn, err := maps.GetTenant(h.ctx, h.pool, "acme")
	require.NoError(t, err)
	require.NotNil(t, tn.PeriodAnchor)
	require.True(t, anchor.Equal(*tn.PeriodAnchor), "anchor %s, want %s", tn.PeriodAnchor, anchor)
	require.Equal(t, mappings.ActorStripe, tn.UpdatedBy)

	sim.CreateSubscription("acct_1", stripesim.SubscriptionSpec{Customer: stranger, Prices: []string{price}, BillingCycleAnchor: anchor})
	resp = post(lastBillingEvent(t, sim, stripesim.EventSubscriptionCreated))
	require.JSONEq(t, `{"status":"foreign"}`, string(resp.body), "no tenant maps the customer")
}

// lastBillingEvent is the newest of sim's v1 billing events of type typ.
func lastBillingEvent(t *testing.T, sim *stripesim.Server, typ string) stripesim.BillingEvent {
	t.Helper()
	evs := sim.BillingEvents("acct_1")
	for i := len(evs) - 1; i >= 0; i-- {
		if evs[i].Type == typ {
			return evs[i]
		}
	}
	t.Fatalf("no %s event", typ)
	return stripesim.BillingEvent{}
}

// An invoice.* event makes Tally read the invoice with its lines and keep
// it: invoice_read. A customer no tenant maps is foreign; a read Stripe
// fails is a 502.
func TestInvoiceEventsReadTheInvoice(t *testing.T) {
	t.Parallel()
	clock := &stripesim.MovedClock{}
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{stripesim.DefaultKey: "acct_1"}, Now: clock.Now})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	meter := sim.CreateMeter("acct_1", stripesim.MeterSpec{EventName: "api_calls"})
	cus := sim.CreateCustomer("acct_1", "")
	stranger := sim.CreateCustomer("acct_1", "")
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	h := newHarnessWith(t, true, func(d *api.Deps) {
		dest := func() (exporter.Destination, error) {
			return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: "acct_1", Mode: outbox.ModeTest}, nil
		}
		connected := func(context.Context, pgdb.Querier) ([]string, error) { return nil, nil }
		events, err := reconcile.NewEvents(reconcile.EventsConfig{Outbox: d.Outbox, Destination: dest, Connected: connected,
			Logger: slog.New(slog.DiscardHandler)})
		require.NoError(t, err)
		d.Webhook = &api.WebhookDeps{Secret: snapshotSecret, Events: events, Fetch: client.Event,
			Invoices: func(ctx context.Context, db pgdb.Beginner, customer, invoice string) (int, error) {
				r, err := invoices.Receive(ctx, db, invoices.Stripe{Client: client}, d.Mappings, customer, invoice)
				return r.Recorded, err
			}}
	})
	_, _, err = h.parts.Mappings.PutTenant(h.ctx, h.pool, "acme", mappings.TenantInput{StripeCustomerID: cus}, "alice")
	require.NoError(t, err)
	price := sim.CreatePrice("acct_1", stripesim.PriceSpec{UnitAmountDecimal: "3", Meter: meter.ID})
	anchor := clock.Now().UTC().Add(2 * 24 * time.Hour).Truncate(time.Second)
	for _, c := range []string{cus, stranger} {
		sim.CreateSubscription("acct_1", stripesim.SubscriptionSpec{Customer: c, Prices: []string{price}, BillingCycleAnchor: anchor})
	}
	clock.Add(anchor.Sub(clock.Now()) + time.Minute)
	sim.AdvanceBilling()
	var mine, theirs stripesim.BillingEvent
	for _, e := range sim.BillingEvents("acct_1") {
		if e.Type != stripesim.EventInvoiceCreated {
			continue
		}
		if strings.Contains(string(e.Object), cus) {
			mine = e
		} else {
			theirs = e
		}
	}
	require.NotEmpty(t, mine.ID)
	require.NotEmpty(t, theirs.ID)
	post := func(e stripesim.BillingEvent) response {
		t.Helper()
		body, sig := stripesim.SignedBillingEvent(e, snapshotSecret, time.Now())
		return postSigned(t, h, body, sig)
	}
	resp := post(mine)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.JSONEq(t, `{"status":"invoice_read"}`, string(resp.body))
	var status string
	require.NoError(t, h.pool.QueryRow(h.ctx, `SELECT status FROM stripe_invoices WHERE customer = $1`, cus).Scan(&status))
	require.Equal(t, "draft", status)
	require.JSONEq(t, `{"status":"foreign"}`, string(post(theirs).body))

	sim.Configure("acct_1", stripesim.Limits{Faults: stripesim.Faults{ReadFault: 1}})
	require.Equal(t, http.StatusBadGateway, post(mine).status)
}
