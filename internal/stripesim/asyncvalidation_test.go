package stripesim_test

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

// asyncCase is one meter event Stripe may accept and then report: its form
// values (v1) and what the error report says.
type asyncCase struct {
	name     string
	edit     func(url.Values)
	code     string
	noMeter  bool   // reported as v1.billing.meter.no_meter_found
	meterFor string // the event name of the report's meter, when not api_calls
}

// asyncCases are the asynchronous meter event errors of Stripe's
// v1.billing.meter.error_report_triggered and no_meter_found events
// (stripe-go v82 v2_events.go,
// V1BillingMeterErrorReportTriggeredEventDataReasonErrorTypeCode; the
// 15-digit rule: https://docs.stripe.com/changelog/dahlia/2026-04-22/billing-meter-event-values-validation).
func asyncCases() []asyncCase {
	return []asyncCase{
		{name: "unknown customer", edit: func(v url.Values) { v.Set("payload[stripe_customer_id]", "cus_ghost") },
			code: stripesim.CodeCustomerNotFound},
		{name: "no customer key", edit: func(v url.Values) { v.Del("payload[stripe_customer_id]") },
			code: stripesim.CodeNoCustomerDefined},
		{name: "no value key", edit: func(v url.Values) { v.Del("payload[value]") },
			code: stripesim.CodeInvalidValue},
		{name: "fractional value", edit: func(v url.Values) { v.Set("payload[value]", "1.5") },
			code: stripesim.CodeInvalidValue},
		{name: "value of 16 digits", edit: func(v url.Values) { v.Set("payload[value]", "1234567890123456") },
			code: stripesim.CodeValueTooManyDigits},
		{name: "no meter", edit: func(v url.Values) { v.Set("event_name", "nope") },
			code: stripesim.CodeNoMeter, noMeter: true},
		{name: "archived meter", edit: func(v url.Values) { v.Set("event_name", "retired") },
			code: stripesim.CodeArchivedMeter, meterFor: "retired"},
		{name: "too old", edit: func(v url.Values) {
			v.Set("timestamp", strconv.FormatInt(base.AddDate(0, 0, -36).Unix(), 10))
		}, code: stripesim.CodeTimestampTooFarInPast},
		{name: "too far ahead", edit: func(v url.Values) {
			v.Set("timestamp", strconv.FormatInt(base.Add(time.Hour).Unix(), 10))
		}, code: stripesim.CodeTimestampInFuture},
	}
}

// TestV1AsyncValidationAcceptsThenReports checks Limits.AsyncValidation:
// v1 answers 200 with the meter event, records nothing and files the same
// error report the stream files for the same event — Stripe reports such
// errors after accepting an event (docs/stripe.md; the codes are those of
// Stripe's error report events, see asyncCases). That an archived meter is
// reported as error_report_triggered with the meter as related object, not
// as no_meter_found, is the simulator's reading: Stripe's docs list
// archived_meter among the codes of both events without saying which.
func TestV1AsyncValidationAcceptsThenReports(t *testing.T) {
	t.Parallel()
	at := base.Add(-time.Minute)
	for _, tc := range asyncCases() {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			sim, ts, _ := newMeterSim(t, stripesim.Limits{AsyncValidation: true})
			old := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "retired"})
			require.NoError(t, sim.DeactivateMeter(acct, old.ID))
			form := eventForm("api_calls", "cus_acme", "a-1", "3", at)
			tc.edit(form)

			r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, form, withKey("a-1"))
			require.Equal(t, http.StatusOK, r.status, r.body)
			assert.Equal(t, "billing.meter_event", r.body["object"])
			assert.Equal(t, "a-1", r.body["identifier"])
			assert.Equal(t, form.Get("event_name"), r.body["event_name"])
			assert.Empty(t, sim.Events(acct), "nothing is recorded")

			reps := sim.ErrorReports(acct)
			require.Len(t, reps, 1)
			rep := reps[0]
			assert.Equal(t, tc.code, rep.Code)
			assert.Equal(t, []string{"a-1"}, rep.Identifiers)
			assert.Equal(t, 1, rep.ErrorCount)
			assert.Equal(t, base, rep.Created)
			assert.NotEmpty(t, rep.Message)
			switch {
			case tc.noMeter:
				assert.Equal(t, stripesim.ReportNoMeterFound, rep.Type)
				assert.Empty(t, rep.Meter)
			default:
				assert.Equal(t, stripesim.ReportErrorTriggered, rep.Type)
				name := "api_calls"
				if tc.meterFor != "" {
					name = tc.meterFor
				}
				assert.Equal(t, meterID(t, sim, name), rep.Meter)
			}

			// The stream reports the same event the same way.
			simS, tsS, _ := newMeterSim(t, stripesim.Limits{})
			oldS := simS.CreateMeter(acct, stripesim.MeterSpec{EventName: "retired"})
			require.NoError(t, simS.DeactivateMeter(acct, oldS.ID))
			sc, _ := streamClient(tsS, newSession(t, tsS, ""))
			require.NoError(t, sc.V2BillingMeterEventStreams.Create(context.Background(), streamParams(streamEventOf(form))))
			assert.Equal(t, reportsOf(sim, acct), reportsOf(simS, acct))
			repS := simS.ErrorReports(acct)
			require.Len(t, repS, 1)
			assert.Equal(t, rep.Type, repS[0].Type)
			assert.Equal(t, rep.Message, repS[0].Message)
			assert.Equal(t, rep.Meter == "", repS[0].Meter == "")
		})
	}
}

