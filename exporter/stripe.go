package exporter

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// DefaultRequestTimeout bounds one call to Stripe.
const DefaultRequestTimeout = 10 * time.Second

// StripeV1 is the v1 meter-events exporter: one POST /v1/billing/meter_events
// per item, through stripe-go with no retries of its own, the item's
// identifier as the event's identifier, an Idempotency-Key of its own for
// every attempt (IdempotencyKey), Stripe-Account when the destination is a
// connected account (the node's, set on the client, or a tenant's:
// ForAccounts), and a request timeout. Every
// resend of an item carries the same parameters; only the key differs.
//
// Why a key per attempt: Stripe saves the first answer to a key once the
// endpoint has started executing — 500s included — and replays it to every
// request with that key for 24 hours. A key shared by the attempts would
// freeze a 500 until the horizon. The meter event's identifier is what
// deduplicates across attempts: a resend of a recorded event is answered
// with the duplicate-identifier 400, which is success.
type StripeV1 struct {
	client  *stripeapi.Client
	timeout time.Duration
	header  func(account string) string
	// probes paces an adjustment's probes of earlier keys, and with paceOwn
	// its own call too (PaceProbes, PaceAdjustments); nil: none.
	probes  *Limiter
	paceOwn bool
}

// PaceProbes makes each probe of an earlier attempt's key (sendAdjustment)
// wait first for a slot of l — the limiter of the deliverer that paid for
// the item's own call before the claim — and only while a whole request
// timeout still fits before the send's deadline; without one, the item is
// retried. It returns e.
func (e *StripeV1) PaceProbes(l *Limiter) *StripeV1 {
	e.probes = l
	return e
}

// PaceAdjustments makes every call of an adjustment this exporter sends —
// its own and its probes — wait for a slot of l, the budget's Adjust
// class, as PaceProbes does, and slow or speed l by the answer (SelfPaced).
// These are cancellations staged for the v1 exporter before adjustments
// had an exporter of their own (StripeMeterEventAdjustments): the v1
// deliverer claims them on a slot of its meter-event class, which is not
// theirs. It returns e.
func (e *StripeV1) PaceAdjustments(l *Limiter) *StripeV1 {
	e.probes, e.paceOwn = l, true
	return e
}

// SelfPaced reports whether the exporter paces the calls of item on a
// limiter of its own (PaceAdjustments): its deliverer then reads no
// flow-control signal from its outcome, which is not its class's.
func (e *StripeV1) SelfPaced(item outbox.Lease) bool { return e.paceOwn && isAdjustment(item) }

// ForAccounts makes the exporter send each item with the Stripe-Account
// header header gives its destination account ("" for none: the client's
// own account); Resolver.Header is the node's rule. Without it every item
// goes to the client's account. It returns e.
func (e *StripeV1) ForAccounts(header func(account string) string) *StripeV1 {
	e.header = header
	return e
}

// NewStripeV1 returns the v1 exporter over client; timeout 0 means
// DefaultRequestTimeout.
func NewStripeV1(client *stripeapi.Client, timeout time.Duration) *StripeV1 {
	if timeout <= 0 {
		timeout = DefaultRequestTimeout
	}
	return &StripeV1{client: client, timeout: timeout}
}

// Name is StripeMeterEvents.
func (e *StripeV1) Name() string { return StripeMeterEvents }

// DedupWindow is Stripe's 24 hours.
func (e *StripeV1) DedupWindow() time.Duration { return StripeDedupWindow }

// Accepts is Stripe's 35 days back, 5 minutes ahead.
func (e *StripeV1) Accepts() (past, future time.Duration) {
	return StripeAcceptPast, StripeAcceptFuture
}

// Timeout is the request timeout.
func (e *StripeV1) Timeout() time.Duration { return e.timeout }

