package stripesim_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
)

// call is one API call of a test, returning its HTTP status.
type call struct {
	endpoint string // as stripesim.RateLimitKey names it
	send     func(t *testing.T) response
}

// basicRun is the state TestBasicRateLimit's steps share. n numbers the
// events its calls send, so that no two share an identifier.
type basicRun struct {
	sim *stripesim.Server
	ts  *httptest.Server
	n   int
}

// event is a v1 meter event call with key.
func (b *basicRun) event(key string) func(t *testing.T) response {
	return func(t *testing.T) response {
		b.n++
		return do(t, b.ts, http.MethodPost, "/v1/billing/meter_events", key,
			eventForm("api_calls", "cus_acme", fmt.Sprint("b-", b.n), "1", base), nil)
	}
}

// stream is a stream request of one event with the session token tok.
func (b *basicRun) stream(tok string) func(t *testing.T) response {
	return func(t *testing.T) response {
		b.n++
		return doJSON(t, b.ts, "/v2/billing/meter_event_stream", tok, map[string]any{"events": validEvents(fmt.Sprint("s", b.n), 1)})
	}
}

func (b *basicRun) get(key, path string, form url.Values) func(t *testing.T) response {
	return func(t *testing.T) response { return do(t, b.ts, http.MethodGet, path, key, form, nil) }
}

func (b *basicRun) post(key, path string, form url.Values) func(t *testing.T) response {
	return func(t *testing.T) response { return do(t, b.ts, http.MethodPost, path, key, form, nil) }
}

// testCalls is one call of every endpoint with the test key, the stream
// with the test-mode session token testTok.
func (b *basicRun) testCalls(meter, testTok string) []call {
	at := strconv.FormatInt(base.Add(-time.Hour).Truncate(time.Hour).Unix(), 10)
	end := strconv.FormatInt(base.Truncate(time.Hour).Unix(), 10)
	return []call{
		{"GET /v1/account", b.get(testKey, "/v1/account", nil)},
		{"GET /v1/billing/meters", b.get(testKey, "/v1/billing/meters", nil)},
		{"GET /v1/billing/meters/{id}", b.get(testKey, "/v1/billing/meters/"+meter, nil)},
		{"GET /v1/billing/meters/{id}/event_summaries", b.get(testKey, "/v1/billing/meters/"+meter+"/event_summaries",
			url.Values{"customer": {"cus_acme"}, "start_time": {at}, "end_time": {end}})},
		{"GET /v1/customers/{id}", b.get(testKey, "/v1/customers/cus_acme", nil)},
		{"POST /v1/customers", b.post(testKey, "/v1/customers", nil)},
		{"POST /v1/billing/meter_event_adjustments", b.post(testKey, "/v1/billing/meter_event_adjustments",
			url.Values{"event_name": {"api_calls"}, "type": {"cancel"}, "cancel[identifier]": {"none"}})},
		{"GET /v2/core/events/{id}", b.get(testKey, "/v2/core/events/evt_test_none", nil)},
		{"POST /v2/billing/meter_event_session", func(t *testing.T) response {
			return doJSON(t, b.ts, "/v2/billing/meter_event_session", testKey, map[string]any{})
		}},
		{"POST /v1/billing/meter_events", b.event(testKey)},
		{"POST /v2/billing/meter_event_stream", b.stream(testTok)},
	}
}

