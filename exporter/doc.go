// Package exporter owns the provider side of delivery: the Exporter
// interface and the Stripe v1 meter-events exporter (on stripe-go, no
// retries inside the client), the classification of provider answers into
// outcomes (Classify, the brief's table in one function), flow control (an
// adaptive token bucket per destination, Limiter), the Deliverer that claims
// outbox items, sends them and hands every outcome back to package outbox,
// and where this node exports to — the destination account and mode, from
// configuration or from Stripe's GET /v1/account (Resolver).
//
// It must never change an outbox item's state itself (it reports outcomes to
// package outbox), never resend with a different identifier or request body,
// never have two calls in flight for one (account, customer, meter), and
// never log or store a response body or a key.
package exporter
