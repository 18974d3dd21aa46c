// Package quarantine owns what Tally did not bill, and why: the quarantine
// report (by reason, tenant, feature and period, with counts and value
// totals, as JSON, CSV safe for spreadsheets, or a table), the completeness
// report (per tenant, feature and period: ingested against confirmed,
// accepted, pending, quarantined, uncertain and rejected, and whether the
// conservation identity holds), and the operator's requeue: in place (requeue)
// when the item can be sent as it stands, re-addressed (supersede) when the fix
// changed what it must carry and no attempt of it may have reached Stripe.
//
// The completeness report is read from counters (completeness_counters
// and completeness_items), which triggers change in the
// transaction of every write that moves usage: O(keys), whatever the
// month's volume (CompletenessOf). The full computation from the ledger,
// the outbox and the mappings (LedgerCompletenessOf) is their auditor:
// AuditCompleteness compares the two in one snapshot, AuditWorker does it
// nightly and records it in completeness_audits, and RepairCompleteness
// rewrites a month from the ledger only when an operator asks. LineItems
// lists the items behind one line, read by the line's ordering keys and
// period, never the month.
//
// It reads the last reconcile run through package reconcile; it changes an
// item only through package outbox, builds items only through package
// meter, and never hides an item from a total. It owns report_snapshots,
// the completeness report's latest computation per month (Reports): served
// to every request while young enough, computed once at a time per month
// across nodes, never per request; a snapshot, like a counter, is derived
// data, never a ledger or outbox row.
package quarantine