// TestBasicRateLimit checks Limits.BasicRatePerSecond, Stripe's basic rate
// limiter (https://docs.stripe.com/rate-limits: "Live mode: 100
// operations; Sandbox: 25 operations" per second and account). Every
// API-key call takes from it, reads and writes alike. Meter events count
// toward it only in test mode: "Calls to the Meter events endpoint in live
// mode are subject to a separate rate limit, and don't count against the
// basic limits" (same page) and "In test mode and sandbox mode, calls to
// the meter event and meter event stream endpoint count toward the basic
// limit"
// (https://docs.stripe.com/billing/subscriptions/usage-based/recording-usage-api).
// A 429 is refused before the endpoint executes, so nothing is kept for
// its Idempotency-Key (https://docs.stripe.com/api/idempotent_requests).
func TestBasicRateLimit(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{})
	b := &basicRun{sim: sim, ts: ts}
	meter := sim.Meters(acct)[0].ID
	sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls", Livemode: true})
	testTok := newSession(t, ts, "") // sessions are made before the limit
	r := doJSON(t, ts, "/v2/billing/meter_event_session", liveKey, map[string]any{})
	require.Equal(t, http.StatusOK, r.status)
	liveTok := r.body["authentication_token"].(string)

	step(t, "EveryTestCall", func(t *testing.T) { b.everyTestCall(t, b.testCalls(meter, testTok)) })
	step(t, "LiveMode", func(t *testing.T) { b.liveMode(t, liveTok) })
	step(t, "ConnectedAccount", b.connectedAccount)
	step(t, "NothingKeptForLimitedKey", func(t *testing.T) {
		form := eventForm("api_calls", "cus_acme", "k-1", "1", base)
		assert.Equal(t, http.StatusTooManyRequests, do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, form, withKey("k-1")).status)
		sim.Configure(acct, stripesim.Limits{})
		r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, form, withKey("k-1"))
		assert.Equal(t, http.StatusOK, r.status)
		assert.Empty(t, r.header.Get("Idempotent-Replayed"))
	})
}

// everyTestCall checks that every test-mode call takes from the basic
// bucket: with a burst of one token per call, each passes once and is
// limited the second time.
func (b *basicRun) everyTestCall(t *testing.T, testCalls []call) {
	b.sim.Configure(acct, stripesim.Limits{BasicRatePerSecond: 0.001, BasicBurst: len(testCalls)})
	for _, c := range testCalls {
		r := c.send(t)
		assert.NotEqual(t, http.StatusTooManyRequests, r.status, c.endpoint)
	}
	for _, c := range testCalls { // the bucket is empty: every call is limited
		r := c.send(t)
		assert.Equal(t, http.StatusTooManyRequests, r.status, c.endpoint)
		assert.Equal(t, "rate_limit", r.errField("code"), c.endpoint)
		assert.Equal(t, "invalid_request_error", r.errField("type"), c.endpoint)
		// "Stripe-Rate-Limited-Reason" names the limiter (same page, "Rate
		// limited requests"); the basic limiter is the global rate.
		assert.Equal(t, "global-rate", r.header.Get("Stripe-Rate-Limited-Reason"), c.endpoint)
	}
	limited := b.sim.RateLimited(acct)
	for _, c := range testCalls {
		assert.Equal(t, 1, limited[stripesim.RateLimitKey{Limiter: stripesim.LimiterBasic, Endpoint: c.endpoint}], c.endpoint)
	}
}

// liveMode checks that live mode has its own basic bucket, from which live
// meter events and stream requests (with the live session token liveTok)
// take nothing.
func (b *basicRun) liveMode(t *testing.T, liveTok string) {
	before := len(b.sim.Events(acct))
	for range 3 {
		assert.Equal(t, http.StatusOK, b.event(liveKey)(t).status)
		assert.Equal(t, http.StatusOK, b.stream(liveTok)(t).status)
	}
	assert.Len(t, b.sim.Events(acct), before+6)
	b.sim.Configure(acct, stripesim.Limits{BasicRatePerSecond: 0.001, BasicBurst: 1})
	assert.Equal(t, http.StatusOK, b.get(liveKey, "/v1/account", nil)(t).status)
	assert.Equal(t, http.StatusTooManyRequests, b.get(liveKey, "/v1/account", nil)(t).status)
	assert.Equal(t, http.StatusOK, b.event(liveKey)(t).status)
}

