package exporter

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"time"

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
	// Err is the transport error when no answer came back.
	Err error
	// NotSent says the request provably never left (the connection could not
	// be made), so the provider cannot have seen it.
	NotSent bool
}

// codeAuth is the error code of a 401 or 403: the key, not the item.
const codeAuth = "stripe_auth"

// duplicatePrefix starts Stripe's answer to a reused meter-event identifier:
// the provider has the event already, which is success.
const duplicatePrefix = "An event already exists with identifier"

// Classify turns a provider's answer into an outcome, per the brief's
// "Provider answers (v1)":
//
//	200                                        accepted (provider_ref = Request-Id)
//	400 duplicate identifier                   accepted
//	400/404 naming no meter for the event name quarantined meter_not_found
//	400/404 naming no such customer            quarantined customer_not_found
//	any other 400 (or 402, 405, 413, 415, 422) rejected, terminal
//	401/403                                    retry with backoff (refused; alerted)
//	any other 404                              retry with backoff (refused: the endpoint, not the item)
//	409                                        retry with backoff (refused)
//	429                                        rate-limited (refused; after Retry-After if given)
//	5xx                                        retry with backoff (may have reached Stripe)
//	5xx with Stripe-Should-Retry: false        uncertain
//	no answer: never sent                      retry with backoff (refused)
//	no answer: timeout, reset, cancelled       retry with backoff (may have reached Stripe)
//	any other status (1xx, 3xx, over 599)      retry with backoff (may have reached Stripe)
//
// A retry past the attempt cap or the horizon becomes uncertain in the
// outbox itself (T3).
func Classify(a Answer) outbox.Outcome {
	info := outbox.ErrorInfo{Status: a.Status, Message: a.Message}
	switch {
	case a.Status >= 200 && a.Status < 300:
		return outbox.Outcome{Kind: outbox.Accepted, ProviderRef: a.RequestID}

	case a.Status == 0:
		info.Code, info.Message = "network", describeTransport(a.Err)
		if isTimeout(a.Err) {
			info.Code = "timeout"
		} else if errors.Is(a.Err, context.Canceled) {
			info.Code = "canceled"
		}
		return outbox.Outcome{Kind: outbox.Retry, Error: info, Refused: a.NotSent}

	case a.Status == http.StatusBadRequest && strings.HasPrefix(a.Message, duplicatePrefix):
		return outbox.Outcome{Kind: outbox.Accepted, ProviderRef: a.RequestID}

	case (a.Status == http.StatusBadRequest || a.Status == http.StatusNotFound) && names(a, "event_name", "No active meter"):
		info.Code = "meter_not_found"
		return outbox.Outcome{Kind: outbox.Quarantined, Reason: outbox.ReasonMeterNotFound, Error: info}

	case (a.Status == http.StatusBadRequest || a.Status == http.StatusNotFound) && names(a, "payload[stripe_customer_id]", "No such customer"):
		info.Code = "customer_not_found"
		return outbox.Outcome{Kind: outbox.Quarantined, Reason: outbox.ReasonCustomerNotFound, Error: info}

	case a.Status == http.StatusUnauthorized || a.Status == http.StatusForbidden:
		info.Code = codeAuth
		return outbox.Outcome{Kind: outbox.Retry, Error: info, Refused: true}

	case a.Status == http.StatusNotFound:
		info.Code = "stripe_not_found"
		return outbox.Outcome{Kind: outbox.Retry, Error: info, Refused: true}

	case a.Status == http.StatusConflict:
		info.Code = "stripe_conflict"
		return outbox.Outcome{Kind: outbox.Retry, Error: info, Refused: true}

	case a.Status == http.StatusTooManyRequests:
		info.Code = "rate_limited"
		return outbox.Outcome{Kind: outbox.RateLimited, Error: info, MinDelay: a.RetryAfter}

	case a.Status >= 500 && a.Status <= 599:
		info.Code = "stripe_5xx"
		if a.ShouldRetry != nil && !*a.ShouldRetry {
			return outbox.Outcome{Kind: outbox.Uncertain, Error: info}
		}
		return outbox.Outcome{Kind: outbox.Retry, Error: info}

	case a.Status < 400 || a.Status > 499:
		// A 1xx or 3xx (or no status Stripe uses) is not an answer about the
		// item: retry, and since nobody knows what the provider did with the
		// request, as one that may have reached it.
		info.Code = "unexpected_status"
		return outbox.Outcome{Kind: outbox.Retry, Error: info}

	default: // any other 4xx: the provider refused the item itself
		info.Code = a.Code
		if info.Code == "" {
			info.Code = "invalid_request"
		}
		return outbox.Outcome{Kind: outbox.Rejected, Error: info}
	}
}

// Stripe's error codes for meter events that failed after they were accepted
// (the error types of v1.billing.meter.error_report_triggered and
// v1.billing.meter.no_meter_found). The ones a mapping fix can cure:
const (
	reportNoMeter           = "no_meter"                        // no active meter for the event name
	reportArchivedMeter     = "archived_meter"                  // the meter for the event name is archived
	reportCustomerNotFound  = "meter_event_customer_not_found"  // no such customer
	reportNoCustomerDefined = "meter_event_no_customer_defined" // the payload lacks the meter's customer key
)

// ClassifyReport maps the error code of a failed event named by a Stripe
// meter error report to where T10 moves the accepted item, by the brief's
// rule for provider answers: a cause a mapping fix can cure is quarantined
// with the matching reason, any other refusal is rejected (terminal,
// visible):
//
//	no_meter, archived_meter                         quarantined meter_not_found
//	meter_event_customer_not_found,
//	meter_event_no_customer_defined                  quarantined customer_not_found
//	anything else (meter_event_invalid_value,
//	timestamp_too_far_in_past, timestamp_in_future,
//	meter_event_dimension_count_too_high,
//	missing_dimension_payload_keys, a code unknown)  rejected
//
// The reason is empty for rejected.
func ClassifyReport(code string) (outbox.State, outbox.Reason) {
	switch code {
	case reportNoMeter, reportArchivedMeter:
		return outbox.StateQuarantined, outbox.ReasonMeterNotFound
	case reportCustomerNotFound, reportNoCustomerDefined:
		return outbox.StateQuarantined, outbox.ReasonCustomerNotFound
	default:
		return outbox.StateRejected, ""
	}
}

// names reports whether an error answer names param, or says so in words.
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
