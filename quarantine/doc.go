// Package quarantine owns what Tally did not bill, and why: the quarantine
// report (by reason, tenant, feature and period, with counts and value
// totals, as JSON, CSV safe for spreadsheets, or a table), the completeness
// report (per tenant, feature and period: ingested against confirmed,
// accepted, pending, quarantined, uncertain and rejected, and whether the
// conservation identity holds), and the operator's requeue: in place (T9)
// when the item can be sent as it stands, re-addressed (T9r) when the fix
// changed what it must carry and no attempt of it may have reached Stripe.
//
// It reads the ledger, the outbox and the mappings in one snapshot per
// report, and the last reconcile run through package reconcile; it changes an item only through package
// outbox, builds items only through package meter, and never hides an item
// from a total. It owns report_snapshots, the completeness report's latest
// computation per month (Reports): served to every request while young
// enough, computed once at a time per month across nodes, never per
// request; a snapshot is derived data, never a ledger or outbox row.
package quarantine
