package stripeapi_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
)

// reportEvent is a meter error report whose one error type has the sample
// requests given, as raw JSON.
func reportEvent(requests ...string) stripeapi.Event {
	var samples []string
	for _, r := range requests {
		s := `{"error_message": "No customer", "extra": [1]`
		if r != "" {
			s += `, "request": ` + r
		}
		samples = append(samples, s+"}")
	}
	data := `{"developer_message_summary": "x", "reason": {"error_count": 7, "error_types": [
		{"code": "meter_event_customer_not_found", "error_count": 7, "sample_errors": [` + strings.Join(samples, ",") + `]}]},
		"validation_start": "2026-03-10T12:00:00Z", "validation_end": "2026-03-10T12:01:00Z"}`
	return stripeapi.Event{ID: "evt_1", Type: stripeapi.EventMeterErrorReport, Created: time.Unix(1773144000, 0),
		Context: "acct_1Conn", RelatedObject: "mtr_1", Data: json.RawMessage(data)}
}

// A sample names its request in every shape Stripe and stripe-go have
// shown — {"identifier"} (stripe-go v82's only field, the event object's
// example), {"id": "", "idempotency_key"} (the error report's example
// payload), {"id": "req_…", "idempotency_key": ""} (the v2 request shape
// with no key) — and Tally reads each field raw; unknown fields are
// ignored, and a sample naming nothing is left out.
func TestParseMeterErrorReportShapes(t *testing.T) {
	t.Parallel()
	key := "tly_" + strings.Repeat("a", 64) + "-a2"
	for _, tc := range []struct {
		name    string
		request string
		want    []stripeapi.MeterErrorSample
	}{
		{"identifier", `{"identifier": "` + key + `"}`, []stripeapi.MeterErrorSample{{Identifier: key}}},
		{"idempotency key, empty id", `{"id": "", "idempotency_key": "` + key + `"}`, []stripeapi.MeterErrorSample{{IdempotencyKey: key}}},
		{"request id, empty key", `{"id": "req_123abc", "idempotency_key": ""}`, []stripeapi.MeterErrorSample{{RequestID: "req_123abc"}}},
		{"all three", `{"id": "req_1", "idempotency_key": "k", "identifier": "i"}`,
			[]stripeapi.MeterErrorSample{{Identifier: "i", IdempotencyKey: "k", RequestID: "req_1"}}},
		{"unknown fields", `{"identifier": "i", "object": "request", "nested": {"a": [1, 2]}, "n": 3}`, []stripeapi.MeterErrorSample{{Identifier: "i"}}},
		{"absent request", ``, nil},
		{"null request", `null`, nil},
		{"empty request", `{}`, nil},
		{"empty fields", `{"id": "", "idempotency_key": ""}`, nil},
		{"unusable names", `{"identifier": "a b", "id": "req_\u0001", "idempotency_key": "` + strings.Repeat("k", 256) + `"}`, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rep, err := stripeapi.ParseMeterErrorReport(reportEvent(tc.request))
			require.NoError(t, err)
			for i := range tc.want {
				tc.want[i].Code, tc.want[i].Message = "meter_event_customer_not_found", "No customer"
			}
			assert.Equal(t, tc.want, rep.Samples)
			assert.Equal(t, int64(7), rep.ErrorCount)
			assert.Equal(t, "mtr_1", rep.Meter)
			assert.Equal(t, "acct_1Conn", rep.Context)
		})
	}
}

