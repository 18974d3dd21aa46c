package stripesim_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

// base is the simulator clock's starting point in these tests.
var base = time.Date(2026, 3, 10, 12, 0, 0, 0, time.UTC)

// clock is a simulator clock tests move by hand.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// newMeterSim starts a simulator on a movable clock with the meters
// api_calls (sum), seats (last) and logins (count) and the customers
// cus_acme and cus_beta in acct.
func newMeterSim(t testing.TB, lim stripesim.Limits) (*stripesim.Server, *httptest.Server, *clock) {
	t.Helper()
	clk := &clock{t: base}
	sim := stripesim.New(stripesim.Options{
		Keys: map[string]string{testKey: acct, liveKey: acct}, Now: clk.Now, Limits: lim, Seed: 42,
	})
	ts := httptest.NewServer(sim.Handler())
	t.Cleanup(func() {
		sim.Close()
		ts.Close()
	})
	sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls", Formula: "sum"})
	sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "seats", Formula: "last"})
	sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "logins", Formula: "count"})
	sim.CreateCustomer(acct, "cus_acme")
	sim.CreateCustomer(acct, "cus_beta")
	return sim, ts, clk
}

// eventParams is a meter event as Tally sends it: the identifier doubles
// as the Idempotency-Key.
func eventParams(name, cust, ident string, value int64, at time.Time) *stripe.BillingMeterEventCreateParams {
	p := &stripe.BillingMeterEventCreateParams{
		EventName:  stripe.String(name),
		Identifier: stripe.String(ident),
		Payload:    map[string]string{"stripe_customer_id": cust, "value": strconv.FormatInt(value, 10)},
		Timestamp:  stripe.Int64(at.Unix()),
	}
	p.SetIdempotencyKey(ident)
	return p
}

// eventForm is the same event as raw form values.
func eventForm(name, cust, ident, value string, at time.Time) url.Values {
	return url.Values{
		"event_name": {name}, "identifier": {ident}, "timestamp": {strconv.FormatInt(at.Unix(), 10)},
		"payload[stripe_customer_id]": {cust}, "payload[value]": {value},
	}
}

func send(t *testing.T, sc *stripe.Client, p *stripe.BillingMeterEventCreateParams) (*stripe.BillingMeterEvent, error) {
	t.Helper()
	return sc.V1BillingMeterEvents.Create(context.Background(), p)
}

func TestCustomers(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	ctx := context.Background()
	sc := client(ts, testKey)

	p := &stripe.CustomerCreateParams{Name: stripe.String("Acme"), Email: stripe.String("billing@acme.test")}
	p.AddMetadata("tenant", "acme")
	c, err := sc.V1Customers.Create(ctx, p)
	require.NoError(t, err)
	assert.Regexp(t, `^cus_[0-9A-Za-z]{14}$`, c.ID)
	assert.Equal(t, "customer", c.Object)
	assert.Equal(t, "Acme", c.Name)
	assert.Equal(t, "billing@acme.test", c.Email)
	assert.Equal(t, map[string]string{"tenant": "acme"}, c.Metadata)
	assert.False(t, c.Livemode)

	got, err := sc.V1Customers.Retrieve(ctx, c.ID, nil)
	require.NoError(t, err)
	assert.Equal(t, c.ID, got.ID)
	_, err = client(ts, liveKey).V1Customers.Retrieve(ctx, c.ID, nil)
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode, "a test customer is not live")

	empty, err := sc.V1Customers.Create(ctx, nil)
	require.NoError(t, err)
	assert.Empty(t, empty.Name)

	_, err = sc.V1Customers.Retrieve(ctx, "cus_nope", nil)
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusNotFound, se.HTTPStatusCode)
	assert.Equal(t, stripe.ErrorCodeResourceMissing, se.Code)
	assert.Equal(t, "id", se.Param)
	assert.Equal(t, "No such customer: 'cus_nope'", se.Msg)

	assert.Equal(t, "cus_acme", sim.CreateCustomer(acct, "cus_acme"))
	assert.Equal(t, "cus_acme", sim.CreateCustomer(acct, "cus_acme"), "again: a no-op")
	for _, key := range []string{testKey, liveKey} {
		got, err := client(ts, key).V1Customers.Retrieve(ctx, "cus_acme", nil)
		require.NoError(t, err)
		assert.Equal(t, key == liveKey, got.Livemode)
	}
	assert.Regexp(t, `^cus_`, sim.CreateCustomer(acct, ""))

	r := do(t, ts, http.MethodPost, "/v1/customers", testKey, url.Values{"id": {"cus_x"}}, nil)
	assert.Equal(t, http.StatusBadRequest, r.status)
	assert.Equal(t, "parameter_unknown", r.errField("code"))
}

func TestMeterEventCreate(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{})
	sc := client(ts, testKey)
	at := base.Add(-time.Hour)

	ev, err := send(t, sc, eventParams("api_calls", "cus_acme", "ev-1", 7, at))
	require.NoError(t, err)
	assert.Equal(t, "billing.meter_event", ev.Object)
	assert.Equal(t, "api_calls", ev.EventName)
	assert.Equal(t, "ev-1", ev.Identifier)
	assert.Equal(t, at.Unix(), ev.Timestamp)
	assert.Equal(t, base.Unix(), ev.Created)
	assert.False(t, ev.Livemode)
	assert.Equal(t, map[string]string{"stripe_customer_id": "cus_acme", "value": "7"}, ev.Payload)
	assert.Regexp(t, `^req_`, ev.LastResponse.RequestID)

	_, err = send(t, sc, eventParams("api_calls", "cus_acme", "ev-2", -2, at)) // a correction
	require.NoError(t, err)

	// Without identifier and timestamp: Stripe fills both in.
	noID, err := send(t, sc, &stripe.BillingMeterEventCreateParams{
		EventName: stripe.String("api_calls"), Payload: map[string]string{"stripe_customer_id": "cus_beta", "value": "1"},
	})
	require.NoError(t, err)
	assert.NotEmpty(t, noID.Identifier)
	assert.Equal(t, base.Unix(), noID.Timestamp)

	evs := sim.Events(acct)
	require.Len(t, evs, 3)
	m := sim.Meters(acct)[0]
	assert.Equal(t, stripesim.RecordedEvent{
		Identifier: "ev-1", EventName: "api_calls", Meter: m.ID, Customer: "cus_acme", Value: 7,
		Timestamp: time.Unix(at.Unix(), 0), Received: base, Status: stripesim.EventRecorded, Recordings: 1,
	}, evs[0])
	sum, count, last := sim.Aggregate(acct, "api_calls", "cus_acme")
	assert.Equal(t, []int64{5, 2, -2}, []int64{sum, int64(count), last})
	assert.Empty(t, sim.RecordedTwice())

	// A meter with its own payload keys reads them.
	sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "tokens", CustomerPayloadKey: "cust", ValuePayloadKey: "n"})
	_, err = send(t, sc, &stripe.BillingMeterEventCreateParams{
		EventName: stripe.String("tokens"), Identifier: stripe.String("tok-1"),
		Payload: map[string]string{"cust": "cus_acme", "n": "40"},
	})
	require.NoError(t, err)
	sum, _, _ = sim.Aggregate(acct, "tokens", "cus_acme")
	assert.Equal(t, int64(40), sum)
}

