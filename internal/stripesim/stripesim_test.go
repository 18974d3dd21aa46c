package stripesim_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

const (
	testKey = "sk_test_51SimKeyForTestsabcd"
	liveKey = "sk_live_51SimLiveKeyForTestswxyz"
	acct    = "acct_platform"
)

// newSim starts a simulator with a test and a live key for acct.
func newSim(t *testing.T) (*stripesim.Server, *httptest.Server) {
	t.Helper()
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{testKey: acct, liveKey: acct}})
	ts := httptest.NewServer(sim.Handler())
	t.Cleanup(ts.Close)
	return sim, ts
}

// client is stripe-go pointed at the simulator.
func client(ts *httptest.Server, key string) *stripe.Client {
	return stripe.NewClient(key, stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL:               stripe.String(ts.URL),
		HTTPClient:        ts.Client(),
		MaxNetworkRetries: stripe.Int64(0),
		LeveledLogger:     &stripe.LeveledLogger{Level: stripe.LevelNull},
		EnableTelemetry:   stripe.Bool(false),
	})))
}

type response struct {
	status int
	header http.Header
	body   map[string]any
}

// errField returns body.error[name] as a string.
func (r response) errField(name string) string {
	e, _ := r.body["error"].(map[string]any)
	s, _ := e[name].(string)
	return s
}

// do sends a raw request; every response must carry a req_ Request-Id and
// be JSON.
func do(t *testing.T, ts *httptest.Server, method, path, key string, form url.Values, header map[string]string) response {
	t.Helper()
	var body io.Reader
	if method == http.MethodGet {
		if len(form) > 0 {
			path += "?" + form.Encode()
		}
	} else {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, ts.URL+path, body)
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	res, err := ts.Client().Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	raw, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	assert.Regexp(t, `^req_[0-9A-Za-z]{14}$`, res.Header.Get("Request-Id"))
	assert.Equal(t, "application/json", res.Header.Get("Content-Type"))
	out := response{status: res.StatusCode, header: res.Header}
	require.NoError(t, json.Unmarshal(raw, &out.body), string(raw))
	return out
}

func stripeErr(t *testing.T, err error) *stripe.Error {
	t.Helper()
	var se *stripe.Error
	require.ErrorAs(t, err, &se)
	return se
}

// step runs one named step of a test whose steps build on each other, as
// a subtest, and stops the test when the step stopped (a failed require):
// the later steps would only fail for its sake. A step whose assertions
// failed without stopping it lets the later steps run, as one long test
// would.
func step(t *testing.T, name string, f func(t *testing.T)) {
	t.Helper()
	finished := false
	t.Run(name, func(t *testing.T) {
		f(t)
		finished = true
	})
	if !finished {
		t.FailNow()
	}
}

func TestAccount(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	sim.AddAccount("acct_connected")
	ctx := context.Background()

	a, err := client(ts, testKey).V1Accounts.Retrieve(ctx, nil)
	require.NoError(t, err)
	assert.Equal(t, acct, a.ID)
	assert.Equal(t, "account", a.Object)
	assert.NotZero(t, a.Created)
	assert.Regexp(t, `^req_`, a.LastResponse.RequestID)

	p := &stripe.AccountRetrieveParams{}
	p.SetStripeAccount("acct_connected")
	a, err = client(ts, testKey).V1Accounts.Retrieve(ctx, p)
	require.NoError(t, err)
	assert.Equal(t, "acct_connected", a.ID)

	p = &stripe.AccountRetrieveParams{}
	p.SetStripeAccount("acct_nobody")
	_, err = client(ts, testKey).V1Accounts.Retrieve(ctx, p)
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusForbidden, se.HTTPStatusCode)
	assert.Equal(t, stripe.ErrorTypeInvalidRequest, se.Type)
	assert.Equal(t, stripe.ErrorCode("account_invalid"), se.Code)
	assert.Contains(t, se.Msg, "does not have access to account 'acct_nobody'")
	assert.Contains(t, se.Msg, "sk_test_****abcd")
	assert.NotContains(t, se.Msg, testKey)
	assert.Regexp(t, `^req_`, se.RequestID)
}

