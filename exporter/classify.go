package exporter

import (
	"cmp"
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Answer is what one provider call came to, reduced to what classification
// needs: no body, no secret.
type Answer struct {
	// Status is the HTTP status; 0 when no answer came back.
	Status int
	// RequestID is the provider's Request-Id header.
	RequestID string
	// Type, Code, Param and Message are the provider's error fields.
	Type, Code, Param, Message string
	// ShouldRetry is Stripe's Stripe-Should-Retry header, when present.
	ShouldRetry *bool
	// RetryAfter is the Retry-After header, when present.
	RetryAfter time.Duration
	// RateLimitedReason is the Stripe-Rate-Limited-Reason header: present
	// when one of Stripe's rate or concurrency limiters refused the call.
	RateLimitedReason string
	// Replayed is the Idempotent-Replayed header: the answer Stripe kept
	// for the request's Idempotency-Key.
	Replayed bool
	// Err is the transport error when no answer came back.
	Err error
	// NotSent says the request provably never left (the connection could not
	// be made), so the provider cannot have seen it.
	NotSent bool
}

// codeAuth is the error code of a 401 or 403: the key, not the item.
const codeAuth = "stripe_auth"

// codeAccountRefused is the error code of Stripe's account_invalid: the
// key may not act for the Stripe-Account destination, not the item's fault.
const codeAccountRefused = "stripe_account_refused"

// refusedKeyOrAccount reports whether an error code is the key's or the
// destination account's refusal.
func refusedKeyOrAccount(code string) bool { return code == codeAuth || code == codeAccountRefused }

// codeAccountInvalid is Stripe's error code for a Stripe-Account header
// the key may not use.
const codeAccountInvalid = stripeapi.CodeAccountInvalid

// duplicatePrefix starts Stripe's answer to a reused meter-event identifier:
// the provider has the event already, which is success.
const duplicatePrefix = "An event already exists with identifier"

// codeDuplicate is the error code Stripe's v2 API documents for a meter
// event whose identifier it has already ("A meter event with a duplicate
// identifier has already been submitted."): success, like v1's wording.
const codeDuplicate = "duplicate_meter_event"

// codeLockTimeout is Stripe's code for a 429 that timed out waiting for an
// object's lock (stripe-go ErrorCodeLockTimeout): not a rate limiter's, and
// "Stripe doesn't process these failed requests".
const codeLockTimeout = "lock_timeout"

// Classify turns a provider's answer into an outcome, per docs/export.md
// (the sources are in docs/stripe.md):
//
//	2xx                                           accepted (provider_ref = Request-Id)
//	400 duplicate identifier                      accepted
//	4xx code duplicate_meter_event                accepted
//	400/404 naming no meter for the event name    quarantined meter_not_found
//	400/404 naming no such customer               quarantined customer_not_found
//	400 a payload key missing                     quarantined payload_keys
//	400 meter_event_value_too_many_digits         quarantined value_digits
//	400 naming the timestamp or the identifier,
//	    or a value that is not a whole number     rejected, terminal
//	any other 4xx but 401, 403, 404, 409, 429
//	    (400, 402, 405, 413, 415, 422, …)         quarantined provider_refused: a human looks first
//	code account_invalid at any 4xx               retry with backoff (refused; the account stalls)
//	401/403                                       retry with backoff (refused; alerted; export stalls)
//	any other 404                                 retry with backoff (refused: the endpoint, not the item)
//	409                                           retry with backoff (refused)
//	429 from a limiter (Stripe-Rate-Limited-Reason
//	    or code rate_limit)                       rate-limited (refused; after Retry-After if given)
//	429 code lock_timeout                         retry with backoff (refused; slows no limiter)
//	any other 429                                 retry with backoff (may have reached Stripe)
//	5xx, with or without Stripe-Should-Retry      retry with backoff (may have reached Stripe)
//	no answer: never sent                         retry with backoff (refused)
//	no answer: timeout, reset, cancelled          retry with backoff (may have reached Stripe)
//	any other status (1xx, 3xx, over 599)         retry with backoff (may have reached Stripe)
//
// A 5xx is never uncertain by itself: Stripe sends Stripe-Should-Retry:
// false with most 500s because its idempotency layer would replay the same
// 500 to the same Idempotency-Key, and every attempt carries a key of its
// own; the identifier deduplicates the resend. A retry past the attempt cap
// or the horizon becomes uncertain in the outbox itself (its retry).
//
// An unrecognised refusal is quarantined, not rejected: it proves the event
// was not recorded, and a mapping fix may cure it, so a human decides; only
// refusals Tally recognises as the item's own, which no mapping fix cures,
// are terminal.
func Classify(a Answer) outbox.Outcome {
	switch {
	case a.Status >= 200 && a.Status < 300:
		return outbox.Outcome{Kind: outbox.Accepted, ProviderRef: a.RequestID}

	case a.Status == 0:
		info := outbox.ErrorInfo{Status: a.Status, Code: "network", Message: describeTransport(a.Err)}
		if isTimeout(a.Err) {
			info.Code = "timeout"
		} else if errors.Is(a.Err, context.Canceled) {
			info.Code = "canceled"
		}
		return outbox.Outcome{Kind: outbox.Retry, Error: info, Refused: a.NotSent}

	case a.Status == http.StatusBadRequest && strings.HasPrefix(a.Message, duplicatePrefix),
		a.Status >= 400 && a.Status <= 499 && a.Code == codeDuplicate:
		// Stripe has the event already: v1 says so in words, v2 by its
		// code (no status is documented for it).
		return outbox.Outcome{Kind: outbox.Accepted, ProviderRef: a.RequestID}
	}
	if o, ok := itemRefusal(a); ok {
		return o
	}
	return statusOutcome(a)
}

// quarantined is the outcome that quarantines the item of answer a for
// reason r, with code.
func quarantined(a Answer, r outbox.Reason, code string) outbox.Outcome {
	return outbox.Outcome{Kind: outbox.Quarantined, Reason: r,
		Error: outbox.ErrorInfo{Status: a.Status, Code: code, Message: a.Message}}
}

// itemRefusal is Classify's rows of the refusals Tally recognises as the
// item's own (a 400 or 404 naming the meter, the customer, the value, the
// payload, the timestamp or the identifier); false for any other answer.
func itemRefusal(a Answer) (outbox.Outcome, bool) {
	contentRefusal := a.Status == http.StatusBadRequest || a.Status == http.StatusNotFound
	param := a.Param
	switch {
	case contentRefusal && names(a, "event_name", "No active meter"):
		return quarantined(a, outbox.ReasonMeterNotFound, "meter_not_found"), true

	case contentRefusal && (strings.Contains(a.Message, "No such customer") ||
		(a.Code == "resource_missing" && strings.HasPrefix(param, "payload["))):
		return quarantined(a, outbox.ReasonCustomerNotFound, "customer_not_found"), true

	case a.Status == http.StatusBadRequest && a.Code == codeTooManyDigits:
		return quarantined(a, outbox.ReasonValueDigits, codeTooManyDigits), true

	case a.Status == http.StatusBadRequest && a.Code == "parameter_missing" && strings.HasPrefix(param, "payload"):
		return quarantined(a, outbox.ReasonPayloadKeys, "payload_keys"), true

	case a.Status == http.StatusBadRequest && (param == "timestamp" || param == "identifier" ||
		a.Code == "parameter_invalid_integer"):
		info := outbox.ErrorInfo{Status: a.Status, Code: a.Code, Message: a.Message}
		if info.Code == "" {
			info.Code = "invalid_" + param
		}
		return outbox.Outcome{Kind: outbox.Rejected, Error: info}, true
	}
	return outbox.Outcome{}, false
}

// statusOutcome is Classify's rows decided by the status alone, once the
// item's own refusals are ruled out.
func statusOutcome(a Answer) outbox.Outcome {
	info := outbox.ErrorInfo{Status: a.Status, Message: a.Message}
	switch {
	case a.Code == codeAccountInvalid && a.Status >= 400 && a.Status <= 499:
		// account_invalid: the key may not act for the Stripe-Account
		// destination (never connected, or access revoked). Stripe's pages
		// give no status for it (docs/stripe.md): at any 4xx it is the
		// destination's fault, not the item's, and must stall the
		// destination rather than quarantine every item provider_refused.
		info.Code = codeAccountRefused
		return outbox.Outcome{Kind: outbox.Retry, Error: info, Refused: true}

	case a.Status == http.StatusUnauthorized || a.Status == http.StatusForbidden:
		info.Code = codeAuth
		return outbox.Outcome{Kind: outbox.Retry, Error: info, Refused: true}

	case a.Status == http.StatusNotFound:
		info.Code = "stripe_not_found"
		return outbox.Outcome{Kind: outbox.Retry, Error: info, Refused: true}

	case a.Status == http.StatusConflict:
		info.Code = "stripe_conflict"
		return outbox.Outcome{Kind: outbox.Retry, Error: info, Refused: true}

	case a.Status == http.StatusTooManyRequests && (a.RateLimitedReason != "" || a.Code == "rate_limit"):
		info.Code = "rate_limited"
		return outbox.Outcome{Kind: outbox.RateLimited, Error: info, MinDelay: a.RetryAfter}

	case a.Status == http.StatusTooManyRequests && a.Code == codeLockTimeout:
		// The call waited for an object's lock and gave up: "Stripe
		// doesn't process these failed requests" (docs/stripe.md). A
		// refused attempt, so the horizon does not bind the item; it is
		// contention on one object, not a rate, so it slows no limiter, and
		// the exponential backoff spaces the retries as Stripe asks.
		info.Code = codeLockTimeout
		return outbox.Outcome{Kind: outbox.Retry, Error: info, Refused: true, MinDelay: a.RetryAfter}

	case a.Status == http.StatusTooManyRequests:
		// Neither a limiter's refusal nor a lock timeout: Stripe's pages
		// do not say that nothing was recorded, so it counts as an attempt
		// that may have reached Stripe, and it slows no limiter.
		info.Code = cmp.Or(a.Code, "stripe_429")
		return outbox.Outcome{Kind: outbox.Retry, Error: info, MinDelay: a.RetryAfter}

	case a.Status >= 500 && a.Status <= 599:
		info.Code = "stripe_5xx"
		return outbox.Outcome{Kind: outbox.Retry, Error: info}

	case a.Status < 400 || a.Status > 499:
		// A 1xx or 3xx (or no status Stripe uses) is not an answer about the
		// item: retry, and since nobody knows what the provider did with the
		// request, as one that may have reached it.
		info.Code = "unexpected_status"
		return outbox.Outcome{Kind: outbox.Retry, Error: info}

	default: // any other 4xx: the provider refused the item, for a cause Tally does not know
		return quarantined(a, outbox.ReasonProviderRefused, cmp.Or(a.Code, "provider_refused"))
	}
}

// Stripe's error codes for meter events that failed after they were
// accepted (the error types of v1.billing.meter.error_report_triggered and
// v1.billing.meter.no_meter_found; docs/stripe.md has the source).
const (
	reportNoMeter           = "no_meter"                        // no active meter for the event name
	reportArchivedMeter     = "archived_meter"                  // the meter for the event name is archived
	reportCustomerNotFound  = "meter_event_customer_not_found"  // no such customer
	reportNoCustomerDefined = "meter_event_no_customer_defined" // the payload lacks the meter's customer key
	reportValueNotFound     = "meter_event_value_not_found"     // the payload lacks the meter's value key (older pages)
	reportInvalidValue      = "meter_event_invalid_value"       // no value under the meter's key, or not a whole number
	reportTooFarInPast      = "timestamp_too_far_in_past"
	reportInFuture          = "timestamp_in_future"
	reportDimensionCount    = "meter_event_dimension_count_too_high"
	reportMissingDimensions = "missing_dimension_payload_keys" // the payload lacks a dimension key of the meter
	// codeTooManyDigits is Stripe's code for a value with more than 15
	// significant digits, as an answer's code and as a report's.
	codeTooManyDigits = "meter_event_value_too_many_digits"
)

// ClassifyReport maps the error code of a failed event named by a Stripe
// meter error report to where fail_accepted moves the accepted item, by the rule for
// provider answers: a cause a mapping fix can cure is quarantined with the
// matching reason, a refusal Tally recognises as the item's own is rejected
// (terminal, visible), a duplicate is no failure at all, and a code Tally
// does not know is quarantined for a human to look at first:
//
//	no_meter, archived_meter                  quarantined meter_not_found
//	meter_event_customer_not_found            quarantined customer_not_found
//	meter_event_no_customer_defined,
//	meter_event_invalid_value,
//	meter_event_value_not_found,
//	missing_dimension_payload_keys            quarantined payload_keys
//	meter_event_value_too_many_digits         quarantined value_digits
//	timestamp_too_far_in_past,
//	timestamp_in_future,
//	meter_event_dimension_count_too_high      rejected
//	duplicate_meter_event                     no failure: Stripe has the event
//	any other code                            quarantined provider_refused
//
// Tally sends whole numbers only, so meter_event_invalid_value — the code
// Stripe now gives for a payload without the meter's value key too — says
// that the meter reads its value under another key than the mapping's: a
// mapping problem a human cures. The reason is empty for rejected; the
// state and the reason are both empty for a code that is no failure of the
// item, whose report is evidence only.
func ClassifyReport(code string) (outbox.State, outbox.Reason) {
	switch code {
	case reportNoMeter, reportArchivedMeter:
		return outbox.StateQuarantined, outbox.ReasonMeterNotFound
	case reportCustomerNotFound:
		return outbox.StateQuarantined, outbox.ReasonCustomerNotFound
	case reportNoCustomerDefined, reportInvalidValue, reportValueNotFound, reportMissingDimensions:
		return outbox.StateQuarantined, outbox.ReasonPayloadKeys
	case codeTooManyDigits:
		return outbox.StateQuarantined, outbox.ReasonValueDigits
	case reportTooFarInPast, reportInFuture, reportDimensionCount:
		return outbox.StateRejected, ""
	case codeDuplicate:
		return "", ""
	default:
		return outbox.StateQuarantined, outbox.ReasonProviderRefused
	}
}

func names(a Answer, param, words string) bool {
	return a.Param == param || strings.Contains(a.Message, words)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

// describeTransport names a transport failure without its text, which may
// carry a URL.
func describeTransport(err error) string {
	switch {
	case err == nil:
		return "no answer"
	case isTimeout(err):
		return "no answer before the request timeout"
	case errors.Is(err, context.Canceled):
		return "the request was cancelled"
	}
	var oe *net.OpError
	if errors.As(err, &oe) {
		return "network error during " + oe.Op
	}
	return "the connection failed"
}