func TestMeterEventValidation(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{})
	sim.AddAccount("acct_other")
	sim.CreateCustomer("acct_other", "cus_other")
	old := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "retired"})
	require.NoError(t, sim.DeactivateMeter(acct, old.ID))

	const windowMsg = "Timestamp must be within the past 35 days and not more than 5 minutes in the future"
	at := base.Add(-time.Minute)
	for _, c := range []struct {
		name             string
		edit             func(url.Values)
		code, param, msg string
	}{
		{name: "unknown param", edit: func(v url.Values) { v.Set("colour", "red") },
			code: "parameter_unknown", param: "colour", msg: "Received unknown parameter: colour"},
		{name: "no event_name", edit: func(v url.Values) { v.Del("event_name") },
			code: "parameter_missing", param: "event_name", msg: "Missing required param: event_name."},
		{name: "no payload", edit: func(v url.Values) {
			v.Del("payload[stripe_customer_id]")
			v.Del("payload[value]")
		}, code: "parameter_missing", param: "payload", msg: "Missing required param: payload."},
		{name: "identifier too long", edit: func(v url.Values) { v.Set("identifier", strings.Repeat("x", 101)) },
			param: "identifier", msg: "Invalid identifier: must be at most 100 characters"},
		{name: "timestamp not an integer", edit: func(v url.Values) { v.Set("timestamp", "yesterday") },
			code: "parameter_invalid_integer", param: "timestamp", msg: "Invalid integer: yesterday"},
		{name: "no meter", edit: func(v url.Values) { v.Set("event_name", "nope") },
			code: "resource_missing", param: "event_name", msg: "No active meter found for event_name 'nope'"},
		{name: "inactive meter", edit: func(v url.Values) { v.Set("event_name", "retired") },
			code: "resource_missing", param: "event_name", msg: "No active meter found for event_name 'retired'"},
		{name: "no customer", edit: func(v url.Values) { v.Del("payload[stripe_customer_id]") },
			code: "parameter_missing", param: "payload[stripe_customer_id]", msg: "Missing required param: payload[stripe_customer_id]."},
		{name: "no value", edit: func(v url.Values) { v.Del("payload[value]") },
			code: "parameter_missing", param: "payload[value]", msg: "Missing required param: payload[value]."},
		{name: "fractional value", edit: func(v url.Values) { v.Set("payload[value]", "1.5") },
			code: "parameter_invalid_integer", param: "payload[value]", msg: "Invalid integer: 1.5. The value of payload[value] must be a whole number."},
		{name: "text value", edit: func(v url.Values) { v.Set("payload[value]", "ten") },
			code: "parameter_invalid_integer", param: "payload[value]", msg: "Invalid integer: ten. The value of payload[value] must be a whole number."},
		{name: "unknown customer", edit: func(v url.Values) { v.Set("payload[stripe_customer_id]", "cus_ghost") },
			code: "resource_missing", param: "payload[stripe_customer_id]", msg: "No such customer: 'cus_ghost'"},
		{name: "another account's customer", edit: func(v url.Values) { v.Set("payload[stripe_customer_id]", "cus_other") },
			code: "resource_missing", param: "payload[stripe_customer_id]", msg: "No such customer: 'cus_other'"},
		{name: "too old", edit: func(v url.Values) {
			v.Set("timestamp", strconv.FormatInt(base.Add(-35*24*time.Hour).Unix()-1, 10))
		}, param: "timestamp", msg: windowMsg},
		{name: "too far ahead", edit: func(v url.Values) {
			v.Set("timestamp", strconv.FormatInt(base.Add(5*time.Minute).Unix()+1, 10))
		}, param: "timestamp", msg: windowMsg},
	} {
		form := eventForm("api_calls", "cus_acme", "bad-"+c.name, "3", at)
		c.edit(form)
		r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, form, nil)
		assert.Equal(t, http.StatusBadRequest, r.status, c.name)
		assert.Equal(t, "invalid_request_error", r.errField("type"), c.name)
		assert.Equal(t, c.code, r.errField("code"), c.name)
		assert.Equal(t, c.param, r.errField("param"), c.name)
		assert.Equal(t, c.msg, r.errField("message"), c.name)
		assert.Empty(t, r.header.Get("Stripe-Should-Retry"), c.name)
	}
	assert.Empty(t, sim.Events(acct), "no invalid event is recorded")

	// The window's edges are inside it.
	for i, ts0 := range []time.Time{base.Add(-35 * 24 * time.Hour), base.Add(5 * time.Minute)} {
		r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", fmt.Sprint("edge-", i), "1", ts0), nil)
		assert.Equal(t, http.StatusOK, r.status)
	}

	// The live key sees no test meter.
	r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", liveKey, eventForm("api_calls", "cus_acme", "live-1", "1", at), nil)
	assert.Equal(t, "No active meter found for event_name 'api_calls'", r.errField("message"))

	// stripe-go decodes the errors.
	_, err := send(t, client(ts, testKey), eventParams("api_calls", "cus_ghost", "ev-x", 1, at))
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusBadRequest, se.HTTPStatusCode)
	assert.Equal(t, stripe.ErrorTypeInvalidRequest, se.Type)
	assert.Equal(t, stripe.ErrorCodeResourceMissing, se.Code)
	assert.Equal(t, "payload[stripe_customer_id]", se.Param)
	assert.Regexp(t, `^req_`, se.RequestID)
}

func TestMeterEventDedup(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newMeterSim(t, stripesim.Limits{})
	sc := client(ts, testKey)
	at := base.Add(-time.Hour)

	first, err := send(t, sc, eventParams("api_calls", "cus_acme", "ev-1", 5, at))
	require.NoError(t, err)

	// The same key and parameters: Stripe replays the first answer.
	again, err := send(t, sc, eventParams("api_calls", "cus_acme", "ev-1", 5, at))
	require.NoError(t, err)
	assert.Equal(t, first.Created, again.Created)
	assert.Equal(t, "true", again.LastResponse.Header.Get("Idempotent-Replayed"))

	// Another key (or none) with the identifier: the duplicate 400.
	for _, key := range []string{"other-key", ""} {
		hdr := map[string]string{}
		if key != "" {
			hdr["Idempotency-Key"] = key
		}
		r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", "ev-1", "5", at), hdr)
		assert.Equal(t, http.StatusBadRequest, r.status)
		assert.Equal(t, "invalid_request_error", r.errField("type"))
		assert.Equal(t, "An event already exists with identifier ev-1.", r.errField("message"))
		assert.Empty(t, r.errField("code"))
		assert.Equal(t, "false", r.header.Get("Stripe-Should-Retry"))
	}
	p := eventParams("api_calls", "cus_beta", "ev-1", 9, at) // other content, same identifier
	p.SetIdempotencyKey("third-key")
	_, err = send(t, sc, p)
	se := stripeErr(t, err)
	assert.Equal(t, "An event already exists with identifier ev-1.", se.Msg)
	assert.Equal(t, "false", se.LastResponse.Header.Get("Stripe-Should-Retry"))

	clk.Add(24*time.Hour - time.Second)
	_, err = send(t, sc, eventParams("api_calls", "cus_acme", "ev-1", 5, at))
	require.NoError(t, err, "inside 24 h the key still replays")
	p.SetIdempotencyKey("fourth-key")
	_, err = send(t, sc, p)
	require.Error(t, err, "still a duplicate")
	assert.Len(t, sim.Events(acct), 1)

	// Past 24 h the identifier and the key are forgotten: a resend
	// double-bills.
	clk.Add(time.Second)
	resent, err := send(t, sc, eventParams("api_calls", "cus_acme", "ev-1", 5, at))
	require.NoError(t, err)
	assert.Empty(t, resent.LastResponse.Header.Get("Idempotent-Replayed"))
	evs := sim.Events(acct)
	require.Len(t, evs, 2)
	assert.Equal(t, 2, evs[0].Recordings)
	assert.Equal(t, base.Add(24*time.Hour), evs[1].Received)
	assert.Equal(t, []string{"ev-1"}, sim.RecordedTwice())
	sum, count, _ := sim.Aggregate(acct, "api_calls", "cus_acme")
	assert.Equal(t, int64(10), sum)
	assert.Equal(t, 2, count)

	// Identifiers are per mode.
	sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls", Livemode: true})
	_, err = send(t, client(ts, liveKey), eventParams("api_calls", "cus_acme", "ev-1", 5, at.Add(24*time.Hour)))
	require.NoError(t, err)
}

