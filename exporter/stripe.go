package exporter

import (
	"context"
	"errors"
	"net"
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
	ev, err := e.client.Stripe().V1BillingMeterEvents.Create(ctx, Params(item.Payload))
	return Classify(answerOf(ev, err))
}

// answerOf reduces stripe-go's result to an Answer.
func answerOf(ev *stripe.BillingMeterEvent, err error) Answer {
	if err == nil {
		a := Answer{Status: 200}
		if ev != nil && ev.LastResponse != nil {
			a.Status, a.RequestID = ev.LastResponse.StatusCode, ev.LastResponse.RequestID
		}
		return a
	}
	var a Answer
	var se *stripe.Error
	if errors.As(err, &se) && se.LastResponse != nil {
		a.RequestID = se.LastResponse.RequestID
		if h := se.LastResponse.Header; h != nil {
			switch h.Get("Stripe-Should-Retry") {
			case "true":
				a.ShouldRetry = ptr(true)
			case "false":
				a.ShouldRetry = ptr(false)
			}
			if secs, err := strconv.Atoi(h.Get("Retry-After")); err == nil && secs > 0 {
				a.RetryAfter = time.Duration(secs) * time.Second
			}
		}
	}
	var w *stripeapi.Error
	if errors.As(stripeapi.WrapError(err), &w) {
		a.Status, a.Type, a.Code, a.Param = w.HTTPStatus, w.Type, w.Code, w.Param
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