// streamEventOf is the v1 form values as a stream event.
func streamEventOf(form url.Values) *stripe.V2BillingMeterEventStreamCreateEventParams {
	ev := &stripe.V2BillingMeterEventStreamCreateEventParams{
		EventName: stripe.String(form.Get("event_name")), Identifier: stripe.String(form.Get("identifier")),
		Payload: map[string]string{},
	}
	for k, vs := range form {
		if inner, ok := strings.CutPrefix(k, "payload["); ok {
			ev.Payload[strings.TrimSuffix(inner, "]")] = vs[0]
		}
	}
	n, _ := strconv.ParseInt(form.Get("timestamp"), 10, 64)
	at := time.Unix(n, 0)
	ev.Timestamp = &at
	return ev
}

func meterID(t *testing.T, sim *stripesim.Server, eventName string) string {
	t.Helper()
	for _, m := range sim.Meters(acct) {
		if m.EventName == eventName {
			return m.ID
		}
	}
	t.Fatalf("no meter %s", eventName)
	return ""
}

// TestV1AsyncValidationKeepsSynchronousRefusals checks what the mode
// leaves synchronous: the shape of the request (validation errors, kept
// for no key) and a duplicate identifier (400 with Stripe-Should-Retry:
// false, https://docs.stripe.com/api/billing/meter-event/create: "We'll
// enforce uniqueness within a rolling 24 hour period"). A duplicate that
// would also fail asynchronously is still refused as a duplicate.
func TestV1AsyncValidationKeepsSynchronousRefusals(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{AsyncValidation: true})
	at := base.Add(-time.Minute)
	for _, c := range []struct {
		name        string
		edit        func(url.Values)
		code, param string
	}{
		{"unknown param", func(v url.Values) { v.Set("colour", "red") }, "parameter_unknown", "colour"},
		{"no event_name", func(v url.Values) { v.Del("event_name") }, "parameter_missing", "event_name"},
		{"no payload", func(v url.Values) {
			v.Del("payload[stripe_customer_id]")
			v.Del("payload[value]")
		}, "parameter_missing", "payload"},
		{"identifier too long", func(v url.Values) { v.Set("identifier", strings.Repeat("x", 101)) }, "", "identifier"},
		{"timestamp not an integer", func(v url.Values) { v.Set("timestamp", "today") }, "parameter_invalid_integer", "timestamp"},
	} {
		form := eventForm("api_calls", "cus_acme", "s-"+c.name, "1", at)
		c.edit(form)
		r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, form, nil)
		assert.Equal(t, http.StatusBadRequest, r.status, c.name)
		assert.Equal(t, c.code, r.errField("code"), c.name)
		assert.Equal(t, c.param, r.errField("param"), c.name)
	}

	r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", "d-1", "1", at), nil)
	require.Equal(t, http.StatusOK, r.status)
	for _, value := range []string{"1", "1.5"} {
		r = do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_acme", "d-1", value, at), nil)
		assert.Equal(t, http.StatusBadRequest, r.status)
		assert.Equal(t, "An event already exists with identifier d-1.", r.errField("message"))
		assert.Equal(t, "false", r.header.Get("Stripe-Should-Retry"))
	}
	assert.Len(t, sim.Events(acct), 1)
	assert.Empty(t, sim.ErrorReports(acct))

	// Switched off while running: the same event is refused at once again.
	sim.Configure(acct, stripesim.Limits{})
	r = do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_ghost", "g-1", "1", at), nil)
	assert.Equal(t, http.StatusBadRequest, r.status)
	assert.Equal(t, "resource_missing", r.errField("code"))
	sim.Configure(acct, stripesim.Limits{AsyncValidation: true})
	r = do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, eventForm("api_calls", "cus_ghost", "g-1", "1", at), nil)
	assert.Equal(t, http.StatusOK, r.status)
	assert.Len(t, sim.ErrorReports(acct), 1)
}

