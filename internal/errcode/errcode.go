// Package errcode owns the codes domain errors carry, so that each door
// (the API, the console, the command line) answers a refusal from its code
// in one function instead of a switch on every error it knows.
//
// A Code says what kind of refusal an error is; an error may also name its
// condition, a stable snake_case token (the API's problem code). An error
// without a code is a failure: a door answers it as internal and never
// shows its text.
//
// It is a leaf: it imports nothing of Tally. It must never decide how a
// door answers (statuses, pages, exit codes belong to the door).
package errcode

import "errors"

// Code is the kind of a refusal.
type Code string

// The codes. Internal is Of's answer for an error without a code.
const (
	// NotFound: the thing asked for does not exist.
	NotFound Code = "not_found"
	// Conflict: the request is well formed but the state refuses it.
	Conflict Code = "conflict"
	// Invalid: the request itself is wrong; asking again unchanged fails
	// again.
	Invalid Code = "invalid"
	// Stale: the request was made against a state that has since moved.
	Stale Code = "stale"
	// Forbidden: the caller may not do this.
	Forbidden Code = "forbidden"
	// Unavailable: something the request needs cannot be reached now;
	// asking later may succeed.
	Unavailable Code = "unavailable"
	// Internal: a failure, not a refusal.
	Internal Code = "internal"
)

// Codes lists every code, Internal last.
var Codes = []Code{NotFound, Conflict, Invalid, Stale, Forbidden, Unavailable, Internal}

// Coded is an error that carries a code.
type Coded interface {
	error
	Code() Code
}

// Conditioned is a Coded error that names its condition.
type Conditioned interface {
	Coded
	Condition() string
}

// Of is the code of the first error in err's chain that carries one, or
// Internal.
func Of(err error) Code {
	var c Coded
	if errors.As(err, &c) {
		return c.Code()
	}
	return Internal
}

// ConditionOf is the condition of the first error in err's chain that
// carries a code: the one it names, else its code's name. An error without
// a code has the condition "internal".
func ConditionOf(err error) string {
	var c Coded
	if !errors.As(err, &c) {
		return string(Internal)
	}
	if r, ok := c.(Conditioned); ok && r.Condition() != "" {
		return r.Condition()
	}
	return string(c.Code())
}

// Error is a sentinel error with a code and a condition.
type Error struct {
	code      Code
	condition string
	text      string
}

// New is a sentinel error with code and condition (empty: the code's
// name) whose text is text.
func New(code Code, condition, text string) *Error {
	return &Error{code: code, condition: condition, text: text}
}

func (e *Error) Error() string { return e.text }

// Code is e's code.
func (e *Error) Code() Code { return e.code }

// Condition is e's condition.
func (e *Error) Condition() string { return e.condition }
