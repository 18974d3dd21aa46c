// Package exporter owns the provider side of delivery: which exporter this
// node runs and what it promises (the provider's dedup window and the event
// timestamps it accepts), and where this node exports to — the destination
// account and mode, from configuration or from Stripe's GET /v1/account.
// Later it holds the Exporter interface, the Stripe meter-event exporters,
// the classification of provider answers and flow control (issue 4).
//
// It must never change an outbox item's state itself (it reports outcomes to
// package outbox), never resend with a different identifier or request body,
// and never log or store a response body or a key.
package exporter
