package exporter

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// DefaultRequestTimeout bounds one call to Stripe.
const DefaultRequestTimeout = 10 * time.Second

// StripeV1 is the v1 meter-events exporter: one POST /v1/billing/meter_events
// per item, through stripe-go with no retries of its own, the identifier as
// both the event's identifier and the Idempotency-Key, Stripe-Account when
// the destination is a connected account (set on the client), and a request
// timeout. Every resend of an item is the same request.
type StripeV1 struct {
	client  *stripeapi.Client
	timeout time.Duration
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

// Params is the request for an item, the same on every attempt.
func Params(p outbox.Payload) *stripe.BillingMeterEventCreateParams {
	params := &stripe.BillingMeterEventCreateParams{
		EventName:  stripe.String(p.EventName),
		Identifier: stripe.String(p.Identifier),
		Payload: map[string]string{
			"stripe_customer_id": p.Customer,
			"value":              strconv.FormatInt(p.Value, 10),
		},
		Timestamp: stripe.Int64(p.Timestamp),
	}
	params.IdempotencyKey = stripe.String(p.Identifier)
	return params
}

// Send posts the item's meter event and classifies the answer.
func (e *StripeV1) Send(ctx context.Context, item outbox.Lease) outbox.Outcome {
	ctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	ctx, resp := stripeapi.WithResponse(ctx)
	_, err := e.client.Stripe().V1BillingMeterEvents.Create(ctx, Params(item.Payload))
	return Classify(answerOf(resp, err))
}

// answerOf reduces a call's result to an Answer: the status and headers
// from the transport (stripe-go gives v2 errors without them), the error's
// fields from stripe-go. A 2xx is an answer whether or not stripe-go could
// read its body.
func answerOf(resp *stripeapi.Response, err error) Answer {
	var a Answer
	if resp != nil {
		a.Status, a.RequestID = resp.Status, resp.RequestID
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
