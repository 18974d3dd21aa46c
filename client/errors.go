package client

import (
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"strings"
	"time"
)

// ErrClosed is the error of Add, Post and Flush after Close, and of Close
// called again.
var ErrClosed = errors.New("client: closed")

// ErrEventTooLarge says an event encodes to more bytes than one request
// (Post) or one batch (Add) may carry; nothing of it was sent.
var ErrEventTooLarge = errors.New("client: event too large")

// ErrRetryBudgetSpent says a request was retried for as long as the retry
// budget (WithRetryBudget) allows, or the server's Retry-After asked for a
// wait past it; the error wraps it together with the last failure.
var ErrRetryBudgetSpent = errors.New("client: retry budget spent")

// StatusError is an answer of POST /v1/usage other than 202 that the
// client gave up on: a status never retried (3xx, 400, 401, 403, 413), or a
// 429 or 5xx whose retries ran out. It carries the server's error code and
// message, never the token or the request.
type StatusError struct {
	// StatusCode is the HTTP status.
	StatusCode int
	// Code is the server's error code ("unauthorized", "forbidden_tenant",
	// "batch_too_large", "rate_limited", …); empty when the answer did not
	// carry Tally's error shape (a proxy's, say).
	Code string
	// Message is the server's explanation, when it gave one.
	Message string
	// RetryAfter is the wait the server asked for in Retry-After; 0 when it
	// asked for none.
	RetryAfter time.Duration
}

