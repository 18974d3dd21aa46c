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
// time into Go to decide anything (every duration is compared inside one
// statement with the statement's time, statement_timestamp(), which a
// distributed database decides once on its coordinator), never stores a
// response body or a secret, and never calls a provider: exporters send, and
// report outcomes here. It notifies the deliverers (NotifyChannel) in the
// transaction that makes items pending, so that they wake after its commit.
//
// Each actor has its own methods of Store, and each transition a name
// (Transition; Transitions lists them with the states they join): callers
// that stage usage enqueue (Enqueue, EnqueueBatch: stage,
// stage_quarantined, stage_withdrawn); deliverers claim (Claim: claim) and
// settle the outcome of each attempt (Record, or Accept, Retry,
// RetryRateLimited, MarkUncertain, Reject and Quarantine for one lease:
// accept, retry, mark_uncertain, reject, quarantine); the provider's
// evidence confirms or fails accepted items (Confirm: confirm; FailAccepted:
// fail_accepted) and is noted on items still in flight (NoteFailures), so
// that their accept lands where the report says; operators decide about
// uncertain and quarantined items (Recover: recover; Requeue: requeue;
// Supersede: supersede); cancelled usage withdraws or re-addresses the items
// that carry it (Withdraw: withdraw; SupersedeCancelled:
// supersede_cancelled); the maintenance pass sweeps what no deliverer may
// send any more (Sweep: sweep). docs/outbox.md draws the state diagram and
// lists each transition with its SQL.
//
// The lease and the fence are different things. Who gets an item is decided by
// SELECT ... FOR UPDATE SKIP LOCKED in the claiming transaction; whose write
// wins is decided by lease_token, incremented on every claim and carried by
// every transition out of leased. lease_expires_at only decides when an
// abandoned item may be claimed again.
package outbox
