package outbox

import (
	"fmt"
	"time"
)

// OutcomeKind is what an attempt came to.
type OutcomeKind int

// Outcome kinds: the transitions out of leased.
const (
	// Accepted is the accept: the provider accepted the item (or answered that it
	// already had its identifier).
	Accepted OutcomeKind = iota + 1
	// Retry is the retry: try again after the exponential backoff; past the
	// attempt cap or the horizon it is mark_uncertain instead.
	Retry
	// RateLimited is the retry after a rate-limit answer: try again after
	// the rate-limit delay; past the cap or the horizon it is mark_uncertain
	// instead.
	RateLimited
	// Uncertain is mark_uncertain: the item may or may not have reached the provider and
	// must not be sent again automatically.
	Uncertain
	// Rejected is the reject: the provider refused the item itself. Terminal.
	Rejected
	// Quarantined is the quarantine: a mapping, account or mode problem, found at claim
	// time or named by the provider's answer.
	Quarantined
)

var outcomeNames = map[OutcomeKind]string{
	Accepted: "accepted", Retry: "retry", RateLimited: "rate_limited",
	Uncertain: "uncertain", Rejected: "rejected", Quarantined: "quarantined",
}

var outcomeTransitions = map[OutcomeKind]Transition{
	Accepted: TransitionAccept, Retry: TransitionRetry, RateLimited: TransitionRetry,
	Uncertain: TransitionMarkUncertain, Rejected: TransitionReject, Quarantined: TransitionQuarantine,
}

func (k OutcomeKind) String() string {
	if n, ok := outcomeNames[k]; ok {
		return n
	}
	return fmt.Sprintf("OutcomeKind(%d)", int(k))
}

// Outcome is what the holder of a lease reports about one attempt.
type Outcome struct {
	// Lease is the claim the outcome is for; its ID and LeaseToken fence
	// the write, and its Attempts sets the backoff.
	Lease Lease
	// Kind is the outcome.
	Kind OutcomeKind
	// ProviderRef is the provider's reference for an Accepted item (Stripe's
	// Request-Id).
	ProviderRef string
	// Meter is, for an Accepted item, the provider's meter its event name
	// resolved to when it was sent (Stripe's meter id); empty when unknown.
	Meter string
	// Error describes a failure; it is sanitised before it is written.
	Error ErrorInfo
	// Refused says the provider refused this attempt outright, so it cannot
	// have recorded it (a 429, a 401 or 403). It matters for Retry and
	// Uncertain; RateLimited, Rejected and Quarantined attempts are refusals
	// (or were never sent) by definition, and Accepted ones are not.
	Refused bool
	// Reason is the quarantine reason of a Quarantined outcome.
	Reason Reason
	// MinDelay raises a Retry's or RateLimited's delay to at least this long
	// (e.g. the provider's Retry-After).
	MinDelay time.Duration
}

// Result is where one outcome landed.
type Result struct {
	// ID is the item.
	ID int64
	// State is the state the item landed in; empty when Err is set. An
	// Accepted outcome lands in quarantined or rejected when the provider's
	// error report named the item while it was in flight (NoteFailures).
	State State
	// Reason is the quarantine reason when State is quarantined.
	Reason Reason
	// Err is ErrStaleLease when the write was fenced out.
	Err error
}
