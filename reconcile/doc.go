// Package reconcile owns the comparison of what Tally holds as accepted or
// confirmed with Stripe's own numbers (hourly meter event summaries), the
// runs that do it and the discrepancies finance acts on, and the
// confirmation (T7) of items the evidence proves.
//
// A run works through every (account, customer, meter) with accepted items
// older than the settle delay, one key at a time: it reads the key's hourly
// summaries (through the account's rate limiter), compares each hour by the
// meter's formula, and commits the hour's confirmations, its discrepancies
// and the run's progress in one transaction per key, so that a run killed
// mid-way resumes after its last key, and a rerun ends where an
// uninterrupted run would have.
//
// It must never confirm on a mismatch, never move an item other than
// through package outbox, never resend anything, and never compare an hour
// that still has an item pending or in flight.
package reconcile