func TestAuthentication(t *testing.T) {
	t.Parallel()
	_, ts := newSim(t)

	r := do(t, ts, http.MethodGet, "/v1/account", "", nil, nil)
	assert.Equal(t, http.StatusUnauthorized, r.status)
	assert.Equal(t, "invalid_request_error", r.errField("type"))
	assert.Contains(t, r.errField("message"), "You did not provide an API key")

	const unknown = "sk_test_unknownSECRETabcd"
	_, err := client(ts, unknown).V1Accounts.Retrieve(context.Background(), nil)
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusUnauthorized, se.HTTPStatusCode)
	assert.Equal(t, stripe.ErrorTypeInvalidRequest, se.Type)
	assert.Equal(t, "Invalid API Key provided: sk_test_****abcd", se.Msg)
	assert.NotContains(t, se.Error(), "SECRET")

	r = do(t, ts, http.MethodGet, "/v1/account", "", nil, map[string]string{"Authorization": "Bearer rk_live_x"})
	assert.Equal(t, "Invalid API Key provided: rk_live_****", r.errField("message"))

	// Basic auth with the key as user name, as curl -u sends it.
	req, err := http.NewRequest(http.MethodGet, ts.URL+"/v1/account", nil)
	require.NoError(t, err)
	req.SetBasicAuth(testKey, "")
	res, err := ts.Client().Do(req)
	require.NoError(t, err)
	res.Body.Close()
	assert.Equal(t, http.StatusOK, res.StatusCode)
}

func TestUnrecognizedURL(t *testing.T) {
	t.Parallel()
	_, ts := newSim(t)
	for _, c := range []struct{ method, path string }{
		{http.MethodGet, "/v1/customers"},
		{http.MethodDelete, "/v1/billing/meters"},
		{http.MethodPost, "/v1/billing/meters/mtr_x/archive"},
	} {
		r := do(t, ts, c.method, c.path, testKey, nil, nil)
		assert.Equal(t, http.StatusNotFound, r.status, c.path)
		assert.Equal(t, "invalid_request_error", r.errField("type"))
		assert.Contains(t, r.errField("message"), fmt.Sprintf("Unrecognized request URL (%s: %s)", c.method, c.path))
	}
}

func createParams(eventName string) *stripe.BillingMeterCreateParams {
	return &stripe.BillingMeterCreateParams{
		DisplayName:        stripe.String("Display " + eventName),
		EventName:          stripe.String(eventName),
		DefaultAggregation: &stripe.BillingMeterCreateDefaultAggregationParams{Formula: stripe.String("sum")},
	}
}

func TestCreateAndRetrieveMeter(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	ctx := context.Background()
	sc := client(ts, testKey)

	p := createParams("api_calls")
	p.DefaultAggregation.Formula = stripe.String("count")
	p.CustomerMapping = &stripe.BillingMeterCreateCustomerMappingParams{EventPayloadKey: stripe.String("cust"), Type: stripe.String("by_id")}
	p.ValueSettings = &stripe.BillingMeterCreateValueSettingsParams{EventPayloadKey: stripe.String("qty")}
	p.EventTimeWindow = stripe.String("hour")
	m, err := sc.V1BillingMeters.Create(ctx, p)
	require.NoError(t, err)
	assert.Regexp(t, `^mtr_[0-9A-Za-z]+$`, m.ID)
	assert.Equal(t, "billing.meter", m.Object)
	assert.Equal(t, "api_calls", m.EventName)
	assert.Equal(t, "Display api_calls", m.DisplayName)
	assert.Equal(t, stripe.BillingMeterDefaultAggregationFormulaCount, m.DefaultAggregation.Formula)
	assert.Equal(t, "cust", m.CustomerMapping.EventPayloadKey)
	assert.Equal(t, stripe.BillingMeterCustomerMappingTypeByID, m.CustomerMapping.Type)
	assert.Equal(t, "qty", m.ValueSettings.EventPayloadKey)
	assert.Equal(t, stripe.BillingMeterEventTimeWindowHour, m.EventTimeWindow)
	assert.Equal(t, stripe.BillingMeterStatusActive, m.Status)
	assert.Zero(t, m.StatusTransitions.DeactivatedAt)
	assert.False(t, m.Livemode)
	assert.NotZero(t, m.Created)

	got, err := sc.V1BillingMeters.Retrieve(ctx, m.ID, nil)
	require.NoError(t, err)
	assert.Equal(t, m.ID, got.ID)
	assert.Equal(t, "qty", got.ValueSettings.EventPayloadKey)

	// Defaults for the payload keys.
	d, err := sc.V1BillingMeters.Create(ctx, createParams("tokens"))
	require.NoError(t, err)
	assert.Equal(t, "stripe_customer_id", d.CustomerMapping.EventPayloadKey)
	assert.Equal(t, "value", d.ValueSettings.EventPayloadKey)
	assert.Empty(t, d.EventTimeWindow)

	ms := sim.Meters(acct)
	require.Len(t, ms, 2)
	assert.Equal(t, stripesim.Meter{
		ID: m.ID, DisplayName: "Display api_calls", EventName: "api_calls", Formula: "count",
		CustomerPayloadKey: "cust", ValuePayloadKey: "qty", EventTimeWindow: "hour", Status: "active",
		Created: ms[0].Created, Updated: ms[0].Updated,
	}, ms[0])

	// The live key lives in another mode: it sees none of the test meters
	// and its own carry livemode.
	live := client(ts, liveKey)
	_, err = live.V1BillingMeters.Retrieve(ctx, m.ID, nil)
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode)
	lm, err := live.V1BillingMeters.Create(ctx, createParams("api_calls")) // no clash across modes
	require.NoError(t, err)
	assert.True(t, lm.Livemode)
	assert.Len(t, sim.Meters(acct), 3)
}

