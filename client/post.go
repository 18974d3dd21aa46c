package client

import (
	"context"
	"errors"
	"fmt"
)

// ErrNotSent is the cause of events of a Post that were never sent
// because an earlier request of the same Post failed.
var ErrNotSent = errors.New("client: not sent: an earlier request of the same Post failed")

// Post sends events to Tally now, and returns once Tally has answered: the
// counts of the events stored, and of those stored before (duplicates,
// including events an attempt stored whose reply was lost). Events are sent
// as given; one without a timestamp takes the server's clock.
//
// Events that fit one request (WithRequestLimits: by default 10,000 events
// and 5 MiB) are one request, stored whole or not at all. More are split,
// in order, into several requests, each stored whole or not at all but not
// together: when one fails, Post sends no more and returns the Result of the
// requests stored before it.
//
// A request is retried after a network error, a 5xx or a 429 (see the
// package documentation), within the retry budget and ctx. On failure the
// error is an *UndeliveredError listing every event not delivered, each
// with its cause: the failed request's events (an *InvalidError for a 422,
// whose problems' indexes are positions in events, or a *StatusError, a
// network error, ctx's error) and the events after them (ErrNotSent).
// Before sending anything, Post returns ErrClosed after Close, and an error
// wrapping ErrEventTooLarge for an event that alone exceeds a request's
// bytes. Posting no events does nothing.
func (c *Client) Post(ctx context.Context, events ...Event) (Result, error) {
	if c.closed() {
		return Result{}, ErrClosed
	}
	if len(events) == 0 {
		return Result{}, nil
	}
	enc := make([][]byte, len(events))
	for i, ev := range events {
		b, err := ev.encode()
		if err != nil {
			return Result{}, fmt.Errorf("client: encoding event %d: %w", i, err)
		}
		if size := bodySize(1, len(b)); size > c.cfg.requestBytes {
			return Result{}, fmt.Errorf("%w: event %d makes a request of %d bytes, more than one may carry (%d); nothing was sent",
				ErrEventTooLarge, i, size, c.cfg.requestBytes)
		}
		enc[i] = b
	}
	var total Result
	for _, r := range split(enc, c.cfg.requestEvents, c.cfg.requestBytes) {
		res, err := c.send(ctx, body(enc[r.from:r.to]))
		if err != nil {
			return total, postFailure(events, r, err)
		}
		total.add(res)
	}
	return total, nil
}

// postFailure is the error of a Post whose request r failed with err.
func postFailure(events []Event, r span, err error) *UndeliveredError {
	var problems map[int][]Problem
	if inv, ok := err.(*InvalidError); ok {
		if r.from > 0 {
			inv = inv.offset(r.from)
			err = inv
		}
		problems = problemsByEvent(inv.Problems, r.from, r.to)
	}
	u := &UndeliveredError{Events: undelivered(events[r.from:r.to], err)}
	for i := range u.Events {
		u.Events[i].Problems = problems[r.from+i]
	}
	u.Events = append(u.Events, undelivered(events[r.to:], ErrNotSent)...)
	return u
}

// problemsByEvent groups the problems naming an event in [from, to) by its
// index.
func problemsByEvent(problems []Problem, from, to int) map[int][]Problem {
	out := map[int][]Problem{}
	for _, p := range problems {
		if p.Index != nil && *p.Index >= from && *p.Index < to {
			out[*p.Index] = append(out[*p.Index], p)
		}
	}
	return out
}

// span is the events [from, to) of one request.
type span struct{ from, to int }

// split cuts encoded events, in order, into requests of at most maxEvents
// events and maxBytes bytes of body. Each event fits a request alone.
func split(enc [][]byte, maxEvents, maxBytes int) []span {
	var (
		out   []span
		from  int
		bytes int
	)
	for i, e := range enc {
		if n := i - from; n > 0 && (n == maxEvents || bodySize(n+1, bytes+len(e)) > maxBytes) {
			out = append(out, span{from, i})
			from, bytes = i, 0
		}
		bytes += len(e)
	}
	return append(out, span{from, len(enc)})
}