func TestLoseReplyThenReplay(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{LoseReply: 1}})
	sc := client(ts, testKey)
	p := eventParams("api_calls", "cus_acme", "ev-lost", 3, base)

	for range 3 { // the client retries; every reply is lost
		_, err := send(t, sc, p)
		se := stripeErr(t, err)
		assert.Equal(t, http.StatusBadGateway, se.HTTPStatusCode)
		assert.Equal(t, stripe.ErrorTypeAPI, se.Type)
	}
	// A retry without the key would be the duplicate 400; its reply is
	// lost too.
	r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", "ev-lost", "3", base), nil)
	assert.Equal(t, http.StatusBadGateway, r.status)

	sim.Configure(acct, stripesim.Limits{})
	ev, err := send(t, sc, p)
	require.NoError(t, err, "the kept 200 is replayed")
	assert.Equal(t, "ev-lost", ev.Identifier)
	assert.Equal(t, "true", ev.LastResponse.Header.Get("Idempotent-Replayed"))

	evs := sim.Events(acct)
	require.Len(t, evs, 1, "recorded exactly once")
	assert.Equal(t, stripesim.EventRecorded, evs[0].Status)
	assert.Empty(t, sim.RecordedTwice())
	sum, _, _ := sim.Aggregate(acct, "api_calls", "cus_acme")
	assert.Equal(t, int64(3), sum)

	reqs := sim.Requests()
	require.Len(t, reqs, 5)
	assert.Equal(t, http.StatusBadGateway, reqs[0].Status)
	assert.True(t, reqs[4].Replayed)
}

func TestFaults(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"FailBeforeRecord", faultFailBeforeRecord},
		{"RateLimitFault", faultRateLimit},
		{"Latency", faultLatency},
		{"Hang", faultHang},
		{"AsyncDrop", faultAsyncDrop},
		{"PerAccount", faultsPerAccount},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t)
		})
	}
}

// faultFailBeforeRecord checks Faults.FailBeforeRecord: a 500 before the
// event is recorded, kept for its Idempotency-Key.
func faultFailBeforeRecord(t *testing.T) {
	// Stripe keeps a 500 for its Idempotency-Key like any result of an
	// executing endpoint (https://docs.stripe.com/api/idempotent_requests:
	// "Subsequent requests with the same key return the same result,
	// including 500 errors"), and sets Stripe-Should-Retry: false on it
	// (stripe-go v82 stripe.go, BackendImplementation.shouldRetry).
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{FailBeforeRecord: 1}})
	sc := client(ts, testKey)
	p := eventParams("api_calls", "cus_acme", "ev-1", 1, base)
	_, err := send(t, sc, p)
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusInternalServerError, se.HTTPStatusCode)
	assert.Equal(t, stripe.ErrorTypeAPI, se.Type)
	assert.Equal(t, "false", se.LastResponse.Header.Get("Stripe-Should-Retry"))
	assert.Empty(t, sim.Events(acct))

	// Only meter events fail.
	_, err = sc.V1Accounts.Retrieve(context.Background(), nil)
	require.NoError(t, err)

	// The same key gets the kept 500 even without the fault; another
	// key is executed.
	sim.Configure(acct, stripesim.Limits{})
	_, err = send(t, sc, p)
	se = stripeErr(t, err)
	assert.Equal(t, http.StatusInternalServerError, se.HTTPStatusCode)
	assert.Equal(t, "true", se.LastResponse.Header.Get("Idempotent-Replayed"))
	assert.Equal(t, "false", se.LastResponse.Header.Get("Stripe-Should-Retry"))
	assert.Empty(t, sim.Events(acct))
	p.SetIdempotencyKey("ev-1-attempt-2")
	ev, err := send(t, sc, p)
	require.NoError(t, err)
	assert.Empty(t, ev.LastResponse.Header.Get("Idempotent-Replayed"))
	assert.Len(t, sim.Events(acct), 1)
}

// faultRateLimit checks Faults.RateLimitFault: a 429 rate_limit, nothing
// recorded.
func faultRateLimit(t *testing.T) {
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{RateLimitFault: 1}})
	_, err := send(t, client(ts, testKey), eventParams("api_calls", "cus_acme", "ev-1", 1, base))
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusTooManyRequests, se.HTTPStatusCode)
	assert.Equal(t, stripe.ErrorTypeInvalidRequest, se.Type)
	assert.Equal(t, stripe.ErrorCode("rate_limit"), se.Code)
	assert.Empty(t, sim.Events(acct))
}

// faultLatency checks Faults.Latency and LatencyJitter: the answer comes
// late, the event is recorded.
func faultLatency(t *testing.T) {
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{Latency: 100 * time.Millisecond, LatencyJitter: 50 * time.Millisecond}})
	start := time.Now()
	_, err := send(t, client(ts, testKey), eventParams("api_calls", "cus_acme", "ev-1", 1, base))
	require.NoError(t, err)
	assert.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond)
	assert.Len(t, sim.Events(acct), 1)
}

// faultHang checks Faults.Hang: the request is never answered until the
// client gives up or the simulator closes.
func faultHang(t *testing.T) {
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{Hang: 1}})
	sc := client(ts, testKey)
	p := eventParams("api_calls", "cus_acme", "ev-1", 1, base)
	start := time.Now() // before the deadline's clock starts, as in streamHang
	cctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	_, err := sc.V1BillingMeterEvents.Create(cctx, p)
	require.Error(t, err)
	assert.True(t, errors.Is(err, context.DeadlineExceeded), "%v", err)
	assert.GreaterOrEqual(t, time.Since(start), 150*time.Millisecond)
	assert.Empty(t, sim.Events(acct))

	// Close releases a request whose client would wait for ever.
	done := make(chan error, 1)
	go func() {
		_, err := send(t, sc, eventParams("api_calls", "cus_acme", "ev-2", 1, base))
		done <- err
	}()
	time.Sleep(50 * time.Millisecond)
	select {
	case <-done:
		t.Fatal("answered while hanging")
	default:
	}
	sim.Close()
	assert.Equal(t, http.StatusInternalServerError, stripeErr(t, <-done).HTTPStatusCode)
	assert.Empty(t, sim.Events(acct))
}

// faultAsyncDrop checks Faults.AsyncDrop on a v1 meter event: answered
// 200, then dropped and reported.
func faultAsyncDrop(t *testing.T) {
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{AsyncDrop: 1}})
	sc := client(ts, testKey)
	ev, err := send(t, sc, eventParams("api_calls", "cus_acme", "ev-drop", 4, base.Add(-time.Hour)))
	require.NoError(t, err)
	assert.Equal(t, "ev-drop", ev.Identifier)

	evs := sim.Events(acct)
	require.Len(t, evs, 1)
	assert.Equal(t, stripesim.EventDropped, evs[0].Status)
	_, count, _ := sim.Aggregate(acct, "api_calls", "cus_acme")
	assert.Zero(t, count)
	m := sim.Meters(acct)[0]
	sums := summaries(t, sc, m.ID, "cus_acme", base.Add(-2*time.Hour), base, "hour")
	assert.Empty(t, sums, "a dropped event leaves the summaries")

	reps := sim.ErrorReports(acct)
	require.Len(t, reps, 1)
	rep := reps[0]
	assert.Equal(t, stripesim.ReportErrorTriggered, rep.Type)
	assert.Equal(t, "v1.billing.meter.error_report_triggered", rep.Type)
	assert.Equal(t, m.ID, rep.Meter)
	assert.Equal(t, stripesim.CodeDropped, rep.Code)
	assert.Equal(t, []string{"ev-drop"}, rep.Identifiers)
	assert.Equal(t, 1, rep.ErrorCount)
	assert.Equal(t, base, rep.Created)
	assert.Regexp(t, `^evt_test_`, rep.ID)

	// The identifier is taken: a resend is a duplicate.
	r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", "ev-drop", "4", base), nil)
	assert.Equal(t, http.StatusBadRequest, r.status)
}

