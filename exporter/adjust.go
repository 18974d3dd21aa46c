package exporter

import (
	"context"
	"net/http"

	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Meter event adjustments: an item of outbox.SubjectUsageCancellation that
// names an identifier (payload.cancels; one without is an offsetting meter
// event of a negated value, sent as any event is) cancels that meter event
// through POST /v1/billing/meter_event_adjustments (type=cancel), whichever
// exporter sent the event: adjustments are a v1 call, and the v1 deliverer
// runs on every node. Stripe takes a cancellation only within 24 hours of
// receiving the event; the item's deadline is the caller's to keep
// (docs/design.md, "Cancellations").
//
// What a second cancellation of one identifier answers is not documented
// (docs/stripe.md §9), and a resend after a crash is exactly that: no
// answer to an adjustment is proof. A 2xx is accepted — Stripe took the
// request; its status may still be pending — and reconciliation decides by
// the event's absence from the summaries. Every 4xx Tally does not read as
// the key's, the account's, a conflict or a limiter's quarantines the
// adjustment provider_refused for a human: never rejected (a refusal of the
// identifier may mean it was cancelled already) and never retried as if
// new.

// AdjustmentParams is the request of an attempt of a cancellation item: the
// event name and the identifier to cancel, the same on every attempt, and
// the attempt's own Idempotency-Key (a key per attempt, as for events:
// Stripe would replay a saved 500 to a shared key for 24 hours).
func AdjustmentParams(p outbox.Payload, attempt int) *stripe.BillingMeterEventAdjustmentCreateParams {
	params := &stripe.BillingMeterEventAdjustmentCreateParams{
		EventName: stripe.String(p.EventName),
		Type:      stripe.String(string(stripe.BillingMeterEventAdjustmentTypeCancel)),
		Cancel:    &stripe.BillingMeterEventAdjustmentCreateCancelParams{Identifier: stripe.String(p.Cancels)},
	}
	params.IdempotencyKey = stripe.String(IdempotencyKey(p.Identifier, attempt))
	return params
}

// sendAdjustment posts a cancellation item's adjustment and classifies the
// answer (ClassifyAdjustment).
func (e *StripeV1) sendAdjustment(ctx context.Context, item outbox.Lease) outbox.Outcome {
	if item.Payload.Cancels == "" || item.Payload.EventName == "" {
		return outbox.Outcome{Kind: outbox.Quarantined, Reason: outbox.ReasonProviderRefused, Error: outbox.ErrorInfo{
			Code: "cancel_incomplete", Message: "the cancellation names no meter event identifier or event name"}}
	}
	ctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	ctx, resp := stripeapi.WithResponse(ctx)
	params := AdjustmentParams(item.Payload, item.Attempts)
	if h := headerOf(e.header, item.DestinationAccount); h != "" {
		params.SetStripeAccount(h)
	}
	_, err := e.client.Stripe().V1BillingMeterEventAdjustments.Create(ctx, params)
	return ClassifyAdjustment(answerOf(resp, err))
}

// ClassifyAdjustment turns the answer to a meter event adjustment into an
// outcome: a 2xx is accepted; the key's and the account's refusals, a
// conflict, a limiter's 429, a 5xx and no answer are what Classify makes of
// them; every other 4xx quarantines the adjustment provider_refused.
func ClassifyAdjustment(a Answer) outbox.Outcome {
	switch {
	case a.Status >= 200 && a.Status < 300:
		return outbox.Outcome{Kind: outbox.Accepted, ProviderRef: a.RequestID}
	case a.Status == 0, a.Status >= 500:
		return Classify(a)
	}
	if o := statusOutcome(a); (o.Kind == outbox.Retry || o.Kind == outbox.RateLimited) &&
		(a.Status != http.StatusNotFound || a.Code == "" || a.Code == codeAccountInvalid) {
		// The key's or the account's refusal, a 404 without a code (the
		// endpoint, not the identifier), a conflict, a 429. A 404 with a
		// code (resource_missing: no such event) is an answer about the
		// identifier, below.
		return o
	}
	code := a.Code
	if code == "" {
		code = "stripe_refused"
	}
	return outbox.Outcome{Kind: outbox.Quarantined, Reason: outbox.ReasonProviderRefused,
		Error: outbox.ErrorInfo{Status: a.Status, Code: code, Message: a.Message}}
}
