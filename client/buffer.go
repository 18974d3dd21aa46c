package client

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"
)

// errAborted is the cause of buffered events never sent because Close's
// context ended first.
var errAborted = errors.New("client: not sent: Close's context ended first")

// queued is an event Add accepted.
type queued struct {
	seq   uint64 // Add's order, from 1 without gaps
	ev    Event  // with the timestamp Add gave it
	raw   []byte // ev encoded: the bytes every attempt sends
	added time.Time
}

// failure is an event reported undelivered, kept for Flush or Close.
type failure struct {
	seq uint64
	u   Undelivered
}

// buffer is Add's state, guarded by Client.mu. Events are delivered in
// batches in Add's order, one batch at a time, so that every event up to
// settled is delivered or reported.
type buffer struct {
	pending      []queued // added, not yet taken by the sender, in order
	pendingBytes int      // encoded bytes of pending
	heldEvents   int      // events added and not yet settled: pending and being sent
	heldBytes    int      // their encoded bytes
	lastSeq      uint64   // of the last event added
	settled      uint64   // every event up to it is delivered or reported
	flushTo      uint64   // the sender sends every pending event up to it at once
	closing      bool     // Close was called: Add and Flush refuse
	started      bool     // the sender runs (from the first Add)
	failures     []failure
	unlisted     int // failures reported beyond the bufferSize kept
	// changed is closed, and replaced, when events settle or closing
	// starts: Add waits on it for room, Flush for its events.
	changed chan struct{}
}

func (b *buffer) init() { b.changed = make(chan struct{}) }

func (b *buffer) signal() {
	close(b.changed)
	b.changed = make(chan struct{})
}

// full reports whether pending holds a batch: one more event would not
// fit it.
func (b *buffer) full(cfg *config) bool {
	return len(b.pending) >= cfg.batchSize || bodySize(len(b.pending), b.pendingBytes) > cfg.batchBytes
}

// take removes the next batch from pending when one is due — full,
// flushed, closing, or its first event FlushInterval old — and otherwise
// says how long until one is (0: until woken). stop is true once closing
// and nothing is left.
func (b *buffer) take(cfg *config, now time.Time) (batch []queued, wait time.Duration, stop bool) {
	if len(b.pending) == 0 {
		return nil, 0, b.closing
	}
	if !b.closing && !b.full(cfg) && b.pending[0].seq > b.flushTo {
		if wait = b.pending[0].added.Add(cfg.flushInterval).Sub(now); wait > 0 {
			return nil, wait, false
		}
	}
	n, size := 0, 0
	for n < len(b.pending) && n < cfg.batchSize {
		next := len(b.pending[n].raw)
		if n > 0 && bodySize(n+1, size+next) > cfg.batchBytes {
			break
		}
		size += next
		n++
	}
	batch = slices.Clone(b.pending[:n])
	b.pending = append(b.pending[:0:0], b.pending[n:]...)
	b.pendingBytes -= size
	return batch, 0, false
}

// takeFailures removes and returns the failures of events up to seq, and
// the count of those not kept; nil when there are none.
func (b *buffer) takeFailures(seq uint64) *UndeliveredError {
	n := 0
	for n < len(b.failures) && b.failures[n].seq <= seq {
		n++
	}
	if n == 0 && b.unlisted == 0 {
		return nil
	}
	u := &UndeliveredError{Events: make([]Undelivered, n), Unlisted: b.unlisted}
	for i, f := range b.failures[:n] {
		u.Events[i] = f.u
	}
	b.failures = append(b.failures[:0:0], b.failures[n:]...)
	b.unlisted = 0
	return u
}

