package stripesim_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

const connected = "acct_1Connected"

// newEventsSim starts a simulator on a movable clock whose platform acct
// and connected account each have a meter and a customer, with options
// opts (its Keys and Now are set here).
func newEventsSim(t *testing.T, opts stripesim.Options) (*stripesim.Server, *httptest.Server, *clock) {
	t.Helper()
	clk := &clock{t: base}
	opts.Keys, opts.Now = map[string]string{testKey: acct, liveKey: acct}, clk.Now
	sim := stripesim.New(opts)
	ts := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); ts.Close() })
	sim.AddAccount(connected)
	for _, a := range []string{acct, connected} {
		sim.CreateMeter(a, stripesim.MeterSpec{EventName: "api_calls", Formula: "sum"})
		sim.CreateCustomer(a, "cus_acme")
		sim.Configure(a, stripesim.Limits{AsyncValidation: true})
	}
	return sim, ts, clk
}

// failEvent sends a v1 meter event for a customer account does not have,
// with the Idempotency-Key key: Stripe answers 200 and reports it.
func failEvent(t *testing.T, ts *httptest.Server, account, ident, key string, at time.Time) response {
	t.Helper()
	h := map[string]string{"Idempotency-Key": key}
	if account != acct {
		h["Stripe-Account"] = account
	}
	r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_ghost", ident, "1", at), h)
	require.Equal(t, http.StatusOK, r.status, r.body)
	return r
}

// sampleRequest is the request of the first sample of a full event.
func sampleRequest(t *testing.T, ev map[string]any) map[string]any {
	t.Helper()
	types := ev["data"].(map[string]any)["reason"].(map[string]any)["error_types"].([]any)
	samples := types[0].(map[string]any)["sample_errors"].([]any)
	return samples[0].(map[string]any)["request"].(map[string]any)
}

// A thin event about a connected account carries its context, and its
// full event is served only to a request naming that context in
// Stripe-Context: the worst plausible reading of "the authentication
// context needed to fetch the event"
// (docs.stripe.com/api/v2/core/events/event-types; docs/stripe.md).
// Stripe-Context supersedes Stripe-Account (docs.stripe.com/context).
func TestEventContext(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newEventsSim(t, stripesim.Options{})
	failEvent(t, ts, acct, "own-1", "own-1-a1", base.Add(-time.Hour))
	failEvent(t, ts, connected, "conn-1", "conn-1-a1", base.Add(-time.Hour))
	own, conn := sim.ErrorReports(acct), sim.ErrorReports(connected)
	require.Len(t, own, 1)
	require.Len(t, conn, 1)
	assert.Empty(t, own[0].Context, "the key's own account: no context")
	assert.Equal(t, connected, conn[0].Context)

	body, _ := stripesim.SignedThinEvent(conn[0], "whsec_x", time.Now())
	assert.Contains(t, string(body), `"context":"`+connected+`"`)
	body, _ = stripesim.SignedThinEvent(own[0], "whsec_x", time.Now())
	assert.Contains(t, string(body), `"context":null`)

	path := "/v2/core/events/" + conn[0].ID
	assert.Equal(t, http.StatusNotFound, do(t, ts, http.MethodGet, path, testKey, nil, nil).status, "the platform has no such event")
	assert.Equal(t, http.StatusNotFound, do(t, ts, http.MethodGet, path, testKey, nil, map[string]string{"Stripe-Account": connected}).status,
		"Stripe-Account does not name an event's context")
	r := do(t, ts, http.MethodGet, path, testKey, nil, map[string]string{"Stripe-Context": connected})
	require.Equal(t, http.StatusOK, r.status, r.body)
	assert.Equal(t, connected, r.body["context"])
	r = do(t, ts, http.MethodGet, path, testKey, nil, map[string]string{"Stripe-Context": connected, "Stripe-Account": acct})
	assert.Equal(t, http.StatusOK, r.status, "Stripe-Context supersedes Stripe-Account")
	r = do(t, ts, http.MethodGet, path, testKey, nil, map[string]string{"Stripe-Context": "acct_1Org/" + connected})
	assert.Equal(t, http.StatusOK, r.status, "a context path names its last account")
	assert.Equal(t, http.StatusOK, do(t, ts, http.MethodGet, "/v2/core/events/"+own[0].ID, testKey, nil, nil).status)

	r = do(t, ts, http.MethodGet, path, testKey, nil, map[string]string{"Stripe-Context": "acct_1Unknown"})
	assert.Equal(t, http.StatusForbidden, r.status)
	assert.Equal(t, "account_invalid", r.errField("code"))
	sim.RevokeAccess(connected)
	assert.Equal(t, http.StatusForbidden, do(t, ts, http.MethodGet, path, testKey, nil, map[string]string{"Stripe-Context": connected}).status)

	var sent []string
	for _, rec := range sim.Requests() {
		if rec.StripeContext != "" {
			sent = append(sent, rec.StripeContext)
		}
	}
	assert.Contains(t, sent, connected, "the header is recorded")
}

