// Package reconcile owns the comparison of what Tally holds as accepted or
// confirmed with Stripe's own numbers (meter event summaries), the
// discrepancies finance acts on, and the confirmation (T7) of items the
// evidence proves.
//
// It must never confirm on a mismatch, never move an item other than through
// package outbox, and never resend anything. Its code arrives with issue 5;
// this file states the package's contract.
package reconcile