// faultsPerAccount checks that faults are configured per account, with
// defaults for accounts without their own.
func faultsPerAccount(t *testing.T) {
	sim, ts, _ := newMeterSim(t, stripesim.Limits{})
	sim.AddAccount("acct_conn")
	sim.CreateMeter("acct_conn", stripesim.MeterSpec{EventName: "api_calls"})
	sim.CreateCustomer("acct_conn", "cus_acme")
	sim.Configure("acct_conn", stripesim.Limits{Faults: stripesim.Faults{FailBeforeRecord: 1}})
	sc := client(ts, testKey)
	_, err := send(t, sc, eventParams("api_calls", "cus_acme", "ev-1", 1, base))
	require.NoError(t, err)
	p := eventParams("api_calls", "cus_acme", "ev-2", 1, base)
	p.SetStripeAccount("acct_conn")
	_, err = send(t, sc, p)
	assert.Equal(t, http.StatusInternalServerError, stripeErr(t, err).HTTPStatusCode)

	// Defaults apply to accounts without their own; Configure wins. (A
	// new key: the first one's 500 is kept and would be replayed.)
	sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{RateLimitFault: 1}})
	_, err = send(t, sc, eventParams("api_calls", "cus_acme", "ev-3", 1, base))
	assert.Equal(t, http.StatusTooManyRequests, stripeErr(t, err).HTTPStatusCode)
	p.SetIdempotencyKey("ev-2-attempt-2")
	_, err = send(t, sc, p)
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusInternalServerError, se.HTTPStatusCode)
	assert.Empty(t, se.LastResponse.Header.Get("Idempotent-Replayed"))

	assert.Panics(t, func() { sim.Configure(acct, stripesim.Limits{Faults: stripesim.Faults{LoseReply: 1.5}}) })
	assert.Panics(t, func() { sim.ConfigureDefault(stripesim.Limits{RatePerSecond: -1}) })
}

// burst sends n meter events at once, event i for customer cust(i), after
// a common start, and returns the HTTP statuses and error codes.
func burst(t *testing.T, ts *httptest.Server, n int, cust func(int) string) (statuses []int, codes []string) {
	t.Helper()
	statuses, codes = make([]int, n), make([]string, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			form := eventForm("api_calls", cust(i), fmt.Sprintf("burst-%s-%d", cust(i), i), "1", base)
			req, err := http.NewRequest(http.MethodPost, ts.URL+"/v1/billing/meter_events", strings.NewReader(form.Encode()))
			if err != nil {
				panic(err)
			}
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Header.Set("Authorization", "Bearer "+testKey)
			<-start
			res, err := ts.Client().Do(req)
			if err != nil {
				statuses[i] = -1
				return
			}
			defer res.Body.Close()
			var body struct {
				Error struct{ Code string } `json:"error"`
			}
			_ = json.NewDecoder(res.Body).Decode(&body)
			statuses[i], codes[i] = res.StatusCode, body.Error.Code
		})
	}
	close(start)
	wg.Wait()
	return statuses, codes
}

func countOf(xs []int, x int) int {
	n := 0
	for _, v := range xs {
		if v == x {
			n++
		}
	}
	return n
}

func TestRateLimit(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{RatePerSecond: 5})
	for i := range 20 {
		sim.CreateCustomer(acct, fmt.Sprintf("cus_%d", i))
	}
	statuses, codes := burst(t, ts, 20, func(i int) string { return fmt.Sprintf("cus_%d", i) })
	ok, limited := countOf(statuses, 200), countOf(statuses, 429)
	assert.Equal(t, 20, ok+limited, "%v", statuses)
	assert.GreaterOrEqual(t, ok, 5)
	assert.LessOrEqual(t, ok, 6, "a bucket of 5 and a trickle of 5/s")
	for i, c := range codes {
		if statuses[i] == 429 {
			assert.Equal(t, "rate_limit", c)
		}
	}
	assert.Len(t, sim.Events(acct), ok)

	// The bucket refills on the real clock.
	time.Sleep(450 * time.Millisecond)
	r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", "later", "1", base), nil)
	assert.Equal(t, http.StatusOK, r.status)

	// Changed while running: no limit. The events limited before are
	// recorded now; the others are duplicates.
	sim.Configure(acct, stripesim.Limits{})
	statuses, _ = burst(t, ts, 20, func(i int) string { return fmt.Sprintf("cus_%d", i) })
	assert.Equal(t, limited, countOf(statuses, 200), "%v", statuses)
	assert.Equal(t, ok, countOf(statuses, 400), "%v", statuses)

	r = do(t, ts, http.MethodGet, "/v1/account", testKey, nil, nil)
	assert.Equal(t, http.StatusOK, r.status, "only meter events are limited")
}

func TestOneCallPerCustomerMeter(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{
		OneCallPerCustomerMeter: true,
		Faults:                  stripesim.Faults{Latency: 300 * time.Millisecond},
	})
	statuses, codes := burst(t, ts, 8, func(int) string { return "cus_acme" })
	assert.Equal(t, 1, countOf(statuses, 200), "%v", statuses)
	assert.Equal(t, 7, countOf(statuses, 429), "%v", statuses)
	for i, c := range codes {
		if statuses[i] == 429 {
			assert.Equal(t, "rate_limit", c)
		}
	}
	assert.GreaterOrEqual(t, sim.MaxConcurrentPerKey(), 2)
	assert.Len(t, sim.Events(acct), 1)

	// Different customers do not wait for each other.
	for i := range 6 {
		sim.CreateCustomer(acct, fmt.Sprintf("cus_%d", i))
	}
	statuses, _ = burst(t, ts, 6, func(i int) string { return fmt.Sprintf("cus_%d", i) })
	assert.Equal(t, 6, countOf(statuses, 200), "%v", statuses)
}

func TestMaxConcurrentPerKey(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{Faults: stripesim.Faults{Latency: 200 * time.Millisecond}})
	assert.Zero(t, sim.MaxConcurrentPerKey())
	sc := client(ts, testKey)
	for i := range 3 {
		_, err := send(t, sc, eventParams("api_calls", "cus_acme", fmt.Sprint("seq-", i), 1, base))
		require.NoError(t, err)
	}
	assert.Equal(t, 1, sim.MaxConcurrentPerKey(), "sequential calls never overlap")

	for i := range 4 {
		sim.CreateCustomer(acct, fmt.Sprintf("cus_%d", i))
	}
	statuses, _ := burst(t, ts, 4, func(i int) string { return fmt.Sprintf("cus_%d", i) })
	assert.Equal(t, 4, countOf(statuses, 200))
	assert.Equal(t, 1, sim.MaxConcurrentPerKey(), "different customers are different keys")

	assert.Empty(t, sim.Overlaps(), "no overlap yet")

	statuses, _ = burst(t, ts, 3, func(int) string { return "cus_beta" })
	assert.Equal(t, 3, countOf(statuses, 200), "the flag is off: all pass")
	assert.Equal(t, 3, sim.MaxConcurrentPerKey())
	overlaps := sim.Overlaps()
	require.Len(t, overlaps, 2, "the second and the third call each arrived while others were in flight")
	for i, o := range overlaps {
		assert.Equal(t, "cus_beta", o.Customer)
		assert.Equal(t, "api_calls", o.EventName)
		require.Len(t, o.Calls, i+2)
		last := o.Calls[len(o.Calls)-1]
		assert.Zero(t, last.Age, "the arriving call is the last")
		for _, c := range o.Calls {
			assert.NotEmpty(t, c.Identifier)
			assert.False(t, c.ClientGone, "every client waited for its answer")
		}
		assert.False(t, o.Calls[0].Arrived.After(last.Arrived), "in the order they arrived")
	}
}

