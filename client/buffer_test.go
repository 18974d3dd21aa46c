package client_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/client"
)

// handled collects what an error handler was given.
type handled struct {
	mu    sync.Mutex
	calls []*client.UndeliveredError
}

func (h *handled) handle(u *client.UndeliveredError) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls = append(h.calls, u)
}

func (h *handled) events() []client.Undelivered {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []client.Undelivered
	for _, u := range h.calls {
		out = append(out, u.Events...)
	}
	return out
}

// eventsOf are the events of a report.
func eventsOf(us []client.Undelivered) []client.Event {
	out := make([]client.Event, len(us))
	for i, u := range us {
		out[i] = u.Event
	}
	return out
}

// addAll adds events, failing the test on an error.
func addAll(t *testing.T, c *client.Client, evs ...client.Event) {
	t.Helper()
	for _, ev := range evs {
		require.NoError(t, c.Add(context.Background(), ev))
	}
}

// TestAddReportsInvalidEventsAndSendsTheRest adds a batch a real Tally
// refuses for two of its events — an invalid tenant, an id stored before
// with other content: the client sets them aside, reports them to the
// error handler and to Flush with the server's problems, and sends the
// others, which are stored once.
func TestAddReportsInvalidEventsAndSendsTheRest(t *testing.T) {
	t.Parallel()
	tl := newTally(t)
	p := newProxy(t, tl.url, forward)
	h := &handled{}
	c := tl.client(p.url, client.WithErrorHandler(h.handle), client.WithFlushInterval(time.Hour))
	ctx := context.Background()
	stored := client.Event{ID: "dup", Tenant: "acme", Feature: "api_calls", Value: 1, Timestamp: time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC)}
	_, err := c.Post(ctx, stored)
	require.NoError(t, err)

	evs := events("a", 5)
	evs[1] = stored
	evs[1].Value = 9 // changed content
	evs[2].Tenant = "not a tenant"
	addAll(t, c, evs...)
	err = c.Flush(ctx)

	var u *client.UndeliveredError
	require.ErrorAs(t, err, &u)
	require.Len(t, u.Events, 2, "%v", err)
	require.Equal(t, evs[1], u.Events[0].Event, "in the order they were added")
	stampedTenant := evs[2]
	stampedTenant.Timestamp = u.Events[1].Event.Timestamp
	require.Equal(t, stampedTenant, u.Events[1].Event, "as sent: with the time of its Add")
	require.False(t, stampedTenant.Timestamp.IsZero())
	require.Len(t, u.Events[0].Problems, 1)
	require.Equal(t, "id", u.Events[0].Problems[0].Field)
	require.Contains(t, u.Events[0].Problems[0].Reason, "stored before with different content")
	require.Len(t, u.Events[1].Problems, 1)
	require.Equal(t, "tenant", u.Events[1].Problems[0].Field)
	for _, ud := range u.Events {
		var inv *client.InvalidError
		require.ErrorAs(t, ud.Err, &inv)
		require.Equal(t, "invalid_batch", inv.Code)
	}
	require.Equal(t, 1+3, p.requests(), "the Post; then the batch, twice refused, and its rest")
	require.Equal(t, u.Events, h.events(), "the error handler had them first")

	got := tl.ledger()
	require.Len(t, got, 4)
	require.Equal(t, int64(1), got["acme/dup"].Value, "the stored event is unchanged")
	for _, i := range []int{0, 3, 4} {
		r, ok := got["acme/"+evs[i].ID]
		require.True(t, ok, evs[i].ID)
		require.True(t, r.Given, "Add stamped it")
	}
	require.NoError(t, c.Flush(ctx), "what one Flush listed the next does not")
	require.NoError(t, c.Close(ctx))
}

