package stripesim_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

// The idempotency layer follows Stripe's API reference, "Idempotent
// requests" (https://docs.stripe.com/api/idempotent_requests): "Stripe's
// idempotency works by saving the resulting status code and body of the
// first request made for any given idempotency key, regardless of whether
// it succeeds or fails. Subsequent requests with the same key return the
// same result, including 500 errors." and "We save results only after the
// execution of an endpoint begins. If incoming parameters fail validation,
// or the request conflicts with another request that's executing
// concurrently, we don't save the idempotent result". Keys "can be removed
// from the system automatically after they're at least 24 hours old"; the
// layer "compares incoming parameters to those of the original request and
// errors if they're not the same". A replay carries Stripe's
// Idempotent-Replayed: true header (named as Stripe's in advisory
// GHSA-8mhj-rffc-rcvw, https://osv.dev/vulnerability/GHSA-8mhj-rffc-rcvw;
// stripe-go v82 does not read it) and the first request's id in
// Original-Request (the simulator's, not verified).

// withKey returns header with an Idempotency-Key.
func withKey(key string) map[string]string { return map[string]string{"Idempotency-Key": key} }

// TestIdempotencyKeepsWhatTheEndpointExecuted checks which first answers
// are kept for a key and replayed, and which leave the key free. Where
// Stripe's docs are silent on a 4xx — whether a business-rule refusal found
// while executing (no such customer, no active meter, a duplicate
// identifier) is kept — the simulator keeps it: the docs' rule says the
// endpoint started executing, and it is the worst case for a client that
// reuses a key after fixing the cause. The timestamp window and the
// 15-digit rule are treated as parameter validation (not kept); that is not
// verified.
func TestIdempotencyKeepsWhatTheEndpointExecuted(t *testing.T) {
	t.Parallel()
	at := base.Add(-time.Minute)
	valid := func() url.Values { return eventForm("api_calls", "cus_acme", "ev-1", "3", at) }
	cases := []struct {
		name   string
		limits stripesim.Limits
		setup  func(t *testing.T, ts *httptest.Server)
		first  func() url.Values
		status int
		code   string
		kept   bool
		// fix makes the first request's cause go away before the retry.
		fix func(sim *stripesim.Server)
	}{
		{name: "200", first: valid, status: 200, kept: true},
		{name: "500 before recording", limits: stripesim.Limits{Faults: stripesim.Faults{FailBeforeRecord: 1}},
			first: valid, status: 500, kept: true},
		{name: "500 after recording", limits: stripesim.Limits{Faults: stripesim.Faults{FailAfterRecord: 1}},
			first: valid, status: 500, kept: true},
		{name: "no such customer", first: func() url.Values { return eventForm("api_calls", "cus_new", "ev-1", "3", at) },
			status: 400, code: "resource_missing", kept: true,
			fix: func(sim *stripesim.Server) { sim.CreateCustomer(acct, "cus_new") }},
		{name: "no active meter", first: func() url.Values { return eventForm("later", "cus_acme", "ev-1", "3", at) },
			status: 400, code: "resource_missing", kept: true,
			fix: func(sim *stripesim.Server) { sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "later"}) }},
		{name: "duplicate identifier", setup: func(t *testing.T, ts *httptest.Server) {
			r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", "taken", "3", at), nil)
			require.Equal(t, http.StatusOK, r.status)
		}, first: func() url.Values { return eventForm("api_calls", "cus_acme", "taken", "3", at) },
			status: 400, kept: true},
		{name: "rate limit", limits: stripesim.Limits{Faults: stripesim.Faults{RateLimitFault: 1}},
			first: valid, status: 429, code: "rate_limit"},
		{name: "missing parameter", first: func() url.Values { v := valid(); v.Del("event_name"); return v },
			status: 400, code: "parameter_missing"},
		{name: "unknown parameter", first: func() url.Values { v := valid(); v.Set("colour", "red"); return v },
			status: 400, code: "parameter_unknown"},
		{name: "value not an integer", first: func() url.Values { return eventForm("api_calls", "cus_acme", "ev-1", "1.5", at) },
			status: 400, code: "parameter_invalid_integer"},
		{name: "value of 16 digits", first: func() url.Values { return eventForm("api_calls", "cus_acme", "ev-1", "1000000000000000", at) },
			status: 400, code: "meter_event_value_too_many_digits"},
		{name: "identifier too long", first: func() url.Values { v := valid(); v.Set("identifier", strings.Repeat("x", 101)); return v },
			status: 400},
		{name: "timestamp too old", first: func() url.Values { return eventForm("api_calls", "cus_acme", "ev-1", "3", base.AddDate(0, 0, -36)) },
			status: 400},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			sim, ts, _ := newMeterSim(t, tc.limits)
			if tc.setup != nil {
				tc.setup(t, ts)
			}
			first := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, tc.first(), withKey("k-1"))
			require.Equal(t, tc.status, first.status, first.body)
			assert.Equal(t, tc.code, first.errField("code"))
			if tc.status == 500 {
				assert.Equal(t, "false", first.header.Get("Stripe-Should-Retry"))
			}
			recorded := len(sim.Events(acct))

			sim.Configure(acct, stripesim.Limits{})
			if tc.fix != nil {
				tc.fix(sim)
			}
			if tc.kept {
				again := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, tc.first(), withKey("k-1"))
				assert.Equal(t, tc.status, again.status)
				assert.Equal(t, first.body, again.body, "the kept body")
				assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
				assert.Equal(t, first.header.Get("Request-Id"), again.header.Get("Original-Request"))
				assert.Equal(t, first.header.Get("Stripe-Should-Retry"), again.header.Get("Stripe-Should-Retry"))
				assert.Len(t, sim.Events(acct), recorded, "a replay records nothing")

				// Other parameters with the key: idempotency_error.
				other := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_beta", "ev-9", "1", at), withKey("k-1"))
				assert.Equal(t, http.StatusBadRequest, other.status)
				assert.Equal(t, "idempotency_error", other.errField("type"))
				return
			}
			// Nothing was kept: the key is free, even for other (fixed)
			// parameters, and the request is executed.
			again := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, valid(), withKey("k-1"))
			assert.Equal(t, http.StatusOK, again.status, again.body)
			assert.Empty(t, again.header.Get("Idempotent-Replayed"))
			assert.Len(t, sim.Events(acct), recorded+1)
		})
	}
}

