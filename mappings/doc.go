// Package mappings owns what operators maintain: feature mappings (feature
// to Stripe event name, aggregation and window, versioned with history) and
// tenant mappings (tenant to Stripe customer, billing-period anchor).
//
// It must never rewrite history (every change is a new version) and never
// re-address an item that may have reached the provider. Its code arrives
// with issue 3; this file states the package's contract.
package mappings
