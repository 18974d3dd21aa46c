// Package quarantine owns the reports of what Tally did not bill and why:
// quarantined items by reason, tenant, feature and period, and the
// completeness report (ingested = confirmed + accepted + pending/leased +
// quarantined + uncertain + rejected).
//
// It reads; it must never change an item's state (requeue goes through
// package outbox) and never hide an item from a total. Its code arrives with
// issue 3; this file states the package's contract.
package quarantine