func TestCreateMeterValidation(t *testing.T) {
	t.Parallel()
	_, ts := newSim(t)
	valid := func() url.Values {
		return url.Values{"display_name": {"D"}, "event_name": {"e"}, "default_aggregation[formula]": {"sum"}}
	}
	for _, c := range []struct {
		name          string
		edit          func(url.Values)
		code, param   string
		messagePrefix string
	}{
		{"no event_name", func(v url.Values) { v.Del("event_name") }, "parameter_missing", "event_name", "Missing required param: event_name."},
		{"no display_name", func(v url.Values) { v.Del("display_name") }, "parameter_missing", "display_name", "Missing required param"},
		{"no formula", func(v url.Values) { v.Del("default_aggregation[formula]") }, "parameter_missing", "default_aggregation[formula]", "Missing required param"},
		{"bad formula", func(v url.Values) { v.Set("default_aggregation[formula]", "avg") }, "", "default_aggregation[formula]", "Invalid default_aggregation[formula]"},
		{"bad mapping type", func(v url.Values) {
			v.Set("customer_mapping[type]", "by_email")
			v.Set("customer_mapping[event_payload_key]", "c")
		}, "", "customer_mapping[type]", "Invalid customer_mapping[type]"},
		{"half mapping", func(v url.Values) { v.Set("customer_mapping[type]", "by_id") }, "parameter_missing", "customer_mapping[event_payload_key]", "Missing"},
		{"bad window", func(v url.Values) { v.Set("event_time_window", "week") }, "", "event_time_window", "Invalid event_time_window"},
		{"unknown param", func(v url.Values) { v.Set("colour", "red") }, "parameter_unknown", "colour", "Received unknown parameter: colour"},
	} {
		form := valid()
		c.edit(form)
		r := do(t, ts, http.MethodPost, "/v1/billing/meters", testKey, form, nil)
		assert.Equal(t, http.StatusBadRequest, r.status, c.name)
		assert.Equal(t, "invalid_request_error", r.errField("type"), c.name)
		assert.Equal(t, c.code, r.errField("code"), c.name)
		assert.Equal(t, c.param, r.errField("param"), c.name)
		assert.True(t, strings.HasPrefix(r.errField("message"), c.messagePrefix), "%s: %s", c.name, r.errField("message"))
	}
}

