package exporter

import (
	"context"
	"errors"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// Every row of Classify's table (docs/export.md, "What Stripe's answers do").
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
		// account_invalid stalls the destination whatever its status, which
		// Stripe's pages do not give: never a per-item quarantine.
		{"account_invalid as a 403", Answer{Status: 403, Code: "account_invalid",
			Message: "The provided key does not have access to account 'acct_x'"}, outbox.Retry, "stripe_account_refused", true, ""},
		{"account_invalid as a 400", Answer{Status: 400, Code: "account_invalid",
			Message: "The account ID provided as a value for the Stripe-Account header is invalid."}, outbox.Retry, "stripe_account_refused", true, ""},
		{"account_invalid as a 404", Answer{Status: 404, Code: "account_invalid"}, outbox.Retry, "stripe_account_refused", true, ""},
		{"duplicate identifier is success", Answer{Status: 400, RequestID: "req_2",
			Message: "An event already exists with identifier tly_abc.", ShouldRetry: &no}, outbox.Accepted, "", false, ""},
		// Stripe's v2 error duplicate_meter_event (its OpenAPI spec gives
		// no status): the coded duplicate, whatever the words.
		{"a coded duplicate is success", Answer{Status: 400, RequestID: "req_3", Code: "duplicate_meter_event",
			Message: "A meter event with a duplicate identifier has already been submitted."}, outbox.Accepted, "", false, ""},
		{"a coded duplicate at another 4xx is success", Answer{Status: 409, RequestID: "req_4", Code: "duplicate_meter_event"},
			outbox.Accepted, "", false, ""},
		{"the duplicate code at a 5xx is no answer about the item", Answer{Status: 500, Code: "duplicate_meter_event"},
			outbox.Retry, "stripe_5xx", false, ""},
		{"no meter for the event name", Answer{Status: 400, Code: "resource_missing", Param: "event_name",
			Message: "No active meter found for event_name 'x'"}, outbox.Quarantined, "meter_not_found", false, outbox.ReasonMeterNotFound},
		{"no meter, as a 404", Answer{Status: 404, Message: "No active meter found for event_name 'x'"}, outbox.Quarantined, "meter_not_found", false, outbox.ReasonMeterNotFound},
		{"no such customer", Answer{Status: 400, Code: "resource_missing", Param: "payload[stripe_customer_id]",
			Message: "No such customer: 'cus_x'"}, outbox.Quarantined, "customer_not_found", false, outbox.ReasonCustomerNotFound},
		{"no such customer, as a 404", Answer{Status: 404, Message: "No such customer: 'cus_x'"}, outbox.Quarantined, "customer_not_found", false, outbox.ReasonCustomerNotFound},
		{"no such customer under the meter's own key", Answer{Status: 400, Code: "resource_missing", Param: "payload[customer]",
			Message: "No such customer: 'cus_x'"}, outbox.Quarantined, "customer_not_found", false, outbox.ReasonCustomerNotFound},
		{"a payload key missing: the meter's keys differ", Answer{Status: 400, Code: "parameter_missing", Param: "payload[stripe_customer_id]",
			Message: "Missing required param: payload[stripe_customer_id]."}, outbox.Quarantined, "payload_keys", false, outbox.ReasonPayloadKeys},
		{"too many digits", Answer{Status: 400, Code: "meter_event_value_too_many_digits", Param: "payload[value]",
			Message: "The value has too many digits"}, outbox.Quarantined, "meter_event_value_too_many_digits", false, outbox.ReasonValueDigits},
		{"a value that is not a whole number is rejected", Answer{Status: 400, Code: "parameter_invalid_integer", Param: "payload[value]",
			Message: "Invalid integer"}, outbox.Rejected, "parameter_invalid_integer", false, ""},
		{"a timestamp Stripe refuses is rejected", Answer{Status: 400, Param: "timestamp",
			Message: "Timestamp must be within the past 35 days"}, outbox.Rejected, "invalid_timestamp", false, ""},
		{"an identifier Stripe refuses is rejected", Answer{Status: 400, Code: "parameter_invalid_string_too_long", Param: "identifier",
			Message: "Invalid identifier"}, outbox.Rejected, "parameter_invalid_string_too_long", false, ""},
		{"an unrecognised 400 waits for a human", Answer{Status: 400, Code: "some_new_code", Message: "Something Tally does not know"},
			outbox.Quarantined, "some_new_code", false, outbox.ReasonProviderRefused},
		{"a 400 without a code or param waits for a human", Answer{Status: 400, Message: "Timestamp must be within the past 35 days"},
			outbox.Quarantined, "provider_refused", false, outbox.ReasonProviderRefused},
		{"another 4xx waits for a human", Answer{Status: 422}, outbox.Quarantined, "provider_refused", false, outbox.ReasonProviderRefused},
		{"401 retries, never rejected", Answer{Status: 401, Message: "Invalid API Key provided"}, outbox.Retry, "stripe_auth", true, ""},
		{"403 retries, never rejected", Answer{Status: 403}, outbox.Retry, "stripe_auth", true, ""},
		{"another 404 retries", Answer{Status: 404, Message: "Unrecognized request URL"}, outbox.Retry, "stripe_not_found", true, ""},
		{"409 retries", Answer{Status: 409, Code: "idempotency_key_in_use"}, outbox.Retry, "stripe_conflict", true, ""},
		{"429 is rate-limited", Answer{Status: 429, Code: "rate_limit", RetryAfter: 2 * time.Second}, outbox.RateLimited, "rate_limited", false, ""},
		{"429 from a limiter, by its header", Answer{Status: 429, RateLimitedReason: "endpoint-rate"}, outbox.RateLimited, "rate_limited", false, ""},
		// A lock timeout is not a limiter's (no Stripe-Rate-Limited-Reason),
		// and "Stripe doesn't process these failed requests"
		// (docs.stripe.com/rate-limits, "Object lock timeouts"): a refused
		// attempt, retried with backoff, slowing no limiter.
		{"a lock timeout is a refused attempt", Answer{Status: 429, Code: "lock_timeout", Type: "invalid_request_error",
			Message: "This object cannot be accessed right now because another API request or Stripe process is currently accessing it."},
			outbox.Retry, "lock_timeout", true, ""},
		{"a limiter's 429 is rate-limited whatever its code", Answer{Status: 429, Code: "lock_timeout", RateLimitedReason: "global-rate"},
			outbox.RateLimited, "rate_limited", false, ""},
		// Any other 429 without the header: nothing says it recorded nothing.
		{"a bare 429 may have reached Stripe", Answer{Status: 429}, outbox.Retry, "stripe_429", false, ""},
		{"an unknown 429 may have reached Stripe", Answer{Status: 429, Code: "some_new_code"}, outbox.Retry, "some_new_code", false, ""},
		{"500 retries and may have reached Stripe", Answer{Status: 500}, outbox.Retry, "stripe_5xx", false, ""},
		{"502 (a lost reply) retries", Answer{Status: 502}, outbox.Retry, "stripe_5xx", false, ""},
		{"503 that says retry", Answer{Status: 503, ShouldRetry: &yes}, outbox.Retry, "stripe_5xx", false, ""},
		// Stripe sends Stripe-Should-Retry: false with most 500s because its
		// idempotency layer would replay the 500 to the same key
		// (stripe-go's shouldRetry); every attempt has a key of its own.
		{"5xx that says do not retry retries under a new key", Answer{Status: 500, ShouldRetry: &no}, outbox.Retry, "stripe_5xx", false, ""},
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
// V1BillingMeterErrorReportTriggeredEventDataReasonErrorTypeCode, the older
// pages' meter_event_value_not_found, v2's duplicate_meter_event, and the
// simulator's own "dropped"), and unknown ones: what a mapping fix can cure
// is quarantined with its reason, a refusal of the item's own content
// rejected, a duplicate no failure, and a code Tally does not know
// quarantined for a human.
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
		{"meter_event_no_customer_defined", outbox.StateQuarantined, outbox.ReasonPayloadKeys},
		// The current code of a payload without the meter's value key: Tally
		// sends whole numbers only, so the key is what is wrong.
		{"meter_event_invalid_value", outbox.StateQuarantined, outbox.ReasonPayloadKeys},
		{"meter_event_value_not_found", outbox.StateQuarantined, outbox.ReasonPayloadKeys},
		{"missing_dimension_payload_keys", outbox.StateQuarantined, outbox.ReasonPayloadKeys},
		{"meter_event_value_too_many_digits", outbox.StateQuarantined, outbox.ReasonValueDigits},
		{"meter_event_dimension_count_too_high", outbox.StateRejected, ""},
		{"timestamp_too_far_in_past", outbox.StateRejected, ""},
		{"timestamp_in_future", outbox.StateRejected, ""},
		// Stripe has the event: evidence, no failure.
		{"duplicate_meter_event", "", ""},
		{"dropped", outbox.StateQuarantined, outbox.ReasonProviderRefused},
		{"", outbox.StateQuarantined, outbox.ReasonProviderRefused},
		{"a_code_stripe_adds_later", outbox.StateQuarantined, outbox.ReasonProviderRefused},
		{"NO_METER", outbox.StateQuarantined, outbox.ReasonProviderRefused},
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
// or on rejected with none, only the codes Tally recognises as the item's
// own refusal are rejected, and only the coded duplicate is no failure:
// anything else waits for a human.
func FuzzClassifyReport(f *testing.F) {
	for _, c := range []string{"no_meter", "archived_meter", "meter_event_customer_not_found",
		"meter_event_no_customer_defined", "meter_event_invalid_value", "missing_dimension_payload_keys",
		"timestamp_in_future", "duplicate_meter_event", "dropped", ""} {
		f.Add(c)
	}
	terminal := map[string]bool{reportTooFarInPast: true, reportInFuture: true, reportDimensionCount: true}
	f.Fuzz(func(t *testing.T, code string) {
		state, reason := ClassifyReport(code)
		switch {
		case code == codeDuplicate && (state != "" || reason != ""):
			t.Fatalf("%q classified %s %q, want no failure", code, state, reason)
		case code == codeDuplicate:
		case terminal[code] && (state != outbox.StateRejected || reason != ""):
			t.Fatalf("%q classified %s %q, want rejected", code, state, reason)
		case !terminal[code] && (state != outbox.StateQuarantined || !slices.Contains(outbox.Reasons, reason)):
			t.Fatalf("%q classified %s %q, want quarantined with a known reason", code, state, reason)
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