// What is not a readable meter error report.
func TestParseMeterErrorReportRefusals(t *testing.T) {
	t.Parallel()
	ev := reportEvent(`{"identifier": "i"}`)
	ev.Type = "v1.billing.meter.deactivated"
	_, err := stripeapi.ParseMeterErrorReport(ev)
	code, _, _ := stripeapi.Describe(err)
	assert.Equal(t, stripeapi.CodeBadResponse, code)

	ev = reportEvent(`{"identifier": "i"}`)
	ev.Data = nil
	_, err = stripeapi.ParseMeterErrorReport(ev)
	assert.ErrorIs(t, err, stripeapi.ErrNoData)

	ev.Data = json.RawMessage(`{"reason": {"error_types": "nope"}}`)
	_, err = stripeapi.ParseMeterErrorReport(ev)
	code, _, _ = stripeapi.Describe(err)
	assert.Equal(t, stripeapi.CodeBadResponse, code)

	// no_meter_found relates no meter; a report without a reason names
	// nothing.
	ev = reportEvent(`{"identifier": "i"}`)
	ev.Type = stripeapi.EventNoMeterFound
	rep, err := stripeapi.ParseMeterErrorReport(ev)
	require.NoError(t, err)
	assert.Empty(t, rep.Meter)
	ev.Data = json.RawMessage(`{}`)
	rep, err = stripeapi.ParseMeterErrorReport(ev)
	require.NoError(t, err)
	assert.Empty(t, rep.Samples)

	assert.Equal(t, "acct_2", stripeapi.ContextAccount("acct_1/acct_2"))
	assert.Equal(t, "acct_1", stripeapi.ContextAccount("acct_1"))
	assert.Empty(t, stripeapi.ContextAccount(""))
	for _, bad := range []string{"acct 1", "acct_1\r\nX: y", "/acct_1", "acct_1/", "a/b/c/d/e/f"} {
		assert.False(t, stripeapi.ValidContext(bad), bad)
	}
}

// eventsSim is a simulator with a platform account (the key's) and a
// connected account, each with a meter, validating asynchronously, and a
// failed event reported in each.
func eventsSim(t *testing.T, opts stripesim.Options) (*stripesim.Server, *httptest.Server) {
	t.Helper()
	opts.Keys = map[string]string{testKey: acct}
	sim := stripesim.New(opts)
	ts := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); ts.Close() })
	sim.AddAccount("acct_1Conn")
	for _, a := range []string{acct, "acct_1Conn"} {
		sim.CreateMeter(a, stripesim.MeterSpec{EventName: "api_calls", Formula: "sum"})
		sim.Configure(a, stripesim.Limits{AsyncValidation: true})
	}
	return sim, ts
}

// failIn sends a v1 meter event for an unknown customer in account, with
// the Idempotency-Key key: answered 200 and reported.
func failIn(t *testing.T, c *stripeapi.Client, account, ident, key string) {
	t.Helper()
	p := &stripe.BillingMeterEventCreateParams{EventName: stripe.String("api_calls"), Identifier: stripe.String(ident),
		Payload:   map[string]string{"stripe_customer_id": "cus_ghost", "value": "1"},
		Timestamp: stripe.Int64(time.Now().Add(-time.Hour).Unix())}
	p.SetIdempotencyKey(key)
	if account != acct {
		p.SetStripeAccount(account)
	}
	_, err := c.Stripe().V1BillingMeterEvents.Create(context.Background(), p)
	require.NoError(t, err)
}

// A thin event's context is sent as Stripe-Context when its event is
// fetched, and then no Stripe-Account — not even the client's own
// (Config.Account), which the transport adds to every other call: the
// context supersedes it (docs.stripe.com/context). The v2 error's status,
// which stripe-go v82 leaves out, is kept.
func TestEventInItsContext(t *testing.T) {
	t.Parallel()
	sim, ts := eventsSim(t, stripesim.Options{})
	c := newClient(t, ts, stripeapi.Config{Account: acct})
	failIn(t, c, acct, "own-1", "own-1-a1")
	failIn(t, c, "acct_1Conn", "conn-1", "conn-1-a1")
	conn := sim.ErrorReports("acct_1Conn")[0]
	require.Equal(t, "acct_1Conn", conn.Context)

	ctx := context.Background()
	ev, err := c.Event(ctx, conn.ID, conn.Context)
	require.NoError(t, err)
	assert.Equal(t, "acct_1Conn", ev.Context)
	assert.Equal(t, conn.Meter, ev.RelatedObject)
	rep, err := stripeapi.ParseMeterErrorReport(ev)
	require.NoError(t, err)
	require.Len(t, rep.Samples, 1)
	assert.Equal(t, "conn-1-a1", rep.Samples[0].IdempotencyKey, "Stripe's example shape, read raw")
	assert.Equal(t, conn.RequestIDs[0], rep.Samples[0].RequestID)
	assert.Empty(t, rep.Samples[0].Identifier)

	_, err = c.Event(ctx, conn.ID, "")
	var se *stripeapi.Error
	require.ErrorAs(t, err, &se)
	assert.Equal(t, http.StatusNotFound, se.HTTPStatus, "the status of a v2 error")
	assert.Equal(t, "resource_missing", se.Code)

	own := sim.ErrorReports(acct)[0]
	_, err = c.MeterErrorEvent(ctx, own.ID)
	require.NoError(t, err)

	var fetches []stripesim.Recorded
	for _, r := range sim.Requests() {
		if strings.HasPrefix(r.Path, "/v2/core/events/") {
			fetches = append(fetches, r)
		}
	}
	require.Len(t, fetches, 3)
	assert.Equal(t, "acct_1Conn", fetches[0].StripeContext)
	assert.Empty(t, fetches[0].StripeAccount, "no Stripe-Account beside a Stripe-Context")
	assert.Empty(t, fetches[1].StripeContext)
	assert.Equal(t, acct, fetches[1].StripeAccount, "without a context, as every other call")

	for _, bad := range []struct{ id, ctx string }{{"evt_1/../x", ""}, {"evt_1?x=1", ""}, {"evt_1", "acct_1\nX"}} {
		_, err := c.Event(ctx, bad.id, bad.ctx)
		code, _, _ := stripeapi.Describe(err)
		assert.Equal(t, stripeapi.CodeInvalidConfig, code, "%+v", bad)
	}
}