// TestAddReportsABatchRefusedWhole adds a batch a real Tally refuses with
// problems that name no event (its quarantine cap): every event of it is
// reported, none stored.
func TestAddReportsABatchRefusedWhole(t *testing.T) {
	t.Parallel()
	tl := newTally(t, "TALLY_INGEST_MAX_QUARANTINED=2")
	logs := &logSink{}
	c := tl.client(tl.url, client.WithLogger(logs.logger()), client.WithFlushInterval(time.Hour))
	evs := events("q", 3) // a feature without a mapping: each would be a quarantined item
	addAll(t, c, evs...)
	err := c.Close(context.Background())
	var (
		u   *client.UndeliveredError
		inv *client.InvalidError
	)
	require.ErrorAs(t, err, &u)
	require.ErrorAs(t, err, &inv)
	require.Equal(t, "too_many_quarantined", inv.Code)
	require.Nil(t, inv.Problems[0].Index)
	require.Len(t, u.Events, 3)
	for i, ud := range u.Events {
		require.Equal(t, evs[i].ID, ud.Event.ID)
		require.Empty(t, ud.Problems)
	}
	reported := logs.lines("usage not delivered")
	require.Len(t, reported, 1, "without an error handler, the client logs what it could not deliver")
	require.Contains(t, reported[0], "level=ERROR")
	require.Contains(t, reported[0], "events=3")
	require.Contains(t, reported[0], `cause="422 too_many_quarantined"`)
	require.NotContains(t, logs.String(), "q-1", "the log names no event")
	require.NotContains(t, logs.String(), tl.token)
	require.Empty(t, tl.ledger())
}

// TestFlushWhoseContextEndsCountsWhatIsStillBuffered holds a batch at a
// proxy: a Flush whose context ends says how many events are still
// buffered; they are delivered all the same, and a later Flush sees them
// through.
func TestFlushWhoseContextEndsCountsWhatIsStillBuffered(t *testing.T) {
	t.Parallel()
	tl := newTally(t)
	release := make(chan struct{})
	p := newProxy(t, tl.url, func(n int) action { return action{hold: release} })
	c := tl.client(p.url, client.WithBatchSize(2))
	evs := events("p", 3)
	addAll(t, c, evs...)
	shortly, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := c.Flush(shortly)
	var u *client.UndeliveredError
	require.ErrorAs(t, err, &u)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Empty(t, u.Events, "nothing has failed…")
	require.Equal(t, 3, u.Pending, "…three events are still on their way")
	require.Equal(t, "client: 3 events still buffered: context deadline exceeded", err.Error())
	require.Empty(t, tl.ledger())

	close(release)
	require.NoError(t, c.Flush(context.Background()))
	tl.requireStored(evs...)
	require.NoError(t, c.Close(context.Background()))
}

// TestAddBlocksWhileTheBufferIsFull holds the first batch at a proxy: the
// buffer fills — by its events or by its bytes — and Add waits, until its
// context ends (the event is not added) or room is made when the batch is
// answered.
func TestAddBlocksWhileTheBufferIsFull(t *testing.T) {
	t.Parallel()
	evs := stamped("bp", 6) // every event encodes to the same size
	size := len(encoded(t, evs[0]))
	cases := []struct {
		name  string
		opts  []client.Option
		holds int // events the buffer takes while the first batch is held
	}{
		{"events", []client.Option{client.WithBatchSize(2), client.WithBufferSize(4)}, 4},
		{"bytes", []client.Option{client.WithBatchBytes(size + len(`{"events":[]}`)), client.WithBufferBytes(2*size + 1)}, 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tl := newTally(t)
			release := make(chan struct{})
			p := newProxy(t, tl.url, func(n int) action {
				if n == 1 {
					return action{hold: release}
				}
				return action{}
			})
			c := tl.client(p.url, append(tc.opts, client.WithFlushInterval(time.Millisecond))...)
			addAll(t, c, evs[:tc.holds]...)
			require.Eventually(t, func() bool { return p.requests() == 1 }, 5*time.Second, time.Millisecond, "the first batch is held")

			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			err := c.Add(ctx, evs[tc.holds])
			cancel()
			require.ErrorIs(t, err, context.DeadlineExceeded, "the buffer is full: Add waited, then gave up")
			require.Contains(t, err.Error(), "not added")

			var added atomic.Bool
			go func() {
				if c.Add(context.Background(), evs[5]) == nil {
					added.Store(true)
				}
			}()
			require.Never(t, added.Load, 100*time.Millisecond, 5*time.Millisecond, "Add blocks while the buffer is full")
			close(release)
			require.Eventually(t, added.Load, 5*time.Second, time.Millisecond, "room was made: Add returns")
			require.NoError(t, c.Close(context.Background()))
			tl.requireStored(append(slices.Clone(evs[:tc.holds]), evs[5])...)
		})
	}
}

// stamped are n events like events', of value 1 and one timestamp, so
// that those of one prefix encode to the same size.
func stamped(prefix string, n int) []client.Event {
	evs := events(prefix, n)
	for i := range evs {
		evs[i].Value, evs[i].Timestamp = 1, time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	}
	return evs
}