// An error report's samples name the failed request in the shape
// Options.Samples says: Stripe's example payload by default
// ({"id", "idempotency_key"}, docs.stripe.com/billing/subscriptions/usage-based/recording-usage-api,
// "Example payloads"), stripe-go v82's {"identifier"}, or the request id
// alone; a v1 sample names the request's Idempotency-Key and Request-Id,
// a stream sample the event's identifier and the stream request's id.
func TestReportSampleShapes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		shape stripesim.SampleShape
		want  func(key, reqID string) map[string]any
	}{
		{"request by default", stripesim.SamplesRequest, func(key, reqID string) map[string]any {
			return map[string]any{"id": reqID, "idempotency_key": key}
		}},
		{"identifier", stripesim.SamplesIdentifier, func(key, _ string) map[string]any {
			return map[string]any{"identifier": key}
		}},
		{"request id alone", stripesim.SamplesRequestID, func(_, reqID string) map[string]any {
			return map[string]any{"id": reqID, "idempotency_key": ""}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			sim, ts, _ := newEventsSim(t, stripesim.Options{Samples: tc.shape})
			sent := failEvent(t, ts, acct, "ev-1", "ev-1-a1", base.Add(-time.Hour))
			reqID := sent.header.Get("Request-Id")
			rep := sim.ErrorReports(acct)[0]
			assert.Equal(t, []string{"ev-1-a1"}, rep.Identifiers)
			assert.Equal(t, []string{reqID}, rep.RequestIDs)
			r := do(t, ts, http.MethodGet, "/v2/core/events/"+rep.ID, testKey, nil, nil)
			require.Equal(t, http.StatusOK, r.status)
			assert.Equal(t, tc.want("ev-1-a1", reqID), sampleRequest(t, r.body))

			// The stream: the event's identifier, the request's id.
			stream, _ := streamClient(ts, newSession(t, ts, ""))
			require.NoError(t, stream.V2BillingMeterEventStreams.Create(context.Background(), streamParams(&stripe.V2BillingMeterEventStreamCreateEventParams{
				EventName: stripe.String("api_calls"), Identifier: stripe.String("st-1"),
				Payload: map[string]string{"stripe_customer_id": "cus_ghost", "value": "1"}, Timestamp: stripe.Time(base.Add(-time.Hour)),
			})))
			reps := sim.ErrorReports(acct)
			require.Len(t, reps, 2)
			rep = reps[1]
			assert.Equal(t, []string{"st-1"}, rep.Identifiers)
			var streamReq string
			for _, rec := range sim.Requests() {
				if rec.Path == "/v2/billing/meter_event_stream" {
					streamReq = rec.RequestID
				}
			}
			assert.Equal(t, []string{streamReq}, rep.RequestIDs)
			r = do(t, ts, http.MethodGet, "/v2/core/events/"+rep.ID, testKey, nil, nil)
			require.Equal(t, http.StatusOK, r.status)
			assert.Equal(t, tc.want("st-1", streamReq), sampleRequest(t, r.body))
		})
	}
}

