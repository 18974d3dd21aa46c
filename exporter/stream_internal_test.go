package exporter

import (
	"context"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/outbox"
)

// The session is replaced a minute before Stripe's expiry, by the local
// clock, before Stripe ever answers that it expired: no request meets an
// expired session when both clocks agree.
func TestStreamRenewsTheSessionBeforeItExpires(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	now := time.Now()
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); defer mu.Unlock(); now = now.Add(d) }

	sim := stripesim.New(stripesim.Options{Seed: 3, Now: clock})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_1")
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL, MeterEventsBase: srv.URL})
	require.NoError(t, err)
	e := NewStripeStream(client, 2*time.Second)
	e.now = clock

	send := func(id string) {
		t.Helper()
		o := e.Send(context.Background(), outbox.Lease{Item: outbox.Item{Payload: outbox.Payload{
			EventName: "logins", Customer: "cus_1", Value: 1, Timestamp: clock().Add(-time.Minute).Unix(), Identifier: id}}})
		require.Equal(t, outbox.Accepted, o.Kind, "%+v", o)
	}
	send("tly_renew_1")
	advance(13 * time.Minute)
	send("tly_renew_2") // the first session, still well inside its 15 minutes
	require.Equal(t, 1.0, testutil.ToFloat64(e.Collector()))
	advance(90 * time.Second) // 14m30s: inside Stripe's 15 minutes, past the renewal point
	send("tly_renew_3")
	require.Equal(t, 2.0, testutil.ToFloat64(e.Collector()), "renewed before the expiry")
	for _, rq := range sim.Requests() {
		require.NotEqual(t, 401, rq.Status, "no request met an expired session")
	}
	require.Len(t, sim.Events(stripesim.DefaultAccount), 3)
}