// encoded is an event as the API documents it on the wire.
func encoded(t *testing.T, ev client.Event) []byte {
	t.Helper()
	b, err := json.Marshal(map[string]any{"id": ev.ID, "tenant": ev.Tenant, "feature": ev.Feature, "value": ev.Value,
		"timestamp": ev.Timestamp.UTC().Format(time.RFC3339Nano)})
	require.NoError(t, err)
	return b
}

// TestAddBatchesByCountBytesAndTime sends a batch when it holds its
// events, when the next event would pass its bytes, or when its first
// event waited the flush interval — without a Flush.
func TestAddBatchesByCountBytesAndTime(t *testing.T) {
	t.Parallel()
	t.Run("count", func(t *testing.T) {
		t.Parallel()
		tl := newTally(t)
		p := newProxy(t, tl.url, forward)
		c := tl.client(p.url, client.WithBatchSize(3), client.WithFlushInterval(time.Hour))
		evs := stamped("c", 7)
		addAll(t, c, evs...)
		require.Eventually(t, func() bool { return len(tl.ledger()) == 6 }, 5*time.Second, 5*time.Millisecond, "two full batches sent")
		require.Equal(t, 2, p.requests())
		require.NoError(t, c.Close(context.Background()))
		require.Equal(t, 3, p.requests(), "Close sent the rest")
		tl.requireStored(evs...)
	})
	t.Run("bytes", func(t *testing.T) {
		t.Parallel()
		tl := newTally(t)
		p := newProxy(t, tl.url, forward)
		evs := stamped("b", 5)
		twoEvents := len(`{"events":[`) + 2*len(encoded(t, evs[0])) + 1 + len(`]}`)
		c := tl.client(p.url, client.WithBatchBytes(twoEvents), client.WithFlushInterval(time.Hour))
		addAll(t, c, evs...)
		require.Eventually(t, func() bool { return len(tl.ledger()) == 4 }, 5*time.Second, 5*time.Millisecond, "two batches of two sent")
		require.Equal(t, 2, p.requests())
		require.Len(t, p.body(1), twoEvents)
		require.NoError(t, c.Flush(context.Background()))
		require.Equal(t, 3, p.requests())
		tl.requireStored(evs...)
		require.NoError(t, c.Close(context.Background()))
	})
	t.Run("time", func(t *testing.T) {
		t.Parallel()
		tl := newTally(t)
		c := tl.client(tl.url, client.WithFlushInterval(20*time.Millisecond))
		evs := stamped("t", 1)
		addAll(t, c, evs...)
		require.Eventually(t, func() bool { return len(tl.ledger()) == 1 }, 5*time.Second, 5*time.Millisecond, "sent after the interval")
		tl.requireStored(evs...)
		require.NoError(t, c.Close(context.Background()))
	})
}

// TestAddRetryAfterALostReplyIsADuplicate loses the reply of a batch the
// real Tally stored: the retry sends the same body, with the timestamps Add
// gave the events, and Tally answers duplicates — not a 422 for changed
// content. Each event is stored once, at the time of its Add.
func TestAddRetryAfterALostReplyIsADuplicate(t *testing.T) {
	t.Parallel()
	tl := newTally(t)
	p := newProxy(t, tl.url, func(n int) action { return action{loseReply: n == 1} })
	c := tl.client(p.url, client.WithFlushInterval(time.Hour))
	evs := events("l", 3)
	before := time.Now().Truncate(time.Microsecond)
	addAll(t, c, evs...)
	after := time.Now()
	require.NoError(t, c.Flush(context.Background()))
	require.Equal(t, 2, p.requests())
	require.Equal(t, p.body(1), p.body(2), "the retry is the same body")

	got := tl.ledger()
	require.Len(t, got, 3)
	for _, ev := range evs {
		r := got["acme/"+ev.ID]
		require.Equal(t, ev.Value, r.Value)
		require.True(t, r.Given, "%s: Add stamped the event", ev.ID)
		require.False(t, r.OccurredAt.Before(before) || r.OccurredAt.After(after), "%s stored at the time of its Add: %s", ev.ID, r.OccurredAt)
	}
	require.NoError(t, c.Close(context.Background()))
}