func (e *StatusError) Error() string {
	s := fmt.Sprintf("client: POST /v1/usage answered %d %s", e.StatusCode, http.StatusText(e.StatusCode))
	if e.Code != "" {
		s += " (" + e.Code + ")"
	}
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

// retryable reports whether the same request may succeed later: a 429 or a
// 5xx.
func (e *StatusError) retryable() bool {
	return e.StatusCode == http.StatusTooManyRequests || e.StatusCode >= 500
}

// RedirectError is a 3xx answer. The client follows no redirect: following
// one would send the token wherever it points (a 308 to http sends it in
// clear) and a 302 would turn the POST into a GET, so the events are not
// delivered and the request is not retried. Point the base URL at where
// Tally is served. errors.As also finds its StatusError.
type RedirectError struct {
	StatusError
	// Location is the scheme and host the answer pointed to, such as
	// "http://tally.internal"; empty when it named none that parses.
	Location string
}

func (e *RedirectError) Error() string {
	to := "no valid Location"
	if e.Location != "" {
		to = "a redirect to " + e.Location
	}
	return fmt.Sprintf("client: POST /v1/usage answered %d %s, %s: the client follows no redirect, so nothing was delivered; set the base URL to where Tally is served",
		e.StatusCode, http.StatusText(e.StatusCode), to)
}

// Unwrap is the 3xx as a *StatusError.
func (e *RedirectError) Unwrap() error { return &e.StatusError }

// Problem is one thing Tally found wrong with a refused request, as it
// gave it.
type Problem struct {
	// Index is the position of the event the problem is about; nil for the
	// request as a whole. For Post it is the position in the events given to
	// Post; in a report of Add's events, the position in the refused batch.
	Index *int `json:"index"`
	// Field is the event's field ("id", "tenant", "timestamp", …), or
	// empty for the event as a whole.
	Field string `json:"field"`
	// Reason says what is wrong, e.g. "an event with this id was stored
	// before with different content".
	Reason string `json:"reason"`
}

func (p Problem) String() string {
	var b strings.Builder
	if p.Index != nil {
		fmt.Fprintf(&b, "event %d", *p.Index)
	} else {
		b.WriteString("the request")
	}
	if p.Field != "" {
		b.WriteString(" " + p.Field)
	}
	return b.String() + ": " + p.Reason
}

// InvalidError is a 422: Tally refused the request whole (nothing of it
// stored), with one problem per thing wrong — at most 100 — such as an
// invalid field or an id stored before with other content. It is never
// retried. errors.As also finds its StatusError.
type InvalidError struct {
	StatusError
	// Problems are the server's, in its order.
	Problems []Problem
}

func (e *InvalidError) Error() string {
	noun := "problems"
	if len(e.Problems) == 1 {
		noun = "problem"
	}
	s := fmt.Sprintf("client: POST /v1/usage refused the request (%d %s): %d %s", e.StatusCode, e.Code, len(e.Problems), noun)
	if len(e.Problems) > 0 {
		s += ", the first: " + e.Problems[0].String()
	}
	return s
}

// Unwrap is the 422 as a *StatusError.
func (e *InvalidError) Unwrap() error { return &e.StatusError }

// offset is the error with its problems' indexes moved by n: from a
// request's events to the events of the Post that sent it.
func (e *InvalidError) offset(n int) *InvalidError {
	out := &InvalidError{StatusError: e.StatusError, Problems: make([]Problem, len(e.Problems))}
	for i, p := range e.Problems {
		if p.Index != nil {
			idx := *p.Index + n
			p.Index = &idx
		}
		out.Problems[i] = p
	}
	return out
}

// Undelivered is an event that was not delivered, and why.
type Undelivered struct {
	// Event is the event as it was sent (or would have been): with the
	// timestamp Add gave it. Posting it again is safe: if an attempt
	// stored it after all, it is a duplicate.
	Event Event
	// Err is why: an *InvalidError, a *RedirectError, a *StatusError, a
	// network error, an error wrapping ErrRetryBudgetSpent, a context's
	// error, or ErrClosed.
	Err error
	// Problems are those of a 422 that name this event; empty when it was
	// refused with its request for other reasons or others' problems.
	Problems []Problem
}

// UndeliveredError lists the events a call did not deliver. Post returns
// it when a request failed; Flush and Close when events were reported
// undelivered or their context ended first. errors.As and errors.Is reach
// every distinct cause (an *InvalidError, a *StatusError, a context's
// error…) through it.
type UndeliveredError struct {
	// Events are the events not delivered, in the order they were given,
	// each with why. Each undelivered event is listed by one Post, Flush or
	// Close only.
	Events []Undelivered
	// Unlisted counts events not delivered beyond those listed: the client
	// keeps at most the buffer's size (WithBufferSize) of them for Flush and
	// Close; all were passed to the error handler.
	Unlisted int
	// Pending counts, for a Flush whose context ended, the events added
	// before it that are still buffered: they are still being delivered,
	// and a later Flush or Close reports them if they are not.
	Pending int
	// Err is the call's context's error when it ended first.
	Err error
}

func (e *UndeliveredError) Error() string {
	var b strings.Builder
	b.WriteString("client: ")
	if n := len(e.Events) + e.Unlisted; n > 0 || e.Pending == 0 {
		fmt.Fprintf(&b, "%d events not delivered", n)
		if e.Unlisted > 0 {
			fmt.Fprintf(&b, " (%d not listed)", e.Unlisted)
		}
		if e.Pending > 0 {
			b.WriteString(", ")
		}
	}
	if e.Pending > 0 {
		fmt.Fprintf(&b, "%d events still buffered", e.Pending)
	}
	causes := e.causes()
	if len(causes) > 0 {
		b.WriteString(": " + strings.TrimPrefix(causes[0].Error(), "client: "))
		if len(causes) > 1 {
			fmt.Fprintf(&b, " (and %d other causes)", len(causes)-1)
		}
	}
	if e.Err != nil {
		b.WriteString(": " + e.Err.Error())
	}
	return b.String()
}

// Unwrap is the context's error, if any, and the distinct causes.
func (e *UndeliveredError) Unwrap() []error {
	out := e.causes()
	if e.Err != nil {
		out = append([]error{e.Err}, out...)
	}
	return out
}

// causes are the distinct errors of Events, in order.
func (e *UndeliveredError) causes() []error {
	var (
		out  []error
		seen = map[error]bool{}
	)
	for _, u := range e.Events {
		if u.Err == nil {
			continue
		}
		if reflect.TypeOf(u.Err).Comparable() {
			if seen[u.Err] {
				continue
			}
			seen[u.Err] = true
		}
		out = append(out, u.Err)
	}
	return out
}

// undelivered lists events, all not delivered for err.
func undelivered(events []Event, err error) []Undelivered {
	out := make([]Undelivered, len(events))
	for i, ev := range events {
		out[i] = Undelivered{Event: ev, Err: err}
	}
	return out
}