// Add puts ev in the buffer for the background sender to post in a batch
// (see WithBatchSize, WithBatchBytes, WithFlushInterval), and returns at
// once unless the buffer is full (WithBufferSize, WithBufferBytes, counting
// the events being sent): then it blocks until there is room or ctx ends,
// which returns ctx's error with ev not added. An event without a timestamp
// is given the time of the Add, which every attempt then sends.
//
// A batch is retried like Post's requests. A 422 stores nothing of the
// batch: the events its problems name are reported undelivered and the
// others sent again. Events not delivered — refused, or their batch's
// retries spent — are passed to the error handler and listed by the next
// Flush or Close. Add returns ErrClosed once Close was called, and an error
// wrapping ErrEventTooLarge for an event that alone exceeds a batch.
func (c *Client) Add(ctx context.Context, ev Event) error {
	now := c.cfg.now()
	ev = ev.stampNow(now)
	raw, err := ev.encode()
	if err != nil {
		return fmt.Errorf("client: encoding the event: %w", err)
	}
	if size := bodySize(1, len(raw)); size > c.cfg.batchBytes {
		return fmt.Errorf("%w: it makes a batch of %d bytes, more than one may carry (%d); it was not added",
			ErrEventTooLarge, size, c.cfg.batchBytes)
	}
	c.mu.Lock()
	b := &c.buf
	for {
		if b.closing {
			c.mu.Unlock()
			return ErrClosed
		}
		if b.heldEvents < c.cfg.bufferSize && b.heldBytes+len(raw) <= c.cfg.bufferBytes {
			break
		}
		changed := b.changed
		c.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("client: the buffer stayed full, the event was not added: %w", ctx.Err())
		}
		c.mu.Lock()
	}
	if !b.started {
		b.started = true
		go c.run()
	}
	b.lastSeq++
	b.pending = append(b.pending, queued{seq: b.lastSeq, ev: ev, raw: raw, added: c.cfg.now()})
	b.pendingBytes += len(raw)
	b.heldEvents++
	b.heldBytes += len(raw)
	if len(b.pending) == 1 || b.full(&c.cfg) {
		c.poke()
	}
	c.mu.Unlock()
	return nil
}

// Flush sends at once every event added before it and waits until each is
// delivered or reported. It returns nil when all were delivered, and
// otherwise an *UndeliveredError listing those that were not (and were not
// listed by an earlier Flush), each with why. When ctx ends first, the
// error also counts the events still buffered (Pending), which the sender
// keeps delivering, and wraps ctx's error. It returns ErrClosed once Close
// was called.
func (c *Client) Flush(ctx context.Context) error {
	c.mu.Lock()
	b := &c.buf
	if b.closing {
		c.mu.Unlock()
		return ErrClosed
	}
	target := b.lastSeq
	if target > b.flushTo {
		b.flushTo = target
		c.poke()
	}
	for b.settled < target {
		changed := b.changed
		c.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			c.mu.Lock()
			u := b.takeFailures(target)
			if u == nil {
				u = &UndeliveredError{}
			}
			u.Pending, u.Err = int(target-b.settled), ctx.Err()
			c.mu.Unlock()
			return u
		}
		c.mu.Lock()
	}
	u := b.takeFailures(target)
	c.mu.Unlock()
	if u == nil {
		return nil
	}
	return u
}

// Close refuses further Adds (ErrClosed), delivers everything buffered,
// stops the sender and returns nil when everything Add accepted was
// delivered. Otherwise it returns an *UndeliveredError listing the events
// not delivered that no Flush listed. When ctx ends first, Close stops the
// requests in flight and lists what was not delivered with it: the events
// of a request cut short may have been stored (posting them again is safe:
// they are then duplicates). Close called again returns ErrClosed.
func (c *Client) Close(ctx context.Context) error {
	c.mu.Lock()
	b := &c.buf
	if b.closing {
		c.mu.Unlock()
		return ErrClosed
	}
	b.closing = true
	b.signal() // Adds waiting for room return ErrClosed
	started := b.started
	c.mu.Unlock()
	defer c.abort()
	if !started {
		return nil
	}
	c.poke()
	var ctxErr error
	select {
	case <-c.done:
	case <-ctx.Done():
		ctxErr = ctx.Err()
		c.abort()
		<-c.done
	}
	c.mu.Lock()
	u := b.takeFailures(math.MaxUint64)
	c.mu.Unlock()
	if u == nil {
		return nil
	}
	u.Err = ctxErr
	return u
}

