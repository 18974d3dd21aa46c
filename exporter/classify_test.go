package exporter

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// Every row of the brief's "Provider answers (v1)".
func TestClassify(t *testing.T) {
	t.Parallel()
	no := false
	yes := true
	dialErr := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	readErr := &net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer")}
	cases := []struct {
		name    string
		in      Answer
		kind    outbox.OutcomeKind
		code    string
		refused bool
		reason  outbox.Reason
	}{
		{"200 accepted", Answer{Status: 200, RequestID: "req_1"}, outbox.Accepted, "", false, ""},
		{"duplicate identifier is success", Answer{Status: 400, RequestID: "req_2",
			Message: "An event already exists with identifier tly_abc.", ShouldRetry: &no}, outbox.Accepted, "", false, ""},
		{"no meter for the event name", Answer{Status: 400, Code: "resource_missing", Param: "event_name",
			Message: "No active meter found for event_name 'x'"}, outbox.Quarantined, "meter_not_found", false, outbox.ReasonMeterNotFound},
		{"no meter, as a 404", Answer{Status: 404, Message: "No active meter found for event_name 'x'"}, outbox.Quarantined, "meter_not_found", false, outbox.ReasonMeterNotFound},
		{"no such customer", Answer{Status: 400, Code: "resource_missing", Param: "payload[stripe_customer_id]",
			Message: "No such customer: 'cus_x'"}, outbox.Quarantined, "customer_not_found", false, outbox.ReasonCustomerNotFound},
		{"no such customer, as a 404", Answer{Status: 404, Message: "No such customer: 'cus_x'"}, outbox.Quarantined, "customer_not_found", false, outbox.ReasonCustomerNotFound},
		{"any other 400 is rejected", Answer{Status: 400, Code: "parameter_invalid_integer", Param: "payload[value]",
			Message: "Invalid integer"}, outbox.Rejected, "parameter_invalid_integer", false, ""},
		{"a 400 without a code is rejected", Answer{Status: 400, Message: "Timestamp must be within the past 35 days"}, outbox.Rejected, "invalid_request", false, ""},
		{"another 4xx is rejected", Answer{Status: 422}, outbox.Rejected, "invalid_request", false, ""},
		{"401 retries, never rejected", Answer{Status: 401, Message: "Invalid API Key provided"}, outbox.Retry, "stripe_auth", true, ""},
		{"403 retries, never rejected", Answer{Status: 403}, outbox.Retry, "stripe_auth", true, ""},
		{"another 404 retries", Answer{Status: 404, Message: "Unrecognized request URL"}, outbox.Retry, "stripe_not_found", true, ""},
		{"409 retries", Answer{Status: 409, Code: "idempotency_key_in_use"}, outbox.Retry, "stripe_conflict", true, ""},
		{"429 is rate-limited", Answer{Status: 429, Code: "rate_limit", RetryAfter: 2 * time.Second}, outbox.RateLimited, "rate_limited", false, ""},
		{"500 retries and may have reached Stripe", Answer{Status: 500}, outbox.Retry, "stripe_5xx", false, ""},
		{"502 (a lost reply) retries", Answer{Status: 502}, outbox.Retry, "stripe_5xx", false, ""},
		{"503 that says retry", Answer{Status: 503, ShouldRetry: &yes}, outbox.Retry, "stripe_5xx", false, ""},
		{"5xx that says do not retry is uncertain", Answer{Status: 500, ShouldRetry: &no}, outbox.Uncertain, "stripe_5xx", false, ""},
		{"timeout may have reached Stripe", Answer{Err: context.DeadlineExceeded}, outbox.Retry, "timeout", false, ""},
		{"reset may have reached Stripe", Answer{Err: readErr}, outbox.Retry, "network", false, ""},
		{"cancelled may have reached Stripe", Answer{Err: context.Canceled}, outbox.Retry, "canceled", false, ""},
		{"never sent is a refusal", Answer{Err: dialErr, NotSent: true}, outbox.Retry, "network", true, ""},
		{"a 3xx is no answer about the item (found by FuzzClassify)", Answer{Status: 302}, outbox.Retry, "unexpected_status", false, ""},
		{"a status beyond 599 likewise", Answer{Status: 746}, outbox.Retry, "unexpected_status", false, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			o := Classify(tc.in)
			require.Equal(t, tc.kind, o.Kind)
			require.Equal(t, tc.code, o.Error.Code)
			require.Equal(t, tc.refused, o.Refused)
			require.Equal(t, tc.reason, o.Reason)
			if tc.kind == outbox.Accepted {
				require.Equal(t, tc.in.RequestID, o.ProviderRef)
			}
			if tc.kind == outbox.RateLimited {
				require.Equal(t, tc.in.RetryAfter, o.MinDelay)
			}
			require.NotContains(t, o.Error.Message, "connection refused", "transport errors are described, not quoted")
		})
	}
}