// summaries lists every summary with stripe-go's iterator.
func summaries(t *testing.T, sc *stripe.Client, meter, cust string, start, end time.Time, window string) []*stripe.BillingMeterEventSummary {
	t.Helper()
	p := &stripe.BillingMeterEventSummaryListParams{
		ID: stripe.String(meter), Customer: stripe.String(cust),
		StartTime: stripe.Int64(start.Unix()), EndTime: stripe.Int64(end.Unix()),
	}
	p.Limit = stripe.Int64(100)
	if window != "" {
		p.ValueGroupingWindow = stripe.String(window)
	}
	var out []*stripe.BillingMeterEventSummary
	for s, err := range sc.V1BillingMeterEventSummaries.List(context.Background(), p) {
		require.NoError(t, err)
		out = append(out, s)
	}
	return out
}

// windowValue is a summary as start, end and value.
type windowValue struct {
	start, end time.Time
	value      float64
}

func windows(ss []*stripe.BillingMeterEventSummary) []windowValue {
	out := make([]windowValue, len(ss))
	for i, s := range ss {
		out[i] = windowValue{time.Unix(s.StartTime, 0).UTC(), time.Unix(s.EndTime, 0).UTC(), s.AggregatedValue}
	}
	return out
}

func TestEventSummaries(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newMeterSim(t, stripesim.Limits{})
	sc := client(ts, testKey)
	day := time.Date(2026, 3, 8, 0, 0, 0, 0, time.UTC) // two days before base
	sendSummaryEvents(t, sc, clk, day)
	meters := map[string]string{}
	for _, m := range sim.Meters(acct) {
		meters[m.EventName] = m.ID
	}
	h := func(n int) time.Time { return day.Add(time.Duration(n) * time.Hour) }

	t.Run("Windows", func(t *testing.T) {
		for _, c := range []struct {
			meter  string
			window string
			start  time.Time
			end    time.Time
			want   []windowValue
		}{
			{"api_calls", "hour", h(0), h(48), []windowValue{{h(30), h(31), 10}, {h(11), h(12), 1}, {h(10), h(11), 12}}},
			{"seats", "hour", h(0), h(48), []windowValue{{h(30), h(31), 42}, {h(11), h(12), -1}, {h(10), h(11), 7}}},
			{"logins", "hour", h(0), h(48), []windowValue{{h(30), h(31), 1}, {h(11), h(12), 2}, {h(10), h(11), 2}}},
			{"api_calls", "day", h(0), h(48), []windowValue{{h(24), h(48), 10}, {h(0), h(24), 13}}},
			{"seats", "day", h(0), h(48), []windowValue{{h(24), h(48), 42}, {h(0), h(24), -1}}},
			{"logins", "day", h(0), h(48), []windowValue{{h(24), h(48), 1}, {h(0), h(24), 4}}},
			{"api_calls", "", h(0), h(48), []windowValue{{h(0), h(48), 23}}},
			{"api_calls", "", h(10), h(11).Add(30 * time.Minute), []windowValue{{h(10), h(11).Add(30 * time.Minute), 14}}},
			{"seats", "", h(0), h(12), []windowValue{{h(0), h(12), -1}}},
			{"api_calls", "", h(40), h(41), []windowValue{{h(40), h(41), 0}}},
			{"api_calls", "hour", h(40), h(41), []windowValue{}},
		} {
			got := windows(summaries(t, sc, meters[c.meter], "cus_acme", c.start, c.end, c.window))
			assert.Equal(t, c.want, got, "%s %s %v..%v", c.meter, c.window, c.start, c.end)
		}
	})

	t.Run("Object", func(t *testing.T) {
		ss := summaries(t, sc, meters["api_calls"], "cus_acme", h(0), h(48), "hour")
		require.NotEmpty(t, ss)
		assert.Equal(t, "billing.meter_event_summary", ss[0].Object)
		assert.Equal(t, meters["api_calls"], ss[0].Meter)
		assert.Regexp(t, `^mtrusg_test_`, ss[0].ID)
		assert.False(t, ss[0].Livemode)
	})

	t.Run("Validation", func(t *testing.T) { checkSummaryValidation(t, ts, meters["api_calls"], day) })
}

// sendSummaryEvents sends the events TestEventSummaries lists: the same
// values for api_calls, seats and logins of cus_acme, one api_calls event
// of cus_beta, and a second seats event at the last timestamp, received a
// second later.
func sendSummaryEvents(t *testing.T, sc *stripe.Client, clk *clock, day time.Time) {
	t.Helper()
	type ev struct {
		at    time.Duration // after day
		value int64
	}
	evs := []ev{
		{10 * time.Hour, 5}, {10*time.Hour + 59*time.Minute, 7}, {11 * time.Hour, 2},
		{11*time.Hour + 30*time.Minute, -1}, {30 * time.Hour, 10},
	}
	for i, e := range evs {
		for _, name := range []string{"api_calls", "seats", "logins"} {
			_, err := send(t, sc, eventParams(name, "cus_acme", fmt.Sprintf("%s-%d", name, i), e.value, day.Add(e.at)))
			require.NoError(t, err)
		}
	}
	// Another customer's usage never shows.
	_, err := send(t, sc, eventParams("api_calls", "cus_beta", "beta-1", 100, day.Add(10*time.Hour)))
	require.NoError(t, err)
	// Two seats events at one timestamp: the later received is last.
	clk.Add(time.Second)
	_, err = send(t, sc, eventParams("seats", "cus_acme", "seats-tie", 42, day.Add(30*time.Hour)))
	require.NoError(t, err)
}

// checkSummaryValidation checks the answers to invalid summary requests
// for meter over the two days from day, and for an unknown meter.
func checkSummaryValidation(t *testing.T, ts *httptest.Server, meter string, day time.Time) {
	t.Helper()
	h := func(n int) time.Time { return day.Add(time.Duration(n) * time.Hour) }
	path := "/v1/billing/meters/" + meter + "/event_summaries"
	unix := func(t time.Time) string { return strconv.FormatInt(t.Unix(), 10) }
	valid := func() url.Values {
		return url.Values{"customer": {"cus_acme"}, "start_time": {unix(h(0))}, "end_time": {unix(h(48))}, "value_grouping_window": {"day"}}
	}
	for _, c := range []struct {
		name        string
		edit        func(url.Values)
		status      int
		code, param string
	}{
		{"hour misaligned", func(v url.Values) {
			v.Set("value_grouping_window", "hour")
			v.Set("start_time", unix(h(1).Add(time.Minute)))
		}, 400, "", "start_time"},
		{"day not at midnight", func(v url.Values) { v.Set("start_time", unix(h(1))) }, 400, "", "start_time"},
		{"day end not at midnight", func(v url.Values) { v.Set("end_time", unix(h(47))) }, 400, "", "end_time"},
		{"minute misaligned", func(v url.Values) {
			v.Del("value_grouping_window")
			v.Set("end_time", unix(h(47).Add(time.Second)))
		}, 400, "", "end_time"},
		{"end before start", func(v url.Values) { v.Set("end_time", unix(h(0))) }, 400, "", "end_time"},
		{"bad window", func(v url.Values) { v.Set("value_grouping_window", "week") }, 400, "", "value_grouping_window"},
		{"no customer", func(v url.Values) { v.Del("customer") }, 400, "parameter_missing", "customer"},
		{"no start", func(v url.Values) { v.Del("start_time") }, 400, "parameter_missing", "start_time"},
		{"no end", func(v url.Values) { v.Del("end_time") }, 400, "parameter_missing", "end_time"},
		{"start not an integer", func(v url.Values) { v.Set("start_time", "monday") }, 400, "parameter_invalid_integer", "start_time"},
		{"unknown customer", func(v url.Values) { v.Set("customer", "cus_ghost") }, 400, "resource_missing", "customer"},
		{"unknown param", func(v url.Values) { v.Set("meter", "x") }, 400, "parameter_unknown", "meter"},
		{"unknown cursor", func(v url.Values) { v.Set("starting_after", "mtrusg_nope") }, 400, "resource_missing", "starting_after"},
	} {
		form := valid()
		c.edit(form)
		r := do(t, ts, http.MethodGet, path, testKey, form, nil)
		assert.Equal(t, c.status, r.status, c.name)
		assert.Equal(t, "invalid_request_error", r.errField("type"), c.name)
		assert.Equal(t, c.code, r.errField("code"), c.name)
		assert.Equal(t, c.param, r.errField("param"), c.name)
	}
	r := do(t, ts, http.MethodGet, "/v1/billing/meters/mtr_nope/event_summaries", testKey, valid(), nil)
	assert.Equal(t, http.StatusNotFound, r.status)
	assert.Equal(t, "No such billing meter: 'mtr_nope'", r.errField("message"))
}