func TestDuplicateEventNameAndTransitions(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	ctx := context.Background()
	sc := client(ts, testKey)

	first, err := sc.V1BillingMeters.Create(ctx, createParams("api_calls"))
	require.NoError(t, err)
	_, err = sc.V1BillingMeters.Create(ctx, createParams("api_calls"))
	se := stripeErr(t, err)
	assert.Equal(t, http.StatusBadRequest, se.HTTPStatusCode)
	assert.Equal(t, "event_name", se.Param)
	assert.Equal(t, stripe.ErrorCodeResourceAlreadyExists, se.Code)

	d, err := sc.V1BillingMeters.Deactivate(ctx, first.ID, nil)
	require.NoError(t, err)
	assert.Equal(t, stripe.BillingMeterStatusInactive, d.Status)
	assert.NotZero(t, d.StatusTransitions.DeactivatedAt)
	assert.Equal(t, "inactive", sim.Meters(acct)[0].Status)

	_, err = sc.V1BillingMeters.Deactivate(ctx, first.ID, nil)
	assert.Equal(t, http.StatusBadRequest, stripeErr(t, err).HTTPStatusCode)

	// The event name is free again once the first meter is inactive …
	second, err := sc.V1BillingMeters.Create(ctx, createParams("api_calls"))
	require.NoError(t, err)
	// … so the first cannot come back while the second is active.
	_, err = sc.V1BillingMeters.Reactivate(ctx, first.ID, nil)
	assert.Equal(t, "event_name", stripeErr(t, err).Param)

	require.NoError(t, sim.DeactivateMeter(acct, second.ID))
	require.Error(t, sim.DeactivateMeter(acct, "mtr_nope"))
	re, err := sc.V1BillingMeters.Reactivate(ctx, first.ID, nil)
	require.NoError(t, err)
	assert.Equal(t, stripe.BillingMeterStatusActive, re.Status)
	assert.Zero(t, re.StatusTransitions.DeactivatedAt)

	for _, call := range []func() error{
		func() error { _, err := sc.V1BillingMeters.Retrieve(ctx, "mtr_unknown", nil); return err },
		func() error { _, err := sc.V1BillingMeters.Deactivate(ctx, "mtr_unknown", nil); return err },
		func() error { _, err := sc.V1BillingMeters.Reactivate(ctx, "mtr_unknown", nil); return err },
	} {
		se := stripeErr(t, call())
		assert.Equal(t, http.StatusNotFound, se.HTTPStatusCode)
		assert.Equal(t, stripe.ErrorCodeResourceMissing, se.Code)
		assert.Equal(t, "No such billing meter: 'mtr_unknown'", se.Msg)
	}
}

func TestListPagination(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	var ids []string // creation order
	for i := range 250 {
		m := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: fmt.Sprintf("ev_%03d", i)})
		ids = append(ids, m.ID)
	}
	newestFirst := make([]string, len(ids))
	for i, id := range ids {
		newestFirst[len(ids)-1-i] = id
	}
	pageIDs := func(r response) []string {
		var out []string
		for _, d := range r.body["data"].([]any) {
			out = append(out, d.(map[string]any)["id"].(string))
		}
		return out
	}

	r := do(t, ts, http.MethodGet, "/v1/billing/meters", testKey, nil, nil)
	assert.Equal(t, "list", r.body["object"])
	assert.Equal(t, "/v1/billing/meters", r.body["url"])
	assert.Equal(t, true, r.body["has_more"])
	assert.Equal(t, newestFirst[:10], pageIDs(r), "default limit 10, newest first")

	var walked []string
	cursor := url.Values{"limit": {"100"}}
	for pages := 1; ; pages++ {
		r := do(t, ts, http.MethodGet, "/v1/billing/meters", testKey, cursor, nil)
		require.Equal(t, http.StatusOK, r.status)
		got := pageIDs(r)
		walked = append(walked, got...)
		if r.body["has_more"] != true {
			assert.Equal(t, 3, pages)
			assert.Len(t, got, 50)
			break
		}
		assert.Len(t, got, 100)
		cursor.Set("starting_after", got[len(got)-1])
	}
	assert.Equal(t, newestFirst, walked)

	// ending_before gives the items just before the cursor, in list order.
	r = do(t, ts, http.MethodGet, "/v1/billing/meters", testKey, url.Values{"limit": {"3"}, "ending_before": {newestFirst[5]}}, nil)
	assert.Equal(t, newestFirst[2:5], pageIDs(r))
	assert.Equal(t, true, r.body["has_more"])
	r = do(t, ts, http.MethodGet, "/v1/billing/meters", testKey, url.Values{"limit": {"3"}, "ending_before": {newestFirst[2]}}, nil)
	assert.Equal(t, newestFirst[:2], pageIDs(r))
	assert.Equal(t, false, r.body["has_more"])

	// stripe-go's iterator walks every page.
	var all []string
	for m, err := range client(ts, testKey).V1BillingMeters.List(context.Background(), &stripe.BillingMeterListParams{ListParams: stripe.ListParams{Limit: stripe.Int64(100)}}) {
		require.NoError(t, err)
		all = append(all, m.ID)
	}
	assert.Equal(t, newestFirst, all)

	// Status filter.
	for _, id := range ids[:7] {
		require.NoError(t, sim.DeactivateMeter(acct, id))
	}
	r = do(t, ts, http.MethodGet, "/v1/billing/meters", testKey, url.Values{"status": {"inactive"}, "limit": {"100"}}, nil)
	assert.Len(t, pageIDs(r), 7)
	assert.Equal(t, false, r.body["has_more"])
	r = do(t, ts, http.MethodGet, "/v1/billing/meters", testKey, url.Values{"status": {"active"}, "limit": {"100"}, "starting_after": {newestFirst[200]}}, nil)
	assert.Len(t, pageIDs(r), 49-7)

	// The other mode sees an empty list.
	r = do(t, ts, http.MethodGet, "/v1/billing/meters", liveKey, nil, nil)
	assert.Equal(t, []any{}, r.body["data"])
	assert.Equal(t, false, r.body["has_more"])

	for _, c := range []struct {
		form  url.Values
		param string
	}{
		{url.Values{"limit": {"101"}}, "limit"},
		{url.Values{"limit": {"0"}}, "limit"},
		{url.Values{"limit": {"ten"}}, "limit"},
		{url.Values{"status": {"archived"}}, "status"},
		{url.Values{"starting_after": {"mtr_gone"}}, "starting_after"},
		{url.Values{"starting_after": {ids[0]}, "ending_before": {ids[1]}}, "ending_before"},
		{url.Values{"created": {"1"}}, "created"},
	} {
		r := do(t, ts, http.MethodGet, "/v1/billing/meters", testKey, c.form, nil)
		assert.Equal(t, http.StatusBadRequest, r.status, c.form.Encode())
		assert.Equal(t, c.param, r.errField("param"), c.form.Encode())
	}
}