// TestFlushAndCloseSayWhatWasNotDelivered: a Flush whose batch's retries
// ran out lists its events and why, and the same events added again are
// stored with the timestamps they were first given; a Close whose context
// ends while a batch is in flight lists every event not delivered; after
// Close, everything refuses.
func TestFlushAndCloseSayWhatWasNotDelivered(t *testing.T) {
	t.Parallel()
	tl := newTally(t)
	p := newProxy(t, tl.url, func(int) action { return action{status: http.StatusServiceUnavailable} })
	h := &handled{}
	c := tl.client(p.url, client.WithRetryBudget(100*time.Millisecond), client.WithErrorHandler(h.handle))
	ctx := context.Background()
	evs := events("f", 3)
	addAll(t, c, evs...)
	err := c.Flush(ctx)
	var (
		u      *client.UndeliveredError
		status *client.StatusError
	)
	require.ErrorAs(t, err, &u)
	require.ErrorIs(t, err, client.ErrRetryBudgetSpent)
	require.ErrorAs(t, err, &status)
	require.Equal(t, http.StatusServiceUnavailable, status.StatusCode)
	require.Contains(t, err.Error(), "3 events not delivered")
	require.Len(t, u.Events, 3)
	for i, ud := range u.Events {
		require.Equal(t, evs[i].ID, ud.Event.ID)
		require.False(t, ud.Event.Timestamp.IsZero(), "reported as sent: with the time of the Add")
	}
	require.Equal(t, u.Events, h.events())
	require.Empty(t, tl.ledger())

	p.setPlan(forward)
	addAll(t, c, eventsOf(u.Events)...)
	require.NoError(t, c.Flush(ctx))
	tl.requireStored(eventsOf(u.Events)...)

	// Close while a batch is held at the proxy and more wait behind it.
	held := make(chan struct{})
	t.Cleanup(func() { close(held) })
	p.setPlan(func(int) action { return action{hold: held} })
	more := events("g", 4)
	c2 := tl.client(p.url, client.WithBatchSize(2), client.WithFlushInterval(time.Millisecond))
	addAll(t, c2, more...)
	shortly, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	err = c2.Close(shortly)
	require.ErrorAs(t, err, &u)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Len(t, u.Events, 4, "%v", err)
	for i, ud := range u.Events {
		require.Equal(t, more[i].ID, ud.Event.ID)
	}
	require.Contains(t, u.Events[0].Err.Error(), "may have been stored", "the batch in flight")
	require.Contains(t, u.Events[3].Err.Error(), "not sent", "the batch behind it")

	require.ErrorIs(t, c2.Add(ctx, more[0]), client.ErrClosed)
	require.ErrorIs(t, c2.Flush(ctx), client.ErrClosed)
	require.ErrorIs(t, c2.Close(ctx), client.ErrClosed)
	_, err = c2.Post(ctx, more[0])
	require.ErrorIs(t, err, client.ErrClosed)

	// What Close listed is posted again, directly, and stored once.
	direct := tl.client(tl.url)
	_, err = direct.Post(ctx, eventsOf(u.Events)...)
	require.NoError(t, err)
	tl.requireStored(append(eventsOf(h.events()), eventsOf(u.Events)...)...)
	require.NoError(t, c.Close(ctx))
}

// TestConcurrentAddsAreStoredOnce adds from several goroutines through a
// proxy that loses replies and answers 503 now and then: once closed,
// every event is stored exactly once.
func TestConcurrentAddsAreStoredOnce(t *testing.T) {
	t.Parallel()
	tl := newTally(t)
	p := newProxy(t, tl.url, func(n int) action {
		switch {
		case n%5 == 0:
			return action{loseReply: true}
		case n%7 == 0:
			return action{status: http.StatusServiceUnavailable, retryAfter: "0"}
		}
		return action{}
	})
	c := tl.client(p.url, client.WithBatchSize(40), client.WithBufferSize(100), client.WithFlushInterval(2*time.Millisecond))
	const writers, each = 8, 150
	var (
		wg  sync.WaitGroup
		all = make([][]client.Event, writers)
	)
	for w := range writers {
		all[w] = events(fmt.Sprintf("w%d", w), each)
		wg.Go(func() {
			for _, ev := range all[w] {
				if err := c.Add(context.Background(), ev); err != nil {
					t.Errorf("add: %v", err)
					return
				}
			}
		})
	}
	wg.Wait()
	require.NoError(t, c.Close(context.Background()))
	var want []client.Event
	for _, evs := range all {
		want = append(want, evs...)
	}
	tl.requireStored(want...)
	require.Greater(t, p.requests(), writers*each/40, "faults made retries")
}
