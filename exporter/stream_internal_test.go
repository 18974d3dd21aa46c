package exporter

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
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

// fakeStream is a stream host that answers every multi-event request with
// status (and body), every single-event request with 200 — or, for the
// identifier duplicate, with status and body too — and sessions with a
// fresh token; it counts sessions and requests.
type fakeStream struct {
	status            int
	body              string
	duplicate         string
	sessions, streams atomic.Int64
}

func (f *fakeStream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	switch r.URL.Path {
	case "/v2/billing/meter_event_session":
		n := f.sessions.Add(1)
		now := time.Now().UTC()
		fmt.Fprintf(w, `{"id":"mes_%d","object":"v2.billing.meter_event_session","authentication_token":"mesk_test_tok%d","created":%q,"expires_at":%q,"livemode":false}`,
			n, n, now.Format(time.RFC3339), now.Add(15*time.Minute).Format(time.RFC3339))
	case "/v2/billing/meter_event_stream":
		f.streams.Add(1)
		var req struct {
			Events []struct {
				Identifier string `json:"identifier"`
			} `json:"events"`
		}
		_ = json.NewDecoder(r.Body).Decode(&req)
		if len(req.Events) > 1 || f.status == http.StatusUnauthorized ||
			(f.duplicate != "" && req.Events[0].Identifier == f.duplicate) {
			w.WriteHeader(f.status)
			_, _ = io.WriteString(w, f.body)
			return
		}
		_, _ = io.WriteString(w, `{}`)
	default:
		http.NotFound(w, r)
	}
}

func fakeStreamExporter(t *testing.T, f *fakeStream) *StripeStream {
	t.Helper()
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL, MeterEventsBase: srv.URL})
	require.NoError(t, err)
	return NewStripeStream(client, 2*time.Second)
}

func leasesOf(n int) []outbox.Lease {
	out := make([]outbox.Lease, n)
	for i := range out {
		out[i].Payload = outbox.Payload{EventName: "logins", Customer: "cus_1", Value: 1, Timestamp: time.Now().Unix(),
			Identifier: fmt.Sprintf("tly_fake_%d", i)}
	}
	return out
}

// A 400 to a request of several events processed none of them, whatever it
// says — even Stripe's duplicate-identifier message, which for one v1 call
// means success: the request is split until each event is answered alone.
func TestStreamSplitsEvenADuplicateAnswer(t *testing.T) {
	t.Parallel()
	f := &fakeStream{status: http.StatusBadRequest,
		body: `{"error":{"type":"invalid_request_error","code":"","message":"An event already exists with identifier tly_fake_0."}}`}
	out := fakeStreamExporter(t, f).SendBatch(context.Background(), leasesOf(5), nil)
	for i, o := range out {
		require.Equal(t, outbox.Accepted, o.Kind, "item %d: %+v", i, o)
	}
	// 5 events: the whole, then halves down to singles — 1 + 2 + 2 (of the
	// 3-event half: 1 + 2) + the singles' own requests.
	require.Greater(t, f.streams.Load(), int64(5), "every event was answered on its own")
}

// Stripe's coded duplicate (v2's duplicate_meter_event) refuses a request
// of several events as a whole: it is split, and the event Stripe has
// already, answered alone with the code, is accepted like the others.
func TestStreamAcceptsACodedDuplicate(t *testing.T) {
	t.Parallel()
	f := &fakeStream{status: http.StatusBadRequest, duplicate: "tly_fake_2",
		body: `{"error":{"type":"invalid_request_error","code":"duplicate_meter_event","message":"A meter event with a duplicate identifier has already been submitted."}}`}
	out := fakeStreamExporter(t, f).SendBatch(context.Background(), leasesOf(5), nil)
	for i, o := range out {
		require.Equal(t, outbox.Accepted, o.Kind, "item %d: %+v", i, o)
	}
}

// A 401 of the stream itself is the session's, not the key's: the exporter
// renews the session, and when the stream keeps refusing, the items are
// retried as refused under stream_session — never stripe_auth, which would
// report the API key refused.
func TestStreamUnauthorizedIsTheSessions(t *testing.T) {
	t.Parallel()
	f := &fakeStream{status: http.StatusUnauthorized,
		body: `{"error":{"type":"invalid_request_error","code":"unauthorized","message":"The token is not valid."}}`}
	out := fakeStreamExporter(t, f).SendBatch(context.Background(), leasesOf(3), nil)
	for _, o := range out {
		require.Equal(t, outbox.Retry, o.Kind, "%+v", o)
		require.True(t, o.Refused)
		require.Equal(t, "stream_session", o.Error.Code)
	}
	require.Equal(t, int64(sessionTries), f.sessions.Load(), "a new session for every try")
}

// Of several outcomes for one item in a recorder batch (the item was
// claimed again while its earlier outcome waited), the latest lease's is
// kept: outbox.Record refuses a batch naming an item twice.
func TestLatestOutcomePerItem(t *testing.T) {
	t.Parallel()
	d := &Deliverer{logger: slog.New(slog.DiscardHandler)}
	lease := func(id, token int64) outbox.Lease {
		return outbox.Lease{Item: outbox.Item{ID: id, LeaseToken: token}}
	}
	got := d.latestPerItem([]outbox.Outcome{
		{Lease: lease(1, 1), Kind: outbox.Retry},
		{Lease: lease(2, 5), Kind: outbox.Accepted},
		{Lease: lease(1, 2), Kind: outbox.Accepted},
		{Lease: lease(2, 4), Kind: outbox.Retry},
	})
	require.Len(t, got, 2)
	require.Equal(t, int64(2), got[0].Lease.LeaseToken)
	require.Equal(t, outbox.Accepted, got[0].Kind)
	require.Equal(t, int64(5), got[1].Lease.LeaseToken)
}
