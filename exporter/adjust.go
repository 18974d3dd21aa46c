package exporter

import (
	"context"
	"net/http"
	"time"

	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Meter event adjustments: an item of outbox.SubjectUsageCancellation that
// names an identifier (payload.cancels; one without is an offsetting meter
// event of a negated value, sent as any event is) cancels that meter event
// through POST /v1/billing/meter_event_adjustments (type=cancel), whichever
// exporter sent the event. Such items are staged for the exporter
// StripeMeterEventAdjustments (StripeAdjustments), whose deliverer runs on
// every node with a key, paced by the budget's Adjust class: Stripe counts
// adjustments toward the account's basic limit and the default 25 requests
// a second of an endpoint, not the meter events' own limit. Those staged
// for the v1 exporter before it existed are still sent by the v1 deliverer,
// on the Adjust class too (StripeV1.PaceAdjustments). Stripe takes a
// cancellation only within 24 hours of receiving the event; the item's
// deadline is the caller's to keep (docs/design.md).
//
// What a second cancellation of one identifier answers is not documented
// (docs/stripe.md), and a resend after a crash is exactly that: no
// answer to an adjustment is proof. A 2xx is accepted — Stripe took the
// request; its status may still be pending — and reconciliation decides by
// the event's absence from the summaries. Every 4xx Tally does not read as
// the key's, the account's, a conflict or a limiter's quarantines the
// adjustment provider_refused for a human: never rejected (a refusal of the
// identifier may mean it was cancelled already) and never retried as if
// new.

// StripeAdjustments is the exporter of meter event adjustments
// (StripeMeterEventAdjustments): every item it sends is a cancellation,
// posted as StripeV1 posts one (sendAdjustment), through stripe-go with no
// retries of its own, an Idempotency-Key per attempt and the item's
// Stripe-Account. Its deliverer pays each item's own call on its limiter
// (the budget's Adjust class) before the claim; the probes of earlier keys
// wait for theirs (PaceProbes).
type StripeAdjustments struct{ v1 *StripeV1 }

// NewStripeAdjustments returns the adjustments exporter over client;
// timeout 0 means DefaultRequestTimeout.
func NewStripeAdjustments(client *stripeapi.Client, timeout time.Duration) *StripeAdjustments {
	return &StripeAdjustments{v1: NewStripeV1(client, timeout)}
}

// ForAccounts is StripeV1.ForAccounts. It returns e.
func (e *StripeAdjustments) ForAccounts(header func(account string) string) *StripeAdjustments {
	e.v1.ForAccounts(header)
	return e
}

// PaceProbes is StripeV1.PaceProbes: l is the limiter of this exporter's
// deliverer. It returns e.
func (e *StripeAdjustments) PaceProbes(l *Limiter) *StripeAdjustments {
	e.v1.PaceProbes(l)
	return e
}

// Name is StripeMeterEventAdjustments.
func (e *StripeAdjustments) Name() string { return StripeMeterEventAdjustments }

// DedupWindow is Stripe's 24 hours, as for v1: the horizon of an
// adjustment's identifier, whose attempts' keys Stripe keeps that long.
func (e *StripeAdjustments) DedupWindow() time.Duration { return StripeDedupWindow }

// Accepts is v1's window; an adjustment carries no timestamp of its own and
// the claim check ignores it.
func (e *StripeAdjustments) Accepts() (past, future time.Duration) { return e.v1.Accepts() }

// Send posts the item's meter event adjustment and classifies the answer;
// an item that names no identifier to cancel is quarantined unsent.
func (e *StripeAdjustments) Send(ctx context.Context, item outbox.Lease) outbox.Outcome {
	return e.v1.sendAdjustment(ctx, item)
}

// isAdjustment reports whether item is a cancellation sent as a meter event
// adjustment: one that names the identifier it cancels.
func isAdjustment(item outbox.Lease) bool {
	return item.SubjectKind == outbox.SubjectUsageCancellation && item.Payload.Cancels != ""
}

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

// maxKeyProbes bounds how many earlier attempts' keys a refused resend
// asks Stripe about (sendAdjustment), beyond one per refused attempt;
// maxKeyProbesRefused bounds the whole.
const (
	maxKeyProbes        = 3
	maxKeyProbesRefused = 8
)

// probeWindow returns how many earlier attempts' keys, oldest first, a
// refused resend of item asks (sendAdjustment): maxKeyProbes beyond the
// attempts Stripe refused before executing them (429s: RefusedAttempts),
// which cannot have cancelled anything and may stand before the attempt
// that did, but never more than maxKeyProbesRefused and never the
// attempt's own.
func probeWindow(item outbox.Lease) int {
	return min(item.Attempts-1, maxKeyProbes+max(item.RefusedAttempts, 0), maxKeyProbesRefused)
}

// sendAdjustment posts a cancellation item's adjustment and classifies the
// answer (ClassifyAdjustment).
//
// A resend refused with a 4xx Tally cannot read is most often a second
// cancellation: an earlier attempt was carried out but its answer never
// came back (a lost reply, a timeout, a crash before recording). Before
// quarantining, sendAdjustment resends the same request under the earlier
// attempts' Idempotency-Keys, oldest first (probeWindow of them): Stripe
// replays the first answer to a key for 24 hours, the adjustment's own
// window, and carries out a key it never executed, which cancels nothing
// twice (docs/stripe.md). A 2xx under any key is accepted, as any 2xx is
// (reconciliation decides by absence). A kept 500 or a 4xx says nothing of
// that attempt: the next key is asked. Anything else — no answer, a 5xx
// Stripe did not keep (kept5xx), a conflict, a limiter's 429, the key's or
// the account's refusal — ends the probing, and the item is retried. Only
// when every key asked answers a refusal or a kept 500 is the item
// quarantined provider_refused, with its own attempt's answer.
//
// Oldest first, because only the first attempt Stripe executed can hold
// the success, and the attempts before it were never executed (refused
// with a 429, failed, killed before sending): the window is anchored at
// the first attempt and widened by those refusals. Newest first would let
// retried probes push the attempt that cancelled out of the window.
//
// The item's own call uses the slot the deliverer paid for before the
// claim (a slot of its own, PaceAdjustments, when the deliverer's class is
// not the Adjust class); each probe waits for its own (PaceProbes). No
// call starts unless a whole request timeout fits before ctx's deadline,
// which the deliverer sets inside the item's lease, so no call of the item
// is in flight when another claimer may take it over. A probe without a
// slot, or cut short, is a probe without an answer.
func (e *StripeV1) sendAdjustment(ctx context.Context, item outbox.Lease) outbox.Outcome {
	if item.Payload.Cancels == "" || item.Payload.EventName == "" {
		return outbox.Outcome{Kind: outbox.Quarantined, Reason: outbox.ReasonProviderRefused, Error: outbox.ErrorInfo{
			Code: "cancel_incomplete", Message: "the cancellation names no meter event identifier or event name"}}
	}
	out, _ := e.adjust(ctx, item, item.Attempts)
	if out.Kind != outbox.Quarantined {
		return out
	}
	for k := 1; k <= probeWindow(item); k++ {
		p, a := e.adjust(ctx, item, k)
		switch {
		case p.Kind == outbox.Accepted:
			return p
		case p.Kind == outbox.Quarantined, kept5xx(a):
			// That key's refusal, or the 500 Stripe kept for it: nothing
			// learnt of that attempt.
		default:
			// This attempt's own call reached Stripe, whatever the probe
			// met: never a refused attempt (a RateLimited one would be).
			if p.Kind == outbox.RateLimited {
				p.Kind = outbox.Retry
			}
			p.Refused = false
			return p
		}
	}
	return out
}

// kept5xx reports whether a 5xx is one Stripe keeps for its key and
// replays: marked Idempotent-Replayed, or Stripe-Should-Retry: false, which
// Stripe sets on a 500 its idempotency layer would replay (docs/stripe.md).
// A 5xx without either — a proxy's 502, a fresh failure — may hide an
// answer still to come: the probe learnt nothing, and the item is retried.
func kept5xx(a Answer) bool {
	return a.Status >= 500 && (a.Replayed || (a.ShouldRetry != nil && !*a.ShouldRetry))
}

// adjust posts the item's adjustment under attempt's Idempotency-Key — a
// probe (an earlier attempt's key), or any call under PaceAdjustments, once
// the limiter gives it a slot while a request still fits in ctx — and
// classifies the answer, which it returns too.
func (e *StripeV1) adjust(ctx context.Context, item outbox.Lease, attempt int) (outbox.Outcome, Answer) {
	paced := e.probes != nil && (attempt != item.Attempts || e.paceOwn)
	if l := e.probes; paced {
		wctx := ctx
		if end, ok := ctx.Deadline(); ok {
			var cancel context.CancelFunc
			wctx, cancel = context.WithDeadline(ctx, end.Add(-e.timeout))
			defer cancel()
		}
		if err := l.Wait(wctx); err != nil {
			return outbox.Outcome{Kind: outbox.Retry, Refused: true, Error: outbox.ErrorInfo{
				Code: "limiter", Message: "the rate limiter gave no slot while the lease had time for a request"}}, Answer{}
		}
	}
	ctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	ctx, resp := stripeapi.WithResponse(ctx)
	params := AdjustmentParams(item.Payload, attempt)
	if h := headerOf(e.header, item.DestinationAccount); h != "" {
		params.SetStripeAccount(h)
	}
	start := time.Now()
	_, err := e.client.Stripe().V1BillingMeterEventAdjustments.Create(ctx, params)
	a := answerOf(resp, err)
	o := ClassifyAdjustment(a)
	if l := e.probes; paced {
		// The deliverer reads the item's own answer, unless it is self-paced.
		if o.Kind == outbox.RateLimited {
			l.Slow(start)
		} else if o.Error.Status != 0 || o.Kind == outbox.Accepted {
			l.Ok()
		}
	}
	return o, a
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