func TestStripeAccountScopesState(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	sim.AddAccount("acct_connected")
	ctx := context.Background()
	sc := client(ts, testKey)

	p := createParams("connected_calls")
	p.SetStripeAccount("acct_connected")
	m, err := sc.V1BillingMeters.Create(ctx, p)
	require.NoError(t, err)
	require.Len(t, sim.Meters("acct_connected"), 1)
	assert.Empty(t, sim.Meters(acct))

	_, err = sc.V1BillingMeters.Retrieve(ctx, m.ID, nil)
	assert.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode, "not visible from the platform")
	rp := &stripe.BillingMeterRetrieveParams{}
	rp.SetStripeAccount("acct_connected")
	_, err = sc.V1BillingMeters.Retrieve(ctx, m.ID, rp)
	require.NoError(t, err)

	lp := &stripe.BillingMeterListParams{}
	lp.SetStripeAccount("acct_unknown")
	for _, err := range sc.V1BillingMeters.List(ctx, lp) {
		assert.Equal(t, http.StatusForbidden, stripeErr(t, err).HTTPStatusCode)
	}
}

func TestRequestsRecorded(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	sim.AddAccount("acct_connected")
	ctx := context.Background()
	sc := client(ts, testKey)

	p := createParams("api_calls")
	p.SetIdempotencyKey("idem-1")
	p.SetStripeAccount("acct_connected")
	_, err := sc.V1BillingMeters.Create(ctx, p)
	require.NoError(t, err)
	for _, err := range sc.V1BillingMeters.List(ctx, &stripe.BillingMeterListParams{Status: stripe.String("active")}) {
		require.NoError(t, err)
	}
	_, err = client(ts, "sk_test_wrongKEY1234").V1Accounts.Retrieve(ctx, nil)
	require.Error(t, err)

	reqs := sim.Requests()
	require.Len(t, reqs, 3)
	c := reqs[0]
	assert.Equal(t, http.MethodPost, c.Method)
	assert.Equal(t, "/v1/billing/meters", c.Path)
	assert.Equal(t, "acct_connected", c.Account)
	assert.Equal(t, "acct_connected", c.StripeAccount)
	assert.Equal(t, "idem-1", c.IdempotencyKey)
	assert.Equal(t, "api_calls", c.Form.Get("event_name"))
	assert.Equal(t, "sum", c.Form.Get("default_aggregation[formula]"))
	assert.Equal(t, http.StatusOK, c.Status)
	assert.Regexp(t, `^req_`, c.RequestID)

	l := reqs[1]
	assert.Equal(t, http.MethodGet, l.Method)
	assert.Equal(t, acct, l.Account)
	assert.Equal(t, "active", l.Form.Get("status"))
	assert.Empty(t, l.IdempotencyKey)

	bad := reqs[2]
	assert.Equal(t, "/v1/account", bad.Path)
	assert.Empty(t, bad.Account)
	assert.Equal(t, http.StatusUnauthorized, bad.Status)

	dump := fmt.Sprintf("%#v", reqs)
	for _, secret := range []string{testKey, "SimKeyForTests", "sk_test_wrongKEY1234", "wrongKEY"} {
		assert.NotContains(t, dump, secret)
	}

	// The returned records are copies.
	reqs[0].Form.Set("event_name", "changed")
	assert.Equal(t, "api_calls", sim.Requests()[0].Form.Get("event_name"))
}