// TestIdempotencyReplaysFaultsWithoutRerunningThem checks that a kept 500
// of FailBeforeRecord or FailAfterRecord is replayed to the same key
// without executing again — no event recorded twice, no fault drawn anew —
// and that the identifier's dedup still guards a resend with another key.
// Sources: https://docs.stripe.com/api/idempotent_requests (500s replayed);
// stripe-go v82 stripe.go, BackendImplementation.shouldRetry ("we expect
// the stripe-should-retry header to be false in most cases when a 500 is
// returned, since our idempotency framework would typically replay it
// anyway").
func TestIdempotencyReplaysFaultsWithoutRerunningThem(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		faults   stripesim.Faults
		recorded int
	}{
		{"FailBeforeRecord", stripesim.Faults{FailBeforeRecord: 1}, 0},
		{"FailAfterRecord", stripesim.Faults{FailAfterRecord: 1}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: tc.faults})
			sc := client(ts, testKey)
			p := eventParams("api_calls", "cus_acme", "ev-f", 4, base)
			for i := range 3 { // the fault stays on: replays do not draw it
				_, err := send(t, sc, p)
				se := stripeErr(t, err)
				assert.Equal(t, http.StatusInternalServerError, se.HTTPStatusCode)
				assert.Equal(t, stripe.ErrorTypeAPI, se.Type)
				assert.Equal(t, "false", se.LastResponse.Header.Get("Stripe-Should-Retry"))
				if i > 0 {
					assert.Equal(t, "true", se.LastResponse.Header.Get("Idempotent-Replayed"))
				}
			}
			assert.Len(t, sim.Events(acct), tc.recorded)
			assert.Empty(t, sim.RecordedTwice())

			// A new key per attempt: recorded once, or refused as a duplicate
			// when the failed attempt was recorded.
			sim.Configure(acct, stripesim.Limits{})
			p.SetIdempotencyKey("ev-f-2")
			_, err := send(t, sc, p)
			if tc.recorded == 0 {
				require.NoError(t, err)
			} else {
				se := stripeErr(t, err)
				assert.Equal(t, "An event already exists with identifier ev-f.", se.Msg)
			}
			require.Len(t, sim.Events(acct), 1)
			assert.Equal(t, stripesim.EventRecorded, sim.Events(acct)[0].Status)
		})
	}
}

