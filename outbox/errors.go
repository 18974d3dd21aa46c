package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/redact"
)

// ErrStaleLease is the answer to a transition out of leased (accept, retry,
// mark_uncertain, reject, quarantine) that
// affected zero rows: the item was re-claimed under a newer lease token, or
// is no longer leased. The caller's outcome is dropped; it must not retry the
// write. The resend by the new owner carries the same identifier, so the
// provider deduplicates it.
var ErrStaleLease = errcode.New(errcode.Stale, "stale_lease", "outbox: stale lease: the item was re-claimed or has left leased")

// ErrNotFound says no item has the given id.
var ErrNotFound = errcode.New(errcode.NotFound, "", "outbox: no such item")

// ErrMappingChanged is the answer to a requeue or a supersede whose mapping
// version is not the item's: the operator fixed a different mapping from the
// one the item was built with, and must requeue under the item's version or
// re-address it (Supersede).
var ErrMappingChanged = errcode.New(errcode.Stale, "mapping_changed", "outbox: mapping changed")

// ErrMayHaveReached refuses to re-address an item some attempt of which may
// have reached the provider: it keeps its identity and identifier for good.
var ErrMayHaveReached = errcode.New(errcode.Conflict, "may_have_reached", "outbox: an attempt may have reached the provider; the item keeps its identifier")

// ErrPastHorizon refuses a recovery to pending of an item past its horizon
// when an attempt may have reached the provider: a resend could double-bill.
var ErrPastHorizon = errcode.New(errcode.Conflict, "past_horizon", "outbox: past the horizon, a resend could double-bill; recover to pending only with evidence that no attempt reached the provider")

// ErrNotSendable refuses to requeue in place an item staged without a
// customer, a meter event name or an account: nothing could send it. Fix the
// mapping and re-address it (Supersede).
var ErrNotSendable = errcode.New(errcode.Conflict, "not_sendable", "outbox: the item was staged without a customer, meter or account; re-address it under a mapping that supplies them")

// ErrSuccessorExists refuses a Supersede whose successor identity is already
// an item: re-addressing must create the successor, or usage could be
// counted twice.
var ErrSuccessorExists = errcode.New(errcode.Conflict, "successor_exists", "outbox: the successor identity exists already")

// StateError is the answer to a transition whose expected state did not
// hold (confirm, fail_accepted, recover, requeue, supersede, withdraw,
// supersede_cancelled). It carries what the item is now.
type StateError struct {
	// ID is the item.
	ID int64
	// Transition is the refused transition, e.g. TransitionRecover.
	Transition Transition
	// Expected is the state the transition required.
	Expected State
	// Current is the state the item is in.
	Current State
	// CurrentLeaseToken is the item's lease token now.
	CurrentLeaseToken int64
}

// ErrStateMismatch matches every *StateError with errors.Is.
var ErrStateMismatch = errors.New("outbox: expected state mismatch")

func (e *StateError) Error() string {
	return fmt.Sprintf("outbox: %s on item %d expected it %s, found it %s (lease token %d)",
		e.Transition, e.ID, e.Expected, e.Current, e.CurrentLeaseToken)
}

// Code is errcode.Stale.
func (e *StateError) Code() errcode.Code { return errcode.Stale }

// Condition is "expected_state_mismatch".
func (e *StateError) Condition() string { return "expected_state_mismatch" }

// Is makes errors.Is(err, ErrStateMismatch) true.
func (e *StateError) Is(target error) bool { return target == ErrStateMismatch }

// mismatch re-reads an item after a conditional write found nothing and says
// why: ErrNotFound or a *StateError.
func (s *Store) mismatch(ctx context.Context, q pgdb.Querier, id int64, transition Transition, expected State) error {
	var (
		state State
		token int64
	)
	err := q.QueryRow(ctx, "SELECT state, lease_token FROM outbox_item_states WHERE id = $1", id).Scan(&state, &token)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: %d", ErrNotFound, id)
	}
	if err != nil {
		return fmt.Errorf("outbox: %s: re-reading item %d: %w", transition, id, err)
	}
	return &StateError{ID: id, Transition: transition, Expected: expected, Current: state, CurrentLeaseToken: token}
}

// MaxErrorMessage is the most characters of message an item keeps.
const MaxErrorMessage = redact.MaxMessage

// ErrorInfo is a content-free description of a failure: a stable code, the
// provider's HTTP status (0 when there was no answer) and a short message.
// It never holds a response body, a header or a secret; Sanitized enforces
// that before anything is written.
type ErrorInfo struct {
	// Code is a stable lower-case token, e.g. "stripe_5xx" or "timeout".
	Code string `json:"code"`
	// Status is the provider's HTTP status, 0 when there was none.
	Status int `json:"status,omitempty"`
	// Message is at most MaxErrorMessage characters after sanitising.
	Message string `json:"message,omitempty"`
}

// Sanitized returns e fit for last_error: the code folded to a token of at
// most 64 characters ("error" when empty), the status clamped to 0..999, and
// the message stripped of control characters, of anything that looks like a
// secret, of runs of whitespace, and cut to MaxErrorMessage characters
// (internal/redact does both).
func (e ErrorInfo) Sanitized() ErrorInfo {
	status := e.Status
	if status < 0 || status > 999 {
		status = 0
	}
	return ErrorInfo{Code: redact.Code(e.Code), Status: status, Message: redact.Message(e.Message)}
}

// String renders e as "code (status): message".
func (e ErrorInfo) String() string {
	s := e.Code
	if e.Status != 0 {
		s += fmt.Sprintf(" (%d)", e.Status)
	}
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}