func TestEventSummaryPagination(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{})
	sc := client(ts, testKey)
	start := base.Truncate(time.Hour).Add(-200 * time.Hour)
	const hours = 150
	for i := range hours {
		// Two events an hour, inside the hour.
		for j := range 2 {
			at := start.Add(time.Duration(i)*time.Hour + time.Duration(j*20)*time.Minute)
			_, err := send(t, sc, eventParams("api_calls", "cus_acme", fmt.Sprintf("p-%d-%d", i, j), int64(i), at))
			require.NoError(t, err)
		}
	}
	m := sim.Meters(acct)[0]
	ss := summaries(t, sc, m.ID, "cus_acme", start, start.Add(hours*time.Hour), "hour")
	require.Len(t, ss, hours)
	for k, s := range ss { // newest first
		i := hours - 1 - k
		assert.Equal(t, start.Add(time.Duration(i)*time.Hour).Unix(), s.StartTime)
		assert.Equal(t, float64(2*i), s.AggregatedValue)
	}
	reqs := 0
	for _, r := range sim.Requests() {
		if strings.HasSuffix(r.Path, "/event_summaries") {
			reqs++
		}
	}
	assert.Equal(t, 2, reqs, "100 + 50")

	// Raw cursors.
	path := "/v1/billing/meters/" + m.ID + "/event_summaries"
	form := url.Values{"customer": {"cus_acme"}, "start_time": {strconv.FormatInt(start.Unix(), 10)},
		"end_time": {strconv.FormatInt(start.Add(hours*time.Hour).Unix(), 10)}, "value_grouping_window": {"hour"}}
	r := do(t, ts, http.MethodGet, path, testKey, form, nil)
	assert.Len(t, r.body["data"], 10, "default limit")
	assert.Equal(t, true, r.body["has_more"])
	assert.Equal(t, path, r.body["url"])
	form.Set("limit", "5")
	form.Set("starting_after", ss[9].ID)
	r = do(t, ts, http.MethodGet, path, testKey, form, nil)
	data := r.body["data"].([]any)
	require.Len(t, data, 5)
	assert.Equal(t, ss[10].ID, data[0].(map[string]any)["id"])
	form.Del("starting_after")
	form.Set("ending_before", ss[3].ID)
	r = do(t, ts, http.MethodGet, path, testKey, form, nil)
	data = r.body["data"].([]any)
	require.Len(t, data, 3)
	assert.Equal(t, ss[0].ID, data[0].(map[string]any)["id"])
	assert.Equal(t, false, r.body["has_more"])
}

func TestCancelAdjustment(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newMeterSim(t, stripesim.Limits{})
	sc := client(ts, testKey)
	ctx := context.Background()
	at := base.Add(-time.Hour).Truncate(time.Hour)
	for i, v := range []int64{5, 7} {
		_, err := send(t, sc, eventParams("api_calls", "cus_acme", fmt.Sprint("ev-", i), v, at))
		require.NoError(t, err)
	}
	cancel := func(name, ident string) (*stripe.BillingMeterEventAdjustment, error) {
		return sc.V1BillingMeterEventAdjustments.Create(ctx, &stripe.BillingMeterEventAdjustmentCreateParams{
			EventName: stripe.String(name), Type: stripe.String("cancel"),
			Cancel: &stripe.BillingMeterEventAdjustmentCreateCancelParams{Identifier: stripe.String(ident)},
		})
	}
	adj, err := cancel("api_calls", "ev-0")
	require.NoError(t, err)
	assert.Equal(t, "billing.meter_event_adjustment", adj.Object)
	assert.Equal(t, stripe.BillingMeterEventAdjustmentStatusComplete, adj.Status)
	assert.Equal(t, stripe.BillingMeterEventAdjustmentTypeCancel, adj.Type)
	assert.Equal(t, "ev-0", adj.Cancel.Identifier)
	assert.Equal(t, "api_calls", adj.EventName)

	assert.Equal(t, stripesim.EventCancelled, sim.Events(acct)[0].Status)
	sum, count, _ := sim.Aggregate(acct, "api_calls", "cus_acme")
	assert.Equal(t, int64(7), sum)
	assert.Equal(t, 1, count)
	m := sim.Meters(acct)[0]
	ss := summaries(t, sc, m.ID, "cus_acme", at, at.Add(time.Hour), "hour")
	require.Len(t, ss, 1)
	assert.Equal(t, float64(7), ss[0].AggregatedValue)

	for _, c := range []struct {
		name, event, ident string
		code               stripe.ErrorCode
	}{
		{"again", "api_calls", "ev-0", ""},
		{"unknown identifier", "api_calls", "ev-9", stripe.ErrorCodeResourceMissing},
		{"other event name", "seats", "ev-1", stripe.ErrorCodeResourceMissing},
	} {
		_, err := cancel(c.event, c.ident)
		se := stripeErr(t, err)
		assert.Equal(t, http.StatusBadRequest, se.HTTPStatusCode, c.name)
		assert.Equal(t, c.code, se.Code, c.name)
		assert.Equal(t, "cancel[identifier]", se.Param, c.name)
	}

	clk.Add(24 * time.Hour)
	_, err = cancel("api_calls", "ev-1")
	se := stripeErr(t, err)
	assert.Contains(t, se.Msg, "more than 24 hours ago")
	assert.Equal(t, stripesim.EventRecorded, sim.Events(acct)[1].Status)

	for _, c := range []struct {
		form  url.Values
		param string
	}{
		{url.Values{"type": {"cancel"}, "cancel[identifier]": {"ev-1"}}, "event_name"},
		{url.Values{"event_name": {"api_calls"}, "cancel[identifier]": {"ev-1"}}, "type"},
		{url.Values{"event_name": {"api_calls"}, "type": {"range"}, "cancel[identifier]": {"ev-1"}}, "type"},
		{url.Values{"event_name": {"api_calls"}, "type": {"cancel"}}, "cancel[identifier]"},
	} {
		r := do(t, ts, http.MethodPost, "/v1/billing/meter_event_adjustments", testKey, c.form, nil)
		assert.Equal(t, http.StatusBadRequest, r.status)
		assert.Equal(t, c.param, r.errField("param"))
	}
}