// TestIdempotencyConflictIsNotKept checks the 409 for a key whose first
// request still runs: "the request conflicts with another request that's
// executing concurrently, we don't save the idempotent result"
// (https://docs.stripe.com/api/idempotent_requests). The first request's
// own result is kept and replayed afterwards.
func TestIdempotencyConflictIsNotKept(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{Latency: 300 * time.Millisecond}})
	form := eventForm("api_calls", "cus_acme", "ev-c", "2", base)
	var first response
	var wg sync.WaitGroup
	wg.Go(func() { first = do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, form, withKey("k-c")) })
	time.Sleep(100 * time.Millisecond)
	r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, form, withKey("k-c"))
	assert.Equal(t, http.StatusConflict, r.status)
	assert.Equal(t, "idempotency_error", r.errField("type"))
	assert.Equal(t, "idempotency_key_in_use", r.errField("code"))
	wg.Wait()
	require.Equal(t, http.StatusOK, first.status)

	r = do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, form, withKey("k-c"))
	assert.Equal(t, http.StatusOK, r.status)
	assert.Equal(t, "true", r.header.Get("Idempotent-Replayed"))
	assert.Len(t, sim.Events(acct), 1)
}

// TestIdempotencyConcurrencyLimitIsNotKept checks that Stripe's
// one-concurrent-call-per-customer-and-meter 429 ("one concurrent call per
// customer per meter",
// https://docs.stripe.com/billing/subscriptions/usage-based/recording-usage-api)
// keeps nothing for the key: it is refused before the endpoint executes.
func TestIdempotencyConcurrencyLimitIsNotKept(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{OneCallPerCustomerMeter: true, Faults: stripesim.Faults{Latency: 300 * time.Millisecond}})
	var wg sync.WaitGroup
	wg.Go(func() {
		do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", "ev-a", "1", base), withKey("k-a"))
	})
	time.Sleep(100 * time.Millisecond)
	b := eventForm("api_calls", "cus_acme", "ev-b", "1", base)
	r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, b, withKey("k-b"))
	assert.Equal(t, http.StatusTooManyRequests, r.status)
	wg.Wait()
	r = do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, b, withKey("k-b"))
	assert.Equal(t, http.StatusOK, r.status)
	assert.Empty(t, r.header.Get("Idempotent-Replayed"))
	assert.Len(t, sim.Events(acct), 2)
	assert.Equal(t, 1, sim.RateLimited(acct)[stripesim.RateLimitKey{Limiter: stripesim.LimiterConcurrency, Endpoint: "POST /v1/billing/meter_events"}])
}

// TestIdempotencyKeepsBusinessErrorsOfOtherEndpoints checks the rule on an
// endpoint other than meter events: creating a meter whose event name an
// active meter has is refused while executing and kept; a missing
// parameter is not (https://docs.stripe.com/api/idempotent_requests). A
// key on a GET has no effect ("Don't send idempotency keys in GET and
// DELETE requests because it has no effect", same page).
func TestIdempotencyKeepsBusinessErrorsOfOtherEndpoints(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	form := url.Values{"display_name": {"D"}, "event_name": {"e"}, "default_aggregation[formula]": {"sum"}}
	first := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "e"})
	r := do(t, ts, http.MethodPost, "/v1/billing/meters", testKey, form, withKey("m-1"))
	require.Equal(t, http.StatusBadRequest, r.status)
	assert.Equal(t, "resource_already_exists", r.errField("code"))
	require.NoError(t, sim.DeactivateMeter(acct, first.ID))
	r = do(t, ts, http.MethodPost, "/v1/billing/meters", testKey, form, withKey("m-1"))
	assert.Equal(t, http.StatusBadRequest, r.status, "the kept refusal, although the name is free now")
	assert.Equal(t, "true", r.header.Get("Idempotent-Replayed"))
	r = do(t, ts, http.MethodPost, "/v1/billing/meters", testKey, form, withKey("m-2"))
	assert.Equal(t, http.StatusOK, r.status)

	r = do(t, ts, http.MethodGet, "/v1/billing/meters", testKey, nil, withKey("g-1"))
	require.Equal(t, http.StatusOK, r.status)
	r = do(t, ts, http.MethodGet, "/v1/billing/meters", testKey, url.Values{"limit": {"1"}}, withKey("g-1"))
	assert.Equal(t, http.StatusOK, r.status)
	assert.Empty(t, r.header.Get("Idempotent-Replayed"))
}