// closed reports whether Close was called.
func (c *Client) closed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf.closing
}

// poke wakes the sender without blocking.
func (c *Client) poke() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// run is the sender: it takes batches from the buffer as they become due
// and delivers them, one at a time, until Close and the buffer is empty.
func (c *Client) run() {
	defer close(c.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		c.mu.Lock()
		batch, wait, stop := c.buf.take(&c.cfg, c.cfg.now())
		c.mu.Unlock()
		if stop {
			return
		}
		if batch != nil {
			c.deliver(batch)
			continue
		}
		var due <-chan time.Time
		if wait > 0 {
			timer.Reset(wait)
			due = timer.C
		}
		select {
		case <-c.wake:
		case <-due:
		}
		timer.Stop()
	}
}

// deliver posts a batch with the retries of send. A 422 refused all of it:
// the events its problems name are set aside and the rest sent again (a
// new request: nothing of the refused one was stored). Whatever was not
// delivered is reported, and then the batch settled.
func (c *Client) deliver(batch []queued) {
	var failed []failure
	rest := batch
	for len(rest) > 0 {
		if c.sendCtx.Err() != nil {
			failed = append(failed, failures(rest, errAborted, nil)...)
			break
		}
		raws := make([][]byte, len(rest))
		for i, q := range rest {
			raws[i] = q.raw
		}
		_, err := c.send(c.sendCtx, body(raws))
		if err == nil {
			break
		}
		inv, isInvalid := err.(*InvalidError)
		var named map[int][]Problem
		if isInvalid {
			named = problemsByEvent(inv.Problems, 0, len(rest))
		}
		if len(named) == 0 {
			if c.sendCtx.Err() != nil {
				err = fmt.Errorf("client: Close's context ended while the batch was being sent; it may have been stored "+
					"(posting it again is safe): %w", err)
			}
			failed = append(failed, failures(rest, err, nil)...)
			break
		}
		var keep []queued
		for i, q := range rest {
			if ps, bad := named[i]; bad {
				failed = append(failed, failure{q.seq, Undelivered{Event: q.ev, Err: inv, Problems: ps}})
			} else {
				keep = append(keep, q)
			}
		}
		rest = keep
	}
	slices.SortFunc(failed, func(a, b failure) int { return cmp.Compare(a.seq, b.seq) })
	if len(failed) > 0 {
		c.report(failed)
	}
	c.settle(batch, failed)
}

// failures are the queued events, all undelivered for err.
func failures(qs []queued, err error, problems []Problem) []failure {
	out := make([]failure, len(qs))
	for i, q := range qs {
		out[i] = failure{q.seq, Undelivered{Event: q.ev, Err: err, Problems: problems}}
	}
	return out
}

// report hands a batch's undelivered events to the error handler, or logs
// their count and cause.
func (c *Client) report(failed []failure) {
	u := &UndeliveredError{Events: make([]Undelivered, len(failed))}
	for i, f := range failed {
		u.Events[i] = f.u
	}
	if c.cfg.onError != nil {
		c.cfg.onError(u)
		return
	}
	causes := u.causes()
	c.log.Error("tally client: usage not delivered", "events", len(failed), "cause", cause(causes[0]), "causes", len(causes))
}

// settle releases a delivered or reported batch's room in the buffer and
// keeps its failures for Flush and Close.
func (c *Client) settle(batch []queued, failed []failure) {
	c.mu.Lock()
	defer c.mu.Unlock()
	b := &c.buf
	for _, q := range batch {
		b.heldBytes -= len(q.raw)
	}
	b.heldEvents -= len(batch)
	b.settled = batch[len(batch)-1].seq
	for _, f := range failed {
		if len(b.failures) < c.cfg.bufferSize {
			b.failures = append(b.failures, f)
		} else {
			b.unlisted++
		}
	}
	b.signal()
}