// Params is the request for an attempt of an item: the same parameters on
// every attempt — event name, identifier, the payload under the meter's
// keys, timestamp — and the attempt's own Idempotency-Key.
func Params(p outbox.Payload, attempt int) *stripe.BillingMeterEventCreateParams {
	params := &stripe.BillingMeterEventCreateParams{
		EventName:  stripe.String(p.EventName),
		Identifier: stripe.String(p.Identifier),
		Payload:    payloadOf(p),
		Timestamp:  stripe.Int64(p.Timestamp),
	}
	params.IdempotencyKey = stripe.String(IdempotencyKey(p.Identifier, attempt))
	return params
}

// IdempotencyKey is the Idempotency-Key of an attempt: the item's identifier
// and the attempt's number ("tly_…-a3"), unique to the claim that sends it,
// since attempts are counted at claim and never go back. 73 characters at
// most for a billion attempts, within Stripe's 255.
func IdempotencyKey(identifier string, attempt int) string {
	return identifier + "-a" + strconv.Itoa(attempt)
}

// IdentifierOf returns the meter event identifier a Stripe error report's
// sample names: the sample's request identifier as it is, or, when it is
// one of Tally's per-attempt Idempotency-Keys ("tly_…-a3"), the identifier
// it was made from. stripe-go documents the sample's request.identifier as
// the request's idempotency key, and Stripe's examples show either, so
// Tally matches both (docs/stripe.md).
func IdentifierOf(sample string) string {
	base, attempt, ok := strings.Cut(sample, "-a")
	if !ok || len(base) != outbox.IdentifierLength || !strings.HasPrefix(base, outbox.IdentifierPrefix) || attempt == "" {
		return sample
	}
	if n, err := strconv.Atoi(attempt); err != nil || n < 1 || strconv.Itoa(n) != attempt {
		return sample
	}
	return base
}

// Send posts the item's meter event — or, for a cancellation item, its
// meter event adjustment (adjust.go) — and classifies the answer.
func (e *StripeV1) Send(ctx context.Context, item outbox.Lease) outbox.Outcome {
	if isAdjustment(item) {
		return e.sendAdjustment(ctx, item)
	}
	ctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	ctx, resp := stripeapi.WithResponse(ctx)
	params := Params(item.Payload, item.Attempts)
	if h := headerOf(e.header, item.DestinationAccount); h != "" {
		params.SetStripeAccount(h)
	}
	_, err := e.client.Stripe().V1BillingMeterEvents.Create(ctx, params)
	return Classify(answerOf(resp, err))
}

// headerOf is the Stripe-Account header of a call for account: none
// without a rule.
func headerOf(header func(string) string, account string) string {
	if header == nil {
		return ""
	}
	return header(account)
}

// answerOf reduces a call's result to an Answer: the status and headers
// from the transport (stripe-go gives v2 errors without them), the error's
// fields from stripe-go. A 2xx is an answer whether or not stripe-go could
// read its body.
func answerOf(resp *stripeapi.Response, err error) Answer {
	var a Answer
	if resp != nil {
		a.Status, a.RequestID, a.RateLimitedReason, a.Replayed = resp.Status, resp.RequestID, resp.RateLimitedReason, resp.Replayed
		switch resp.ShouldRetry {
		case "true":
			a.ShouldRetry = ptr(true)
		case "false":
			a.ShouldRetry = ptr(false)
		}
		if secs, err := strconv.Atoi(resp.RetryAfter); err == nil && secs > 0 {
			a.RetryAfter = time.Duration(secs) * time.Second
		}
	}
	if err == nil || a.Status >= 200 && a.Status < 300 {
		if a.Status == 0 {
			a.Status = http.StatusOK
		}
		return a
	}
	var w *stripeapi.Error
	if errors.As(stripeapi.WrapError(err), &w) {
		a.Type, a.Code, a.Param = w.Type, w.Code, w.Param
		if a.Status == 0 {
			a.Status = w.HTTPStatus
		}
		if a.RequestID == "" {
			a.RequestID = w.RequestID
		}
	}
	_, _, a.Message = stripeapi.Describe(err)
	if a.Status == 0 {
		a.Err, a.Message = err, ""
		var oe *net.OpError
		a.NotSent = errors.As(err, &oe) && oe.Op == "dial"
	}
	return a
}

func ptr[T any](v T) *T { return &v }