// TestStreamIdempotency checks the stream's faults against its keys.
// stripe-go v82 sends a fresh random Idempotency-Key on every POST that has
// none, v1 and v2 alike (stripe.go, BackendImplementation.NewRequest:
// "else if isHTTPWriteMethod(method) { req.Header.Add("Idempotency-Key",
// NewIdempotencyKey()) }"), so two stream requests never share a key unless
// the client sets one. With a key, a kept 500 is replayed as on v1. Stripe's
// API v2 overview (https://docs.stripe.com/api-v2-overview, "Idempotency")
// says a v2 retry with the key instead retries failed work to completion;
// the simulator replays the 500 like v1, the worse case for a client that
// reuses a key (it never gets a success), and the same for stripe-go, which
// never does.
func TestStreamIdempotency(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("FreshKeyPerRequest", func(t *testing.T) {
		t.Parallel()
		sim, ts, _ := newMeterSim(t, stripesim.Limits{})
		sc, _ := streamClient(ts, newSession(t, ts, ""))
		require.NoError(t, sc.V2BillingMeterEventStreams.Create(ctx, streamParams(validEvents("a", 1)...)))
		require.NoError(t, sc.V2BillingMeterEventStreams.Create(ctx, streamParams(validEvents("b", 1)...)))
		_, err := client(ts, testKey).V1BillingMeterEvents.Create(ctx, &stripe.BillingMeterEventCreateParams{
			EventName: stripe.String("api_calls"), Payload: map[string]string{"stripe_customer_id": "cus_acme", "value": "1"},
		})
		require.NoError(t, err)
		var keys []string
		for _, r := range sim.Requests() {
			if r.Path == "/v2/billing/meter_event_stream" || r.Path == "/v1/billing/meter_events" {
				keys = append(keys, r.IdempotencyKey)
			}
		}
		require.Len(t, keys, 3)
		for _, k := range keys {
			assert.NotEmpty(t, k)
		}
		assert.NotEqual(t, keys[0], keys[1])
	})

	for _, tc := range []struct {
		name     string
		faults   stripesim.Faults
		recorded int
		reports  int
	}{
		{"FailBeforeRecord", stripesim.Faults{FailBeforeRecord: 1}, 0, 0},
		{"FailAfterRecord", stripesim.Faults{FailAfterRecord: 1}, 2, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: tc.faults})
			sc, rec := streamClient(ts, newSession(t, ts, ""))
			p := streamParams(append(validEvents("s", 2), streamEvent("nope", "cus_acme", "s-nope", "1", base))...)
			p.SetIdempotencyKey("stream-1")
			for i := range 3 {
				err := sc.V2BillingMeterEventStreams.Create(ctx, p)
				assert.Equal(t, "api_error", string(*v2Raw(t, err).Type))
				status, header := rec.get()
				assert.Equal(t, http.StatusInternalServerError, status)
				assert.Equal(t, "false", header.Get("Stripe-Should-Retry"))
				if i > 0 {
					assert.Equal(t, "true", header.Get("Idempotent-Replayed"))
				}
			}
			assert.Len(t, sim.Events(acct), tc.recorded)
			assert.Len(t, sim.ErrorReports(acct), tc.reports, "a replay reports nothing again")

			// stripe-go's own retry would carry a fresh key: the events are
			// then recorded, or ignored as duplicates.
			sim.Configure(acct, stripesim.Limits{})
			p.SetIdempotencyKey("stream-2")
			require.NoError(t, sc.V2BillingMeterEventStreams.Create(ctx, p))
			assert.Len(t, sim.Events(acct), 2)
			assert.Empty(t, sim.RecordedTwice())
		})
	}
}

// TestIdempotencyHeldRequestIsNotKept checks a request the Hang fault held
// before its endpoint executed: the client gave up, nothing was executed,
// and the key is free for a retry. Stripe's docs say nothing about a
// request abandoned by its client; holding it in front of the endpoint is
// the simulator's reading (a request that did execute and whose reply was
// lost is LoseReply's).
func TestIdempotencyHeldRequestIsNotKept(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{Hang: 1}})
	sc := client(ts, testKey)
	p := eventParams("api_calls", "cus_acme", "ev-h", 1, base)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := sc.V1BillingMeterEvents.Create(ctx, p)
	require.Error(t, err)
	require.Eventually(t, func() bool { return len(sim.Requests()) == 1 }, time.Second, 10*time.Millisecond)

	sim.Configure(acct, stripesim.Limits{})
	ev, err := send(t, sc, p)
	require.NoError(t, err)
	assert.Empty(t, ev.LastResponse.Header.Get("Idempotent-Replayed"))
	assert.Len(t, sim.Events(acct), 1)
}
