// Package exporter owns the provider side of delivery: the Exporter
// interface (its name, the provider's dedup window, the timestamps it
// accepts, a send returning one outcome per item), the Stripe meter-event
// exporters on stripe-go, the classification of provider answers, and flow
// control per destination account.
//
// It must never change an outbox item's state itself (it reports outcomes to
// package outbox), never resend with a different identifier or request body,
// and never log or store a response body or a key. Its code arrives with
// issue 4; this file states the package's contract.
package exporter