// A listing sends its filters as newer stripe-go encodes them — types[0],
// types[1], …, created[gt] (RFC 3339), limit — and follows next_page_url
// with nothing else; a listing that refuses them answers 400 with its
// status.
func TestListEventsEncoding(t *testing.T) {
	t.Parallel()
	sim, ts := eventsSim(t, stripesim.Options{})
	c := newClient(t, ts, stripeapi.Config{})
	for _, k := range []string{"a", "b", "c"} {
		failIn(t, c, acct, "ev-"+k, "ev-"+k+"-a1")
	}
	ctx := context.Background()
	after := time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)
	q := stripeapi.EventList{Types: []string{stripeapi.EventMeterErrorReport, stripeapi.EventNoMeterFound}, CreatedAfter: after, Limit: 2}
	page, err := c.ListEvents(ctx, "", q, "")
	require.NoError(t, err)
	require.Len(t, page.Events, 2)
	require.NotEmpty(t, page.Next)
	last, err := c.ListEvents(ctx, "", q, page.Next)
	require.NoError(t, err)
	require.Len(t, last.Events, 1)
	assert.Empty(t, last.Next)
	reps := sim.ErrorReports(acct)
	assert.Equal(t, reps[0].ID, last.Events[0].ID, "newest first")
	assert.NotEmpty(t, last.Events[0].Data, "listed with their data")

	var lists []stripesim.Recorded
	for _, r := range sim.Requests() {
		if r.Path == "/v2/core/events" {
			lists = append(lists, r)
		}
	}
	require.Len(t, lists, 2)
	f := lists[0].Form
	assert.Equal(t, []string{stripeapi.EventMeterErrorReport}, f["types[0]"])
	assert.Equal(t, []string{stripeapi.EventNoMeterFound}, f["types[1]"])
	assert.Equal(t, []string{"2020-01-02T03:04:05Z"}, f["created[gt]"])
	assert.Equal(t, []string{"2"}, f["limit"])
	assert.Equal(t, []string{"page"}, keysOf(lists[1].Form), "a later page carries only next_page_url's query")

	_, err = c.ListEvents(ctx, "", q, "https://evil.example/v2/core/events?page=x")
	assert.Error(t, err)

	_, ts = eventsSim(t, stripesim.Options{EventsList: stripesim.ListUnfiltered})
	c = newClient(t, ts, stripeapi.Config{})
	_, err = c.ListEvents(ctx, "", q, "")
	var se *stripeapi.Error
	require.ErrorAs(t, err, &se)
	assert.Equal(t, http.StatusBadRequest, se.HTTPStatus)
	_, err = c.ListEvents(ctx, "", stripeapi.EventList{}, "")
	assert.NoError(t, err, "unfiltered")
}

func keysOf(m map[string][]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}