func TestIdempotentReplay(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	form := url.Values{"display_name": {"D"}, "event_name": {"e"}, "default_aggregation[formula]": {"sum"}}
	hdr := map[string]string{"Idempotency-Key": "key-1"}

	a := do(t, ts, http.MethodPost, "/v1/billing/meters", testKey, form, hdr)
	require.Equal(t, http.StatusOK, a.status)
	b := do(t, ts, http.MethodPost, "/v1/billing/meters", testKey, form, hdr)
	require.Equal(t, http.StatusOK, b.status)
	assert.Equal(t, a.body["id"], b.body["id"])
	assert.Equal(t, "true", b.header.Get("Idempotent-Replayed"))
	assert.Equal(t, a.header.Get("Request-Id"), b.header.Get("Original-Request"))
	assert.NotEqual(t, a.header.Get("Request-Id"), b.header.Get("Request-Id"))
	assert.Len(t, sim.Meters(acct), 1)

	form.Set("display_name", "Other")
	c := do(t, ts, http.MethodPost, "/v1/billing/meters", testKey, form, hdr)
	assert.Equal(t, http.StatusBadRequest, c.status)
	assert.Equal(t, "idempotency_error", c.errField("type"))

	// A request that fails validation keeps no result: the key can be
	// retried (https://docs.stripe.com/api/idempotent_requests).
	bad := url.Values{"event_name": {"x"}}
	d := do(t, ts, http.MethodPost, "/v1/billing/meters", testKey, bad, map[string]string{"Idempotency-Key": "key-2"})
	assert.Equal(t, http.StatusBadRequest, d.status)
	good := url.Values{"display_name": {"X"}, "event_name": {"x"}, "default_aggregation[formula]": {"sum"}}
	e := do(t, ts, http.MethodPost, "/v1/billing/meters", testKey, good, map[string]string{"Idempotency-Key": "key-2"})
	assert.Equal(t, http.StatusOK, e.status)

	reqs := sim.Requests()
	assert.True(t, reqs[1].Replayed)
	assert.False(t, reqs[0].Replayed)
}

func TestConcurrentUse(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	sc := client(ts, testKey)
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for i := range 20 {
		wg.Go(func() {
			_, err := sc.V1BillingMeters.Create(context.Background(), createParams(fmt.Sprintf("ev_%d", i)))
			errs <- err
		})
		wg.Go(func() {
			for _, err := range sc.V1BillingMeters.List(context.Background(), nil) {
				if err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	assert.Len(t, sim.Meters(acct), 20)
	assert.GreaterOrEqual(t, len(sim.Requests()), 40) // lists may take more than one page
}

func TestDefaultsAndCreateMeterPanics(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	ts := httptest.NewServer(sim.Handler())
	t.Cleanup(ts.Close)
	a, err := client(ts, stripesim.DefaultKey).V1Accounts.Retrieve(context.Background(), nil)
	require.NoError(t, err)
	assert.Equal(t, stripesim.DefaultAccount, a.ID)

	m := sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "e"})
	assert.Equal(t, "e", m.DisplayName)
	assert.Equal(t, "sum", m.Formula)
	assert.Equal(t, "stripe_customer_id", m.CustomerPayloadKey)
	assert.Equal(t, "value", m.ValuePayloadKey)
	assert.Panics(t, func() { sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "e"}) })
	assert.Panics(t, func() { sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "f", Formula: "avg"}) })
	assert.Panics(t, func() { sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{}) })
}
