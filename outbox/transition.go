package outbox

// Transition names a move of an item from one state to another. It is the
// value of the transition label of tally_outbox_transitions_total and
// tally_outbox_stale_writes_total, of a span's tally.outbox.transition
// attribute, and of StateError.Transition.
type Transition string

// The transitions, one conditional statement each (docs/outbox.md has the
// SQL and a diagram of them all).
const (
	// TransitionStage inserts an eligible item: none to pending.
	TransitionStage Transition = "stage"
	// TransitionStageQuarantined inserts an ineligible item, with its
	// reason: none to quarantined.
	TransitionStageQuarantined Transition = "stage_quarantined"
	// TransitionStageWithdrawn inserts the item of usage cancelled before
	// it was staged, so that its ledger rows have an item: none to
	// withdrawn.
	TransitionStageWithdrawn Transition = "stage_withdrawn"
	// TransitionClaim leases a due pending item, or a leased one whose
	// lease expired, to a deliverer.
	TransitionClaim Transition = "claim"
	// TransitionAccept records that the provider accepted the item: leased
	// to accepted (or to where the provider's error report, noted while the
	// item was in flight, says).
	TransitionAccept Transition = "accept"
	// TransitionRetry puts the item back to pending after a failed attempt,
	// inside the attempt cap and the horizon.
	TransitionRetry Transition = "retry"
	// TransitionMarkUncertain ends automatic delivery of an item that may or
	// may not have reached the provider: leased to uncertain, or a retry
	// past the cap or the horizon.
	TransitionMarkUncertain Transition = "mark_uncertain"
	// TransitionReject records that the provider refused the item itself:
	// leased to rejected, terminal.
	TransitionReject Transition = "reject"
	// TransitionQuarantine sets aside an item a human must fix: leased to
	// quarantined.
	TransitionQuarantine Transition = "quarantine"
	// TransitionSweep is the maintenance pass making uncertain what no
	// deliverer may send any more: pending, or leased with an expired
	// lease, to uncertain.
	TransitionSweep Transition = "sweep"
	// TransitionConfirm records the provider's evidence of an accepted
	// item: accepted to confirmed.
	TransitionConfirm Transition = "confirm"
	// TransitionFailAccepted applies the provider's asynchronous error
	// report to an accepted item: accepted to quarantined or rejected.
	TransitionFailAccepted Transition = "fail_accepted"
	// TransitionRecover is an operator's decision about an uncertain item:
	// to accepted, pending or rejected.
	TransitionRecover Transition = "recover"
	// TransitionRequeue is an operator sending a quarantined item again
	// under its identity: quarantined to pending.
	TransitionRequeue Transition = "requeue"
	// TransitionSupersede is an operator re-addressing a quarantined item
	// under a new identity, its successor staged in the same transaction:
	// quarantined to superseded.
	TransitionSupersede Transition = "supersede"
	// TransitionWithdraw closes the item of cancelled usage none of whose
	// attempts may have reached the provider: pending or quarantined to
	// withdrawn.
	TransitionWithdraw Transition = "withdraw"
	// TransitionSupersedeCancelled re-addresses a window's item without a
	// cancelled event, its successor staged in the same transaction:
	// pending or quarantined to superseded.
	TransitionSupersedeCancelled Transition = "supersede_cancelled"
)

// Edge is a transition with the states it leaves and enters.
type Edge struct {
	// Transition is the edge's name.
	Transition Transition
	// From are the states it leaves; empty for an insert.
	From []State
	// To are the states it may enter.
	To []State
	// Method is the Store method that runs it.
	Method string
}

// Transitions lists every transition of the state machine, in the order
// docs/outbox.md shows them. The database's edge trigger admits no other
// change of state.
var Transitions = []Edge{
	{TransitionStage, nil, []State{StatePending}, "Enqueue, EnqueueBatch"},
	{TransitionStageQuarantined, nil, []State{StateQuarantined}, "Enqueue, EnqueueBatch"},
	{TransitionStageWithdrawn, nil, []State{StateWithdrawn}, "Enqueue"},
	{TransitionClaim, []State{StatePending, StateLeased}, []State{StateLeased}, "Claim"},
	{TransitionAccept, []State{StateLeased}, []State{StateAccepted, StateQuarantined, StateRejected}, "Record, Accept"},
	{TransitionRetry, []State{StateLeased}, []State{StatePending}, "Record, Retry, RetryRateLimited"},
	{TransitionMarkUncertain, []State{StateLeased}, []State{StateUncertain}, "Record, MarkUncertain, Retry, RetryRateLimited"},
	{TransitionReject, []State{StateLeased}, []State{StateRejected}, "Record, Reject"},
	{TransitionQuarantine, []State{StateLeased}, []State{StateQuarantined}, "Record, Quarantine"},
	{TransitionSweep, []State{StatePending, StateLeased}, []State{StateUncertain}, "Sweep, Maintain"},
	{TransitionConfirm, []State{StateAccepted}, []State{StateConfirmed}, "Confirm"},
	{TransitionFailAccepted, []State{StateAccepted}, []State{StateQuarantined, StateRejected}, "FailAccepted"},
	{TransitionRecover, []State{StateUncertain}, []State{StateAccepted, StatePending, StateRejected}, "Recover"},
	{TransitionRequeue, []State{StateQuarantined}, []State{StatePending}, "Requeue"},
	{TransitionSupersede, []State{StateQuarantined}, []State{StateSuperseded}, "Supersede"},
	{TransitionWithdraw, []State{StatePending, StateQuarantined}, []State{StateWithdrawn}, "Withdraw"},
	{TransitionSupersedeCancelled, []State{StatePending, StateQuarantined}, []State{StateSuperseded}, "SupersedeCancelled"},
}
