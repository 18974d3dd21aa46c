// Package outbox owns Tally's export outbox: its items — each a body
// (identity and payload, outbox_item_bodies, never updated) and a state row
// (state, lease, counters and outcome, outbox_item_states), which other
// packages read joined through the view outbox_items — and the state
// machine docs/outbox.md describes, which every unit of usage passes through
// on its way to Stripe.
//
// It is the only code that changes an item's state. Every transition is one
// conditional UPDATE carrying its predicate (docs/outbox.md lists each, with
// its SQL); a write that affects zero rows is reported to the caller
// (ErrStaleLease, *StateError, ErrMappingChanged) and counted by the
// stale-writer metric, never retried. It never deletes a row, never reads the
// time into Go to decide anything (every duration is compared with
// clock_timestamp() inside one statement), never stores a response body or a
// secret, and never calls a provider: exporters send, and report outcomes
// here.
//
// Each actor has its own methods of Store: callers that stage usage enqueue
// (Enqueue, EnqueueBatch: T0, T0q); deliverers claim (Claim: T1) and settle
// the outcome of each attempt (Record, or Accept, Retry, RetryRateLimited,
// MarkUncertain, Reject and Quarantine for one lease: T2-T6); the provider's
// evidence confirms or fails accepted items (Confirm: T7; FailAccepted: T10)
// and is noted on items still in flight (NoteFailures); operators decide
// about uncertain and quarantined items (Recover: T8; Requeue: T9;
// Supersede: T9r); the maintenance pass sweeps what no deliverer may send
// any more (Sweep: T4).
//
// The states and transitions (docs/outbox.md has the SQL of each):
//
//	             enqueue (eligible) T0            enqueue (ineligible) T0q
//	                    |                                   |
//	                    v                                   v
//	+-------------> pending --T1 claim--> leased --T2--> accepted --T7--> confirmed
//	|                 ^  |                 | | |            |
//	|                 |  |                 | | |            +--T10 error report---+
//	|  T3 retry       |  | T4 sweep        | | +--T5 reject-----> rejected <------+  (terminal, visible)
//	+-----------------+  +---------------->+-+----T4-----------> uncertain        |  (cap or horizon)
//	                  ^                    |                        |             |
//	                  |                    +--T6------------> quarantined <-------+
//	                  |                                             |  |
//	                  |                                             |  +--T9r--> superseded  (re-addressed)
//	                  +---------------T9 requeue--------------------+
//	                  +---------------T8 recovery------- uncertain (to pending, accepted or rejected)
//
// T2 lands in quarantined or rejected instead of accepted when the
// provider's error report named the item while it was in flight
// (NoteFailures): the report overtook the answer to its request. A
// re-addressed item's successor (T9r) has a new mapping version, or the next
// re-address generation of its subject ref (ReaddressRef).
//
// The lease and the fence are different things. Who gets an item is decided by
// SELECT ... FOR UPDATE SKIP LOCKED in the claiming transaction; whose write
// wins is decided by lease_token, incremented on every claim and carried by
// every transition out of leased. lease_expires_at only decides when an
// abandoned item may be claimed again.
package outbox