// TestAdjustmentFaults checks that adjustments meet the faults of meter
// events where their real counterparts would: a 500 after the cancel was
// applied, kept for the key; a lost reply; a 429 that applies nothing; and
// an answer delayed past the client's patience, which Unheard counts while
// the cancel stays applied — the crash between sending an adjustment and
// recording its answer.
func TestAdjustmentFaults(t *testing.T) {
	t.Parallel()
	at := base.Add(-time.Hour)
	cancelParams := func(ident, key string) *stripe.BillingMeterEventAdjustmentCreateParams {
		p := &stripe.BillingMeterEventAdjustmentCreateParams{
			EventName: stripe.String("logins"), Type: stripe.String("cancel"),
			Cancel: &stripe.BillingMeterEventAdjustmentCreateCancelParams{Identifier: stripe.String(ident)},
		}
		p.SetIdempotencyKey(key)
		return p
	}
	setup := func(t *testing.T, f stripesim.Faults) (*stripesim.Server, *stripe.Client) {
		sim, ts, _ := newMeterSim(t, stripesim.Limits{})
		sc := client(ts, testKey)
		_, err := send(t, sc, eventParams("logins", "cus_acme", "ev-1", 1, at))
		require.NoError(t, err)
		sim.Configure(acct, stripesim.Limits{Faults: f})
		return sim, sc
	}
	status := func(sim *stripesim.Server) string { return sim.Events(acct)[0].Status }
	ctx := context.Background()

	t.Run("FailAfterRecord", func(t *testing.T) {
		t.Parallel()
		sim, sc := setup(t, stripesim.Faults{FailAfterRecord: 1})
		_, err := sc.V1BillingMeterEventAdjustments.Create(ctx, cancelParams("ev-1", "k1"))
		se := stripeErr(t, err)
		assert.Equal(t, http.StatusInternalServerError, se.HTTPStatusCode)
		assert.Equal(t, stripesim.EventCancelled, status(sim), "applied before the 500")
		sim.Configure(acct, stripesim.Limits{})
		_, err = sc.V1BillingMeterEventAdjustments.Create(ctx, cancelParams("ev-1", "k1"))
		se = stripeErr(t, err)
		assert.Equal(t, http.StatusInternalServerError, se.HTTPStatusCode, "the 500 is kept for the key")
		assert.Equal(t, "true", se.LastResponse.Header.Get("Idempotent-Replayed"))
		_, err = sc.V1BillingMeterEventAdjustments.Create(ctx, cancelParams("ev-1", "k2"))
		se = stripeErr(t, err)
		assert.Equal(t, http.StatusBadRequest, se.HTTPStatusCode, "another key meets the cancelled event")
		assert.Contains(t, se.Msg, "already been cancelled")
	})
	for _, c := range []struct {
		name   string
		f      stripesim.Faults
		status int
	}{
		{"FailBeforeRecord", stripesim.Faults{FailBeforeRecord: 1}, http.StatusInternalServerError},
		{"RateLimitFault", stripesim.Faults{RateLimitFault: 1}, http.StatusTooManyRequests},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			sim, sc := setup(t, c.f)
			_, err := sc.V1BillingMeterEventAdjustments.Create(ctx, cancelParams("ev-1", "k1"))
			assert.Equal(t, c.status, stripeErr(t, err).HTTPStatusCode)
			assert.Equal(t, stripesim.EventRecorded, status(sim), "nothing applied")
		})
	}
	t.Run("LoseReply", func(t *testing.T) {
		t.Parallel()
		sim, sc := setup(t, stripesim.Faults{LoseReply: 1})
		_, err := sc.V1BillingMeterEventAdjustments.Create(ctx, cancelParams("ev-1", "k1"))
		assert.Equal(t, http.StatusBadGateway, stripeErr(t, err).HTTPStatusCode)
		assert.Equal(t, stripesim.EventCancelled, status(sim))
		sim.Configure(acct, stripesim.Limits{})
		adj, err := sc.V1BillingMeterEventAdjustments.Create(ctx, cancelParams("ev-1", "k1"))
		require.NoError(t, err, "the kept success is replayed")
		assert.Equal(t, "true", adj.LastResponse.Header.Get("Idempotent-Replayed"))
	})
	t.Run("ReplyDelay", func(t *testing.T) {
		t.Parallel()
		sim, sc := setup(t, stripesim.Faults{ReplyDelay: 300 * time.Millisecond})
		cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		_, err := sc.V1BillingMeterEventAdjustments.Create(cctx, cancelParams("ev-1", "k1"))
		require.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Equal(t, stripesim.EventCancelled, status(sim), "carried out though never heard")
		require.Eventually(t, func() bool { return sim.Unheard() == 1 }, 2*time.Second, 5*time.Millisecond)
		// A patient client hears the kept answer, late.
		start := time.Now()
		adj, err := sc.V1BillingMeterEventAdjustments.Create(ctx, cancelParams("ev-1", "k1"))
		require.NoError(t, err)
		assert.Equal(t, "true", adj.LastResponse.Header.Get("Idempotent-Replayed"))
		assert.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond)
		assert.Equal(t, 1, sim.Unheard())
	})
}

// doJSON posts a JSON body with a bearer token and decodes the answer.
func doJSON(t *testing.T, ts *httptest.Server, path, token string, body any) response {
	t.Helper()
	b, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := http.NewRequest(http.MethodPost, ts.URL+path, bytes.NewReader(b))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+token)
	res, err := ts.Client().Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	raw, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	assert.Regexp(t, `^req_`, res.Header.Get("Request-Id"))
	out := response{status: res.StatusCode, header: res.Header}
	require.NoError(t, json.Unmarshal(raw, &out.body), string(raw))
	return out
}

func streamEvent(name, cust, ident, value string, at time.Time) *stripe.V2BillingMeterEventStreamCreateEventParams {
	return &stripe.V2BillingMeterEventStreamCreateEventParams{
		EventName: stripe.String(name), Identifier: stripe.String(ident),
		Payload:   map[string]string{"stripe_customer_id": cust, "value": value},
		Timestamp: &at,
	}
}

// v2StreamRun is the state TestV2Stream's steps share: a simulator, one
// session of its test mode and a client with that session's token.
type v2StreamRun struct {
	sim  *stripesim.Server
	ts   *httptest.Server
	clk  *clock
	sess *stripe.V2BillingMeterEventSession
	sc   *stripe.Client // with the session's token
	at   time.Time      // the events' timestamp
	many []*stripe.V2BillingMeterEventStreamCreateEventParams
}

func TestV2Stream(t *testing.T) {
	t.Parallel()
	sim, ts, clk := newMeterSim(t, stripesim.Limits{})
	run := &v2StreamRun{sim: sim, ts: ts, clk: clk, at: base.Add(-time.Hour)}
	step(t, "CreateSession", run.createSession)
	step(t, "ValidatesAsynchronously", run.validatesAsynchronously)
	step(t, "SharesIdentifiersWithV1", func(t *testing.T) {
		_, err := send(t, client(ts, testKey), eventParams("api_calls", "cus_acme", "s-1", 5, run.at))
		assert.Equal(t, "An event already exists with identifier s-1.", stripeErr(t, err).Msg)
	})
	step(t, "OneToHundredEvents", run.oneToHundredEvents)
	step(t, "UnknownAndExpiredTokens", run.unknownAndExpiredTokens)
	step(t, "ConnectedAccount", run.connectedAccount)
	step(t, "TokenNotRecorded", func(t *testing.T) {
		for _, rec := range sim.Requests() {
			assert.NotContains(t, fmt.Sprintf("%#v", rec), run.sess.AuthenticationToken)
		}
	})
}

