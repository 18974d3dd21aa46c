// Package exporter owns the provider side of delivery: the Exporter and
// BatchExporter interfaces, the Stripe v1 meter-events exporter, the v2
// meter event stream exporter (StripeStream: sessions, batches of 100) and
// the meter event adjustments' exporter (StripeAdjustments: cancellations;
// all on stripe-go, no retries inside the client), the classification of
// provider answers into outcomes (Classify, in one function: docs/export.md,
// with its sources in docs/stripe.md) and of Stripe's
// asynchronous error reports (ClassifyReport), flow control (a Budget per
// destination: an adaptive token bucket per class of call, Limiter, inside
// a bucket for Stripe's basic limit), the Deliverer that
// claims one exporter's outbox items, sends them and hands every outcome
// back to package outbox, and where this node exports to — the destination
// account and mode, from configuration or from Stripe's GET /v1/account
// (Resolver) — and why export is stalled (Resolver.Stall: no key, key
// refused, Stripe unreachable; Stalls: those and the outbox's sustained
// retries, tally_export_stalled).
//
// It must never change an outbox item's state itself (it reports outcomes to
// package outbox), never resend an event with a different identifier or body,
// never have two v1 calls in flight for one (account, customer, meter), and
// never log or store a response body, a key or a session token.
package exporter
