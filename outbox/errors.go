package outbox

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"
)

// ErrStaleLease is the answer to a transition out of leased (T2-T6) that
// affected zero rows: the item was re-claimed under a newer lease token, or
// is no longer leased. The caller's outcome is dropped; it must not retry the
// write. The resend by the new owner carries the same identifier, so the
// provider deduplicates it.
var ErrStaleLease = errors.New("outbox: stale lease: the item was re-claimed or has left leased")

// ErrNotFound says no item has the given id.
var ErrNotFound = errors.New("outbox: no such item")

// ErrMappingChanged is the answer to a requeue (T9) whose mapping version is
// not the item's: the operator fixed a different mapping from the one the
// item was built with, and must requeue under the item's version or
// re-address it (Supersede).
var ErrMappingChanged = errors.New("outbox: mapping changed")

// ErrMayHaveReached refuses to re-address an item some attempt of which may
// have reached the provider: it keeps its identity and identifier for good.
var ErrMayHaveReached = errors.New("outbox: an attempt may have reached the provider; the item keeps its identifier")

// StateError is the answer to a transition whose expected state did not
// hold (T7, T8, T9, T9r, T10). It carries what the item is now.
type StateError struct {
	// ID is the item.
	ID int64
	// Transition names the refused transition, e.g. "T8".
	Transition string
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

// Is makes errors.Is(err, ErrStateMismatch) true.
func (e *StateError) Is(target error) bool { return target == ErrStateMismatch }

// MaxErrorMessage is the most characters of message an item keeps.
const MaxErrorMessage = 200

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

var (
	codeInvalid = regexp.MustCompile(`[^a-z0-9_.:-]+`)
	// secretish matches tokens that look like credentials: Stripe keys and
	// webhook secrets, bearer tokens, Tally tokens, long base64/hex runs.
	secretish = regexp.MustCompile(`(?i)(?:sk|rk|pk)_(?:live|test)_[a-z0-9_*]*|\b(?:sk|rk|pk|whsec|tly_tok)_[a-z0-9_*]+|\bbearer\s+\S+|\b[a-z0-9+/=_-]{32,}\b`)
	spaces    = regexp.MustCompile(`\s+`)
)

// Sanitized returns e fit for last_error: the code folded to a token of at
// most 64 characters ("error" when empty), the status clamped to 0..999, and
// the message stripped of control characters, of anything that looks like a
// secret, of runs of whitespace, and cut to MaxErrorMessage characters.
func (e ErrorInfo) Sanitized() ErrorInfo {
	code := secretish.ReplaceAllString(e.Code, "redacted")
	code = codeInvalid.ReplaceAllString(strings.ToLower(strings.TrimSpace(code)), "_")
	code = strings.Trim(code, "_.:-")
	if code == "" {
		code = "error"
	}
	if len(code) > 64 {
		code = code[:64]
	}
	status := e.Status
	if status < 0 || status > 999 {
		status = 0
	}
	msg := strings.Map(func(r rune) rune {
		if r == utf8.RuneError || (unicode.IsControl(r) && !unicode.IsSpace(r)) {
			return -1
		}
		return r
	}, e.Message)
	msg = secretish.ReplaceAllString(msg, "[redacted]")
	msg = strings.TrimSpace(spaces.ReplaceAllString(msg, " "))
	if utf8.RuneCountInString(msg) > MaxErrorMessage {
		r := []rune(msg)
		msg = string(r[:MaxErrorMessage-1]) + "…"
	}
	return ErrorInfo{Code: code, Status: status, Message: msg}
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
