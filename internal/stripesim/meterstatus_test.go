package stripesim_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"
	"github.com/stripe/stripe-go/v82/webhook"

	"github.com/tallymeter/tally/internal/stripesim"
)

// Stripe sends billing.meter.created, .deactivated and .reactivated v1
// events (stripe-go event.go, EventTypeBillingMeter*), whose data.object is
// the meter as it was; an event of a connected account names it in
// "account" (Stripe's Event object, "account"). An event destination with
// the snapshot payload style posts them signed, and stripe-go's
// webhook.ConstructEvent reads them.
func TestMeterStatusEvents(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	ctx := context.Background()
	sc := client(ts, testKey)

	m, err := sc.V1BillingMeters.Create(ctx, &stripe.BillingMeterCreateParams{DisplayName: stripe.String("API"),
		EventName: stripe.String("api_calls"), DefaultAggregation: &stripe.BillingMeterCreateDefaultAggregationParams{
			Formula: stripe.String("sum")}})
	require.NoError(t, err)
	_, err = sc.V1BillingMeters.Deactivate(ctx, m.ID, nil)
	require.NoError(t, err)
	require.NoError(t, sim.ReactivateMeter(acct, m.ID))
	require.NoError(t, sim.ReactivateMeter(acct, m.ID), "already active: no-op")

	connected := sim.CreateMeter("acct_connected", stripesim.MeterSpec{EventName: "api_calls"})
	require.NoError(t, sim.DeactivateMeter("acct_connected", connected.ID))

	evs := sim.MeterEvents(acct)
	require.Len(t, evs, 3)
	for i, typ := range []string{stripesim.EventMeterCreated, stripesim.EventMeterDeactivated, stripesim.EventMeterReactivated} {
		assert.Equal(t, typ, evs[i].Type)
		assert.Equal(t, m.ID, evs[i].Meter.ID)
		assert.Empty(t, evs[i].Account, "the key's own account")
	}
	assert.Equal(t, stripesim.MeterInactive, evs[1].Meter.Status, "the meter as it was")
	cevs := sim.MeterEvents("acct_connected")
	require.Len(t, cevs, 2)
	assert.Equal(t, "acct_connected", cevs[1].Account)

	const secret = "whsec_test_meters"
	var got []stripe.Event
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		ev, err := webhook.ConstructEvent(body, r.Header.Get("Stripe-Signature"), secret)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		got = append(got, ev)
	}))
	defer recv.Close()
	n, err := sim.DeliverMeterEvents(ctx, "acct_connected", recv.URL, secret)
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	n, err = sim.DeliverMeterEvents(ctx, "acct_connected", recv.URL, secret)
	require.NoError(t, err)
	assert.Zero(t, n, "delivered once")
	require.Len(t, got, 2)
	assert.Equal(t, stripe.EventTypeBillingMeterDeactivated, got[1].Type)
	assert.Equal(t, "acct_connected", got[1].Account)
	assert.Equal(t, connected.ID, got[1].Data.Object["id"])
	assert.Equal(t, "inactive", got[1].Data.Object["status"])
	assert.WithinDuration(t, time.Now(), time.Unix(got[1].Created, 0), time.Minute)
}
