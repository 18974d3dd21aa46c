package api

import (
	"net/http/httptest"
	"testing"
	"time"

	must "github.com/stretchr/testify/require"
)

// quotasAt are quotas q on a clock the test moves.
func quotasAt(q IngestQuota) (*quotas, *time.Time) {
	now := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	qs := newQuotas(q)
	qs.now = func() time.Time { return now }
	return qs, &now
}

func TestQuotaWaitIsTheLimitersReservation(t *testing.T) {
	t.Parallel()
	q, now := quotasAt(IngestQuota{EventsPerSecond: 100, EventsBurst: 1000, RequestsPerSecond: 2})
	_, ok, _ := q.admitEvents(1, 1000)
	must.True(t, ok)
	wait, ok, possible := q.admitEvents(1, 250)
	must.False(t, ok)
	must.True(t, possible)
	must.Equal(t, 2500*time.Millisecond, wait, "250 events at 100 a second")
	*now = now.Add(2500 * time.Millisecond)
	_, ok, _ = q.admitEvents(1, 250)
	must.True(t, ok, "the refused reservation was given back")

	_, _, possible = q.admitEvents(1, 1001)
	must.False(t, possible, "over the burst")

	// Requests: a burst of one second's worth (2).
	for range 2 {
		_, ok := q.admitRequest(7)
		must.True(t, ok)
	}
	wait, ok = q.admitRequest(7)
	must.False(t, ok)
	must.Equal(t, 500*time.Millisecond, wait)

	rec := httptest.NewRecorder()
	writeThrottled(rec, wait, "slow down")
	must.Equal(t, "1", rec.Header().Get("Retry-After"), "whole seconds, at least 1")
	rec = httptest.NewRecorder()
	writeThrottled(rec, 2500*time.Millisecond, "slow down")
	must.Equal(t, "3", rec.Header().Get("Retry-After"), "rounded up")
}

func TestQuotaZeroIsUnlimited(t *testing.T) {
	t.Parallel()
	q, _ := quotasAt(IngestQuota{})
	for range 1000 {
		_, ok := q.admitRequest(1)
		must.True(t, ok)
		_, ok, _ = q.admitEvents(1, 10_000)
		must.True(t, ok)
	}
	must.Empty(t, q.byToken, "no limiter is kept without a limit")
}

// Memory stays bounded however many tokens post: idle tokens' limiters go
// first, and a busy token keeps its state through the sweep.
func TestQuotaTokensBounded(t *testing.T) {
	t.Parallel()
	q, now := quotasAt(IngestQuota{EventsPerSecond: 0.001, EventsBurst: 10, RequestsPerSecond: 1})
	_, ok, _ := q.admitEvents(1, 10) // token 1 spends its events for hours
	must.True(t, ok)
	for id := int64(2); id < 2+3*maxQuotaTokens; id++ {
		if id%maxQuotaTokens == 0 {
			*now = now.Add(2 * time.Second) // the others' requests budgets refill: idle
		}
		_, ok := q.admitRequest(id)
		must.True(t, ok)
		must.LessOrEqual(t, len(q.byToken), maxQuotaTokens)
	}
	_, ok, _ = q.admitEvents(1, 1)
	must.False(t, ok, "a busy token is not forgotten while idle ones can go")
}

// A rate without a burst takes a full batch at once.
func TestQuotaBurstDefaultsToABatch(t *testing.T) {
	t.Parallel()
	q, _ := quotasAt(IngestQuota{EventsPerSecond: 1, MaxEvents: 50})
	_, ok, _ := q.admitEvents(1, 50)
	must.True(t, ok)
	_, ok, possible := q.admitEvents(1, 1)
	must.False(t, ok)
	must.True(t, possible)
}

// A batch refused after its events were admitted (invalid, over the
// quarantine cap, a failed transaction) gives them back: nothing stored
// costs nothing.
func TestQuotaRefundGivesTheEventsBack(t *testing.T) {
	t.Parallel()
	q, _ := quotasAt(IngestQuota{EventsPerSecond: 0.001, EventsBurst: 100})
	_, ok, _, refund := q.takeEvents(1, 100)
	must.True(t, ok)
	_, ok, _ = q.admitEvents(1, 1)
	must.False(t, ok, "the burst is spent")
	refund()
	_, ok, _, _ = q.takeEvents(1, 100)
	must.True(t, ok, "the refused batch's events are back")
}
