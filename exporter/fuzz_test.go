package exporter_test

import (
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/outbox"
)

// FuzzClassify feeds the classifier every kind of answer: nothing panics,
// and Classify's rules hold whatever the fields say — a 2xx is accepted,
// an answer that cannot be the item's fault (no answer, 401, 403, 409,
// 429, 5xx) is never rejected or quarantined, no answer is ever uncertain
// by itself (only the cap or the horizon makes an item uncertain), only a
// 400 is rejected, and what an outcome would store is sanitised.
func FuzzClassify(f *testing.F) {
	f.Add(200, "", "", "", "", int8(-1), 0, false, false)
	f.Add(400, "An event already exists with identifier tly_1", "", "", "invalid_request_error", int8(0), 0, false, false)
	f.Add(400, "No active meter found for event_name api", "", "event_name", "invalid_request_error", int8(-1), 0, false, false)
	f.Add(404, "No such customer: 'cus_1'", "resource_missing", "payload[stripe_customer_id]", "invalid_request_error", int8(-1), 0, false, false)
	f.Add(401, "Invalid API Key provided: sk_live_****abcd", "", "", "invalid_request_error", int8(-1), 0, false, false)
	f.Add(429, "Too many requests", "rate_limit", "", "invalid_request_error", int8(-1), 3, false, false)
	f.Add(500, "An unknown error occurred", "", "", "api_error", int8(0), 0, false, false)
	f.Add(0, "", "", "", "", int8(-1), 0, true, true)
	f.Add(0, "", "", "", "", int8(-1), 0, false, true)
	f.Add(422, "bad sk_test_abcdefghijklmnop\x00\nvalue", "parameter_invalid_integer", "payload[value]", "invalid_request_error", int8(1), 0, false, false)
	f.Fuzz(func(t *testing.T, status int, message, code, param, typ string, shouldRetry int8, retryAfter int, notSent, transportErr bool) {
		a := exporter.Answer{Status: status, Message: message, Code: code, Param: param, Type: typ,
			RetryAfter: time.Duration(retryAfter) * time.Second, NotSent: notSent}
		if shouldRetry >= 0 {
			v := shouldRetry > 0
			a.ShouldRetry = &v
		}
		if transportErr {
			a.Err = errors.New("dial tcp: connection refused")
		}
		o := exporter.Classify(a)
		switch {
		case status >= 200 && status < 300:
			if o.Kind != outbox.Accepted {
				t.Fatalf("%d classified %v", status, o.Kind)
			}
		case status == 0, status == 401, status == 403, status == 409, status == 429, status >= 500:
			if o.Kind == outbox.Rejected || o.Kind == outbox.Quarantined {
				t.Fatalf("%d (%q) classified %v: the item is not at fault", status, message, o.Kind)
			}
		}
		if o.Kind == outbox.Rejected && status != 400 {
			t.Fatalf("rejected on %d", status)
		}
		if o.Kind == outbox.Uncertain {
			t.Fatalf("%d classified uncertain: only the cap or the horizon makes an item uncertain", status)
		}
		if status == 0 && o.Kind != outbox.Retry {
			t.Fatalf("no answer classified %v", o.Kind)
		}
		if o.Kind == outbox.Quarantined && o.Reason == "" {
			t.Fatalf("quarantined without a reason")
		}
		stored := o.Error.Sanitized()
		if utf8.RuneCountInString(stored.Message) > outbox.MaxErrorMessage || len(stored.Code) > 64 {
			t.Fatalf("stored error too long: %+v", stored)
		}
		for _, secret := range []string{"sk_live_", "sk_test_", "rk_live_", "rk_test_"} {
			if strings.Contains(strings.ToLower(stored.Message), secret) || strings.Contains(strings.ToLower(stored.Code), secret) {
				t.Fatalf("a key reached the stored error: %+v", stored)
			}
		}
	})
}