// listIDs lists the events of GET /v2/core/events with form (and the
// headers), following next_page_url to the end, and returns their ids in
// order and how many pages it took.
func listIDs(t *testing.T, ts *httptest.Server, form url.Values, header map[string]string) ([]string, int) {
	t.Helper()
	var ids []string
	path, pages := "/v2/core/events", 0
	for path != "" {
		r := do(t, ts, http.MethodGet, path, testKey, form, header)
		require.Equal(t, http.StatusOK, r.status, r.body)
		pages++
		for _, e := range r.body["data"].([]any) {
			ids = append(ids, e.(map[string]any)["id"].(string))
		}
		next, _ := r.body["next_page_url"].(string)
		require.True(t, next == "" || strings.HasPrefix(next, "/v2/core/events?page="), next)
		path, form = next, nil
	}
	return ids, pages
}

// GET /v2/core/events lists an account's events (the Stripe-Context's,
// else the key's own) of the key's mode, newest first, going back 30 days,
// filtered by types[] and created[gt|gte|lt|lte], a page of limit at a
// time with next_page_url (docs.stripe.com/api/v2/core/events/list).
func TestListEvents(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newEventsSim(t, stripesim.Options{})
	var want []string // newest first
	for i := range 5 {
		failEvent(t, ts, acct, "ev-"+string(rune('a'+i)), "k-"+string(rune('a'+i)), base.Add(-time.Hour))
		want = append([]string{sim.ErrorReports(acct)[i].ID}, want...)
		clk.Add(time.Minute)
	}
	failEvent(t, ts, connected, "conn-1", "conn-1-a1", base.Add(-time.Hour))
	connID := sim.ErrorReports(connected)[0].ID

	ids, pages := listIDs(t, ts, url.Values{"limit": {"2"}}, nil)
	assert.Equal(t, want, ids)
	assert.Equal(t, 3, pages)
	ids, _ = listIDs(t, ts, nil, map[string]string{"Stripe-Context": connected})
	assert.Equal(t, []string{connID}, ids, "the connected account's, by its context")
	ids, _ = listIDs(t, ts, nil, map[string]string{"Stripe-Account": connected})
	assert.Equal(t, want, ids, "Stripe-Account does not name the events' context")
	r := do(t, ts, http.MethodGet, "/v2/core/events", liveKey, nil, nil)
	assert.Empty(t, r.body["data"], "another mode's events are not listed")

	// Filters: types (indexed, as newer stripe-go encodes them, or
	// repeated) and created, in RFC 3339.
	third := sim.ErrorReports(acct)[2].Created
	ids, _ = listIDs(t, ts, url.Values{"types[0]": {stripesim.ReportErrorTriggered}, "created[gt]": {third.Format(time.RFC3339)}, "limit": {"1"}}, nil)
	assert.Equal(t, want[:2], ids, "created after the third")
	ids, _ = listIDs(t, ts, url.Values{"types": {stripesim.ReportNoMeterFound}}, nil)
	assert.Empty(t, ids)
	ids, _ = listIDs(t, ts, url.Values{"created[gte]": {third.Format(time.RFC3339)}, "created[lt]": {third.Add(time.Minute).Format(time.RFC3339)}}, nil)
	assert.Equal(t, want[2:3], ids)
	assert.Equal(t, http.StatusBadRequest, do(t, ts, http.MethodGet, "/v2/core/events", testKey, url.Values{"created[gt]": {"yesterday"}}, nil).status)
	assert.Equal(t, http.StatusBadRequest, do(t, ts, http.MethodGet, "/v2/core/events", testKey, url.Values{"limit": {"101"}}, nil).status)
	assert.Equal(t, http.StatusBadRequest, do(t, ts, http.MethodGet, "/v2/core/events", testKey, url.Values{"colour": {"red"}}, nil).status)

	// 30 days on, the oldest are gone, from the list and by id.
	clk.Add(30*24*time.Hour - 3*time.Minute)
	ids, _ = listIDs(t, ts, nil, nil)
	assert.Equal(t, want[:2], ids)
	assert.Equal(t, http.StatusNotFound, do(t, ts, http.MethodGet, "/v2/core/events/"+want[4], testKey, nil, nil).status)
	assert.Equal(t, http.StatusOK, do(t, ts, http.MethodGet, "/v2/core/events/"+want[0], testKey, nil, nil).status)
}