// Every error code of Stripe's meter error reports (stripe-go v82's
// V1BillingMeterErrorReportTriggeredEventDataReasonErrorTypeCode, and the
// simulator's own "dropped"), and unknown ones: what a mapping fix can cure
// is quarantined with its reason, anything else rejected.
func TestClassifyReport(t *testing.T) {
	t.Parallel()
	cases := []struct {
		code   string
		state  outbox.State
		reason outbox.Reason
	}{
		{"no_meter", outbox.StateQuarantined, outbox.ReasonMeterNotFound},
		{"archived_meter", outbox.StateQuarantined, outbox.ReasonMeterNotFound},
		{"meter_event_customer_not_found", outbox.StateQuarantined, outbox.ReasonCustomerNotFound},
		{"meter_event_no_customer_defined", outbox.StateQuarantined, outbox.ReasonCustomerNotFound},
		{"meter_event_invalid_value", outbox.StateRejected, ""},
		{"meter_event_value_not_found", outbox.StateRejected, ""},
		{"meter_event_dimension_count_too_high", outbox.StateRejected, ""},
		{"missing_dimension_payload_keys", outbox.StateRejected, ""},
		{"timestamp_too_far_in_past", outbox.StateRejected, ""},
		{"timestamp_in_future", outbox.StateRejected, ""},
		{"dropped", outbox.StateRejected, ""},
		{"", outbox.StateRejected, ""},
		{"a_code_stripe_adds_later", outbox.StateRejected, ""},
		{"NO_METER", outbox.StateRejected, ""},
	}
	for _, tc := range cases {
		t.Run(tc.code, func(t *testing.T) {
			state, reason := ClassifyReport(tc.code)
			require.Equal(t, tc.state, state)
			require.Equal(t, tc.reason, reason)
		})
	}
}

// FuzzClassifyReport: every code lands on quarantined with a known reason
// or on rejected with none, and only the four curable codes quarantine.
func FuzzClassifyReport(f *testing.F) {
	for _, c := range []string{"no_meter", "archived_meter", "meter_event_customer_not_found",
		"meter_event_no_customer_defined", "meter_event_invalid_value", "timestamp_in_future", "dropped", ""} {
		f.Add(c)
	}
	curable := map[string]outbox.Reason{
		reportNoMeter: outbox.ReasonMeterNotFound, reportArchivedMeter: outbox.ReasonMeterNotFound,
		reportCustomerNotFound: outbox.ReasonCustomerNotFound, reportNoCustomerDefined: outbox.ReasonCustomerNotFound,
	}
	f.Fuzz(func(t *testing.T, code string) {
		state, reason := ClassifyReport(code)
		want, ok := curable[code]
		switch {
		case ok && (state != outbox.StateQuarantined || reason != want):
			t.Fatalf("%q classified %s %s, want quarantined %s", code, state, reason, want)
		case !ok && (state != outbox.StateRejected || reason != ""):
			t.Fatalf("%q classified %s %q, want rejected", code, state, reason)
		}
	})
}

func TestLimiterAdapts(t *testing.T) {
	t.Parallel()
	l := NewLimiter(100)
	require.Equal(t, 100.0, l.Rate())
	l.Slow(time.Now())
	l.Slow(time.Now())
	require.Equal(t, 25.0, l.Rate())
	for i := 0; i < 10; i++ {
		l.Ok()
	}
	require.InDelta(t, 30.0, l.Rate(), 0.001, "recovers a two-hundredth of the configured rate per success")
	for i := 0; i < 1000; i++ {
		l.Ok()
	}
	require.Equal(t, 100.0, l.Rate(), "never above the configured rate")
	for i := 0; i < 20; i++ {
		l.Slow(time.Now())
	}
	require.Equal(t, 1.0, l.Rate(), "never below one call a second")
}

// The 429s of one burst halve the rate once: calls sent before a halving
// were paced by the old rate.
func TestLimiterHalvesOncePerBurst(t *testing.T) {
	t.Parallel()
	l := NewLimiter(800)
	sent := time.Now() // a burst of calls goes out
	time.Sleep(time.Millisecond)
	for i := 0; i < 50; i++ {
		l.Slow(sent) // and all of them come back 429
	}
	require.Equal(t, 400.0, l.Rate())
	l.Slow(time.Now()) // a call paced by the new rate is still refused
	require.Equal(t, 200.0, l.Rate())
}