// connectedAccount checks that a Connect platform's live meter events for
// a connected account count toward that account's basic limit: "If you're
// a Connect platform making requests on behalf of a connected account using
// the Stripe-Account header, you're subject to" the regular rate limits
// (https://docs.stripe.com/billing/subscriptions/usage-based/recording-usage-api,
// "Rate limits"; the sentence's end, "regular Stripe rate limits, which is
// 100 operations per second", is from a later copy of that page). The
// simulator applies it to the stream too, through the session's
// Stripe-Account: the worst case, not verified.
func (b *basicRun) connectedAccount(t *testing.T) {
	sim, ts := b.sim, b.ts
	sim.AddAccount("acct_conn")
	sim.CreateMeter("acct_conn", stripesim.MeterSpec{EventName: "api_calls", Livemode: true})
	sim.CreateCustomer("acct_conn", "cus_acme")
	connect := map[string]string{"Stripe-Account": "acct_conn"}
	r := do(t, ts, http.MethodPost, "/v2/billing/meter_event_session", liveKey, nil, connect)
	require.Equal(t, http.StatusOK, r.status)
	connTok := r.body["authentication_token"].(string)
	sim.Configure("acct_conn", stripesim.Limits{BasicRatePerSecond: 0.001, BasicBurst: 2})
	connEvent := func() int {
		b.n++
		return do(t, ts, http.MethodPost, "/v1/billing/meter_events", liveKey,
			eventForm("api_calls", "cus_acme", fmt.Sprint("c-", b.n), "1", base), connect).status
	}
	assert.Equal(t, http.StatusOK, connEvent())
	assert.Equal(t, http.StatusOK, b.stream(connTok)(t).status)
	assert.Equal(t, http.StatusTooManyRequests, connEvent())
	assert.Equal(t, http.StatusTooManyRequests, b.stream(connTok)(t).status)
	assert.Equal(t, map[stripesim.RateLimitKey]int{
		{Limiter: stripesim.LimiterBasic, Endpoint: "POST /v1/billing/meter_events"}:       1,
		{Limiter: stripesim.LimiterBasic, Endpoint: "POST /v2/billing/meter_event_stream"}: 1,
	}, sim.RateLimited("acct_conn"))
}

// TestEndpointRateLimit checks Limits.EndpointRatePerSecond, Stripe's
// default per-endpoint limit (https://docs.stripe.com/rate-limits: "API
// endpoints have a default limit of 25 requests per second"; each named
// operation is its own endpoint, and requests to one operation for
// different ids count toward the same endpoint limit). No other limit is
// noted for GET /v1/billing/meters/{id}/event_summaries, so the default
// applies to it. Meter events have their own limits
// (Limits.RatePerSecond, StreamRatePerSecond) instead.
func TestEndpointRateLimit(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{EndpointRatePerSecond: 0.001, EndpointBurst: 2})
	meters := sim.Meters(acct)
	start := strconv.FormatInt(base.Add(-time.Hour).Truncate(time.Hour).Unix(), 10)
	end := strconv.FormatInt(base.Truncate(time.Hour).Unix(), 10)
	summaries := func(key, meter string) int {
		return do(t, ts, http.MethodGet, "/v1/billing/meters/"+meter+"/event_summaries", key,
			url.Values{"customer": {"cus_acme"}, "start_time": {start}, "end_time": {end}}, nil).status
	}
	assert.Equal(t, http.StatusOK, summaries(testKey, meters[0].ID))
	assert.Equal(t, http.StatusOK, summaries(testKey, meters[1].ID))
	assert.Equal(t, http.StatusTooManyRequests, summaries(testKey, meters[2].ID), "one endpoint for every meter")

	// Other endpoints have their own buckets; meter events none.
	assert.Equal(t, http.StatusOK, do(t, ts, http.MethodGet, "/v1/billing/meters/"+meters[0].ID, testKey, nil, nil).status)
	for i := range 5 {
		r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", fmt.Sprint("e-", i), "1", base), nil)
		assert.Equal(t, http.StatusOK, r.status)
	}
	// The other mode has its own.
	live := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls", Livemode: true})
	assert.Equal(t, http.StatusOK, summaries(liveKey, live.ID))

	assert.Equal(t, map[stripesim.RateLimitKey]int{
		{Limiter: stripesim.LimiterEndpoint, Endpoint: "GET /v1/billing/meters/{id}/event_summaries"}: 1,
	}, sim.RateLimited(acct))
}

// TestNewLimitsAreValidated checks that the new rates, bursts and the new
// fault are validated like the others.
func TestNewLimitsAreValidated(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	for _, lim := range []stripesim.Limits{
		{BasicRatePerSecond: -1},
		{BasicBurst: -1},
		{EndpointRatePerSecond: -1},
		{EndpointBurst: -1},
		{Faults: stripesim.Faults{FailAfterRecord: 2}},
	} {
		assert.Panics(t, func() { sim.Configure(acct, lim) }, "%+v", lim)
		assert.Panics(t, func() { sim.ConfigureDefault(lim) }, "%+v", lim)
	}
	assert.Panics(t, func() { stripesim.New(stripesim.Options{Limits: stripesim.Limits{BasicRatePerSecond: -1}}) })
}