// TestMeterEventValueDigits checks Stripe's rule of at most 15 significant
// digits in a value (https://docs.stripe.com/changelog/dahlia/2026-04-22/billing-meter-event-values-validation:
// "For the synchronous API, requests with such values now return a 400
// error. For async meter events, Stripe reports the rejection through the
// v1.billing.meter.error_report_triggered event with the new
// meter_event_value_too_many_digits error code", message "The value in the
// event payload can have at most max_digits digits. Received value."). What
// counts as significant in an integer is not documented: the simulator
// counts every digit after the sign and leading zeros, so 10^15 (16
// digits, one of them significant in the strict sense) is refused — the
// strictest reading. The rule came with API version 2026-04-22.dahlia;
// stripe-go v82 pins 2025-08-27.basil, under which Stripe may instead
// accept such a value and lose precision: a client must not send one either
// way.
func TestMeterEventValueDigits(t *testing.T) {
	t.Parallel()
	sim, ts, _ := newMeterSim(t, stripesim.Limits{})
	sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "tokens", ValuePayloadKey: "n"})
	at := base.Add(-time.Minute)
	for i, c := range []struct {
		value string
		ok    bool
	}{
		{"999999999999999", true},
		{"-999999999999999", true},
		{"+999999999999999", true},
		{"0000999999999999999", true}, // leading zeros are not significant
		{"1000000000000000", false},
		{"-1000000000000000", false},
		{"9223372036854775807", false},
		{"123456789012345678901234567890", false}, // beyond int64: still too many digits
	} {
		ident := "v-" + strconv.Itoa(i)
		form := url.Values{"event_name": {"tokens"}, "identifier": {ident}, "timestamp": {strconv.FormatInt(at.Unix(), 10)},
			"payload[stripe_customer_id]": {"cus_acme"}, "payload[n]": {c.value}}
		r := do(t, ts, http.MethodPost, "/v1/billing/meter_events", testKey, form, nil)
		if c.ok {
			assert.Equal(t, http.StatusOK, r.status, c.value)
			continue
		}
		assert.Equal(t, http.StatusBadRequest, r.status, c.value)
		assert.Equal(t, "invalid_request_error", r.errField("type"), c.value)
		assert.Equal(t, "meter_event_value_too_many_digits", r.errField("code"), c.value)
		assert.Equal(t, "payload[n]", r.errField("param"), c.value)
		assert.Equal(t, "The value in the event payload can have at most 15 digits. Received "+c.value+".", r.errField("message"))
	}
	assert.Len(t, sim.Events(acct), 4)

	// The stream reports it.
	sc, _ := streamClient(ts, newSession(t, ts, ""))
	err := sc.V2BillingMeterEventStreams.Create(context.Background(), streamParams(
		&stripe.V2BillingMeterEventStreamCreateEventParams{EventName: stripe.String("tokens"), Identifier: stripe.String("s-big"),
			Payload: map[string]string{"stripe_customer_id": "cus_acme", "n": "1000000000000000"}},
		&stripe.V2BillingMeterEventStreamCreateEventParams{EventName: stripe.String("tokens"), Identifier: stripe.String("s-ok"),
			Payload: map[string]string{"stripe_customer_id": "cus_acme", "n": "999999999999999"}},
	))
	require.NoError(t, err)
	assert.Len(t, sim.Events(acct), 5)
	reps := sim.ErrorReports(acct)
	require.Len(t, reps, 1)
	assert.Equal(t, stripesim.CodeValueTooManyDigits, reps[0].Code)
	assert.Equal(t, []string{"s-big"}, reps[0].Identifiers)
	assert.Equal(t, "The value in the event payload can have at most 15 digits. Received 1000000000000000.", reps[0].Message)
}