// createSession creates the session of the run and checks it.
func (run *v2StreamRun) createSession(t *testing.T) {
	sess, err := client(run.ts, testKey).V2BillingMeterEventSessions.Create(context.Background(), nil)
	require.NoError(t, err)
	assert.Equal(t, "v2.billing.meter_event_session", sess.Object)
	assert.NotEmpty(t, sess.ID)
	assert.NotEmpty(t, sess.AuthenticationToken)
	assert.True(t, sess.Created.Equal(base))
	assert.True(t, sess.ExpiresAt.Equal(base.Add(15*time.Minute)))
	assert.False(t, sess.Livemode)
	run.sess = sess
	run.sc = client(run.ts, sess.AuthenticationToken)
}

// validatesAsynchronously streams valid, duplicate and invalid events: the
// request is answered 200, the valid events are recorded and the invalid
// ones reported.
func (run *v2StreamRun) validatesAsynchronously(t *testing.T) {
	sim, at := run.sim, run.at
	err := run.sc.V2BillingMeterEventStreams.Create(context.Background(), &stripe.V2BillingMeterEventStreamCreateParams{Events: []*stripe.V2BillingMeterEventStreamCreateEventParams{
		streamEvent("api_calls", "cus_acme", "s-1", "5", at),
		streamEvent("api_calls", "cus_acme", "s-2", "6", at),
		streamEvent("api_calls", "cus_acme", "s-1", "5", at), // duplicate: ignored
		streamEvent("nope", "cus_acme", "s-3", "1", at),
		streamEvent("nope", "cus_acme", "s-4", "1", at),
		streamEvent("api_calls", "cus_ghost", "s-5", "1", at),
		streamEvent("api_calls", "cus_acme", "s-6", "1.5", at),
		streamEvent("api_calls", "cus_acme", "s-7", "1", base.Add(-36*24*time.Hour)),
		streamEvent("api_calls", "cus_acme", "s-8", "1", base.Add(time.Hour)),
		{EventName: stripe.String("api_calls"), Identifier: stripe.String("s-9"), Payload: map[string]string{"value": "1"}},
	}})
	require.NoError(t, err, "validation is asynchronous")

	evs := sim.Events(acct)
	require.Len(t, evs, 2)
	assert.True(t, evs[0].Stream)
	sum, _, _ := sim.Aggregate(acct, "api_calls", "cus_acme")
	assert.Equal(t, int64(11), sum)

	meter := sim.Meters(acct)[0].ID
	type rep struct {
		typ, meter, eventName, code string
		idents                      []string
	}
	var got []rep
	for _, r := range sim.ErrorReports(acct) {
		got = append(got, rep{r.Type, r.Meter, r.EventName, r.Code, r.Identifiers})
		assert.Equal(t, base, r.Created)
		assert.Equal(t, len(r.Identifiers), r.ErrorCount)
		assert.NotEmpty(t, r.Message)
	}
	assert.Equal(t, []rep{
		{stripesim.ReportNoMeterFound, "", "nope", "no_meter", []string{"s-3", "s-4"}},
		{stripesim.ReportErrorTriggered, meter, "api_calls", "meter_event_customer_not_found", []string{"s-5"}},
		{stripesim.ReportErrorTriggered, meter, "api_calls", "meter_event_invalid_value", []string{"s-6"}},
		{stripesim.ReportErrorTriggered, meter, "api_calls", "timestamp_too_far_in_past", []string{"s-7"}},
		{stripesim.ReportErrorTriggered, meter, "api_calls", "timestamp_in_future", []string{"s-8"}},
		{stripesim.ReportErrorTriggered, meter, "api_calls", "meter_event_no_customer_defined", []string{"s-9"}},
	}, got)
}

// oneToHundredEvents checks that a request carries at most 100 events and
// at least one, and that a JSON number is a valid value.
func (run *v2StreamRun) oneToHundredEvents(t *testing.T) {
	ctx, tok := context.Background(), run.sess.AuthenticationToken
	run.many = make([]*stripe.V2BillingMeterEventStreamCreateEventParams, 101)
	for i := range run.many {
		run.many[i] = streamEvent("api_calls", "cus_acme", fmt.Sprint("m-", i), "1", run.at)
	}
	err := run.sc.V2BillingMeterEventStreams.Create(ctx, &stripe.V2BillingMeterEventStreamCreateParams{Events: run.many})
	var raw *stripe.V2RawError
	require.ErrorAs(t, err, &raw)
	assert.Equal(t, stripe.ErrorTypeInvalidRequest, *raw.Type)
	assert.Contains(t, raw.Message, "at most 100 events")
	err = run.sc.V2BillingMeterEventStreams.Create(ctx, &stripe.V2BillingMeterEventStreamCreateParams{Events: run.many[:100]})
	require.NoError(t, err)
	assert.Len(t, run.sim.Events(acct), 102)
	r := doJSON(t, run.ts, "/v2/billing/meter_event_stream", tok, map[string]any{"events": []any{}})
	assert.Equal(t, http.StatusBadRequest, r.status)
	assert.Equal(t, "parameter_missing", r.errField("code"))
	r = doJSON(t, run.ts, "/v2/billing/meter_event_stream", tok,
		map[string]any{"events": []any{map[string]any{"event_name": "api_calls", "payload": map[string]any{"stripe_customer_id": "cus_acme", "value": 3}}}})
	assert.Equal(t, http.StatusOK, r.status, "a JSON number value is accepted; Stripe answers 200 {}")
	assert.Equal(t, map[string]any{}, r.body)
}

// unknownAndExpiredTokens checks that unknown tokens, API keys and expired
// sessions are answered 401.
func (run *v2StreamRun) unknownAndExpiredTokens(t *testing.T) {
	for _, tok := range []string{"mesk_test_unknown", testKey} {
		r := doJSON(t, run.ts, "/v2/billing/meter_event_stream", tok, map[string]any{"events": []any{}})
		assert.Equal(t, http.StatusUnauthorized, r.status)
		assert.Equal(t, "billing_meter_event_session_expired", r.errField("code"))
	}
	run.clk.Add(15 * time.Minute)
	err := run.sc.V2BillingMeterEventStreams.Create(context.Background(), &stripe.V2BillingMeterEventStreamCreateParams{Events: run.many[:1]})
	var expired *stripe.TemporarySessionExpiredError
	require.ErrorAs(t, err, &expired)
	assert.Equal(t, "billing_meter_event_session_expired", expired.Code)
	assert.Equal(t, http.StatusUnauthorized, expired.LastResponse.StatusCode)
}

// connectedAccount checks that a session made with Stripe-Account streams
// into that account.
func (run *v2StreamRun) connectedAccount(t *testing.T) {
	ctx, sim := context.Background(), run.sim
	sim.AddAccount("acct_conn")
	sim.CreateMeter("acct_conn", stripesim.MeterSpec{EventName: "api_calls"})
	sim.CreateCustomer("acct_conn", "cus_acme")
	sp := &stripe.V2BillingMeterEventSessionCreateParams{}
	sp.SetStripeAccount("acct_conn")
	cs, err := client(run.ts, testKey).V2BillingMeterEventSessions.Create(ctx, sp)
	require.NoError(t, err)
	err = client(run.ts, cs.AuthenticationToken).V2BillingMeterEventStreams.Create(ctx, &stripe.V2BillingMeterEventStreamCreateParams{
		Events: []*stripe.V2BillingMeterEventStreamCreateEventParams{streamEvent("api_calls", "cus_acme", "c-1", "2", base)},
	})
	require.NoError(t, err)
	require.Len(t, sim.Events("acct_conn"), 1)
	assert.Equal(t, "acct_conn", sim.Requests()[len(sim.Requests())-1].Account)
}