// Options.EventsList: a listing that refuses the filters answers 400 to
// them (unknown parameter) and lists without them; one that requires
// object_id refuses a listing without it.
func TestListEventsSupport(t *testing.T) {
	t.Parallel()
	filters := url.Values{"types[0]": {stripesim.ReportErrorTriggered}, "created[gt]": {base.Add(-time.Hour).Format(time.RFC3339)}}

	_, ts, _ := newEventsSim(t, stripesim.Options{EventsList: stripesim.ListUnfiltered})
	failEvent(t, ts, acct, "ev-1", "k-1", base.Add(-time.Hour))
	r := do(t, ts, http.MethodGet, "/v2/core/events", testKey, filters, nil)
	assert.Equal(t, http.StatusBadRequest, r.status)
	assert.Equal(t, "parameter_unknown", r.errField("code"))
	ids, _ := listIDs(t, ts, url.Values{"limit": {"10"}}, nil)
	assert.Len(t, ids, 1)

	sim, ts, _ := newEventsSim(t, stripesim.Options{EventsList: stripesim.ListByObject})
	failEvent(t, ts, acct, "ev-1", "k-1", base.Add(-time.Hour))
	assert.Equal(t, http.StatusBadRequest, do(t, ts, http.MethodGet, "/v2/core/events", testKey, nil, nil).status)
	assert.Equal(t, http.StatusBadRequest, do(t, ts, http.MethodGet, "/v2/core/events", testKey, filters, nil).status)
	ids, _ = listIDs(t, ts, url.Values{"object_id": {sim.Meters(acct)[0].ID}}, nil)
	assert.Len(t, ids, 1)
	ids, _ = listIDs(t, ts, url.Values{"object_id": {"mtr_other"}}, nil)
	assert.Empty(t, ids)

	_, ts, _ = newEventsSim(t, stripesim.Options{ListWithoutData: true})
	failEvent(t, ts, acct, "ev-1", "k-1", base.Add(-time.Hour))
	r = do(t, ts, http.MethodGet, "/v2/core/events", testKey, nil, nil)
	require.Len(t, r.body["data"], 1)
	assert.NotContains(t, r.body["data"].([]any)[0], "data", "listed as a thin event")
}

// DeliverReports tries an undelivered report again at each call until
// three days after it was created (Stripe retries for up to three days:
// docs.stripe.com/webhooks/process-undelivered-events), then abandons it.
func TestDeliverReportsGivesUp(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newEventsSim(t, stripesim.Options{})
	failEvent(t, ts, acct, "ev-1", "k-1", base.Add(-time.Hour))
	var (
		up   bool
		hits int
	)
	dest := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits++
		if !up {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	t.Cleanup(dest.Close)
	ctx := context.Background()

	n, err := sim.DeliverReports(ctx, acct, dest.URL, "whsec_x")
	assert.Zero(t, n)
	assert.ErrorContains(t, err, "status 503")
	clk.Add(71 * time.Hour)
	_, err = sim.DeliverReports(ctx, acct, dest.URL, "whsec_x")
	assert.Error(t, err, "still retried")
	assert.Equal(t, 2, hits)
	assert.Empty(t, sim.Abandoned(acct))

	clk.Add(2 * time.Hour)
	up = true
	n, err = sim.DeliverReports(ctx, acct, dest.URL, "whsec_x")
	assert.NoError(t, err)
	assert.Zero(t, n, "past three days Stripe no longer retries")
	assert.Equal(t, 2, hits)
	assert.Equal(t, []string{sim.ErrorReports(acct)[0].ID}, sim.Abandoned(acct))
}
