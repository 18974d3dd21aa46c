package exporter

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
)

// soon is a context that lets a limiter wait at most a few milliseconds:
// rate.Limiter refuses at once a wait that would pass its deadline.
func soon(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	t.Cleanup(cancel)
	return ctx
}

// One budget per account (docs/stripe.md, "Rate limits"): in test mode
// every call counts toward Stripe's basic limit of 25 operations a second,
// meter events and the stream included; in live mode meter events and the
// stream have limits of their own, unless the destination is a connected
// account, whose calls count toward the basic limit. Adjustments count
// toward it in every mode: only POST /v1/billing/meter_events has a live
// limit of its own.
func TestBudgetSharesTheBasicLimit(t *testing.T) {
	t.Parallel()
	tiny := Rates{Events: 100, Stream: 100, Adjust: 100, Reads: 100, Other: 100, Basic: 1} // a burst of one basic call
	for _, tc := range []struct {
		name          string
		mode          stripeapi.Mode
		connected     bool
		eventsShareIt bool
	}{
		{"test mode: everything shares the basic limit", stripeapi.ModeTest, false, true},
		{"live mode: meter events have limits of their own", stripeapi.ModeLive, false, false},
		{"live mode, connected account: meter events count toward the basic limit", stripeapi.ModeLive, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := NewBudget(tc.mode, tc.connected, tiny)
			require.NoError(t, b.Reads().Wait(soon(t)), "the one basic slot")
			require.Error(t, b.Other().Wait(soon(t)), "reads and other calls always share the basic limit")
			require.Error(t, b.Adjust().Wait(soon(t)), "so do adjustments")
			err := b.Events().Wait(soon(t))
			_, serr := b.Stream().Take(soon(t), 1)
			if tc.eventsShareIt {
				require.Error(t, err)
				require.Error(t, serr)
			} else {
				require.NoError(t, err)
				require.NoError(t, serr)
			}
		})
	}
}

// A 429 slows the class whose call it answered, and no other: a reconcile
// run that Stripe rate-limits never halves export's rate.
func TestBudgetClassesSlowAlone(t *testing.T) {
	t.Parallel()
	b := NewBudget(stripeapi.ModeLive, false, Rates{})
	events, stream, other := b.Events().Rate(), b.Stream().Rate(), b.Other().Rate()
	reads, adjust := b.Reads().Rate(), b.Adjust().Rate()
	b.Reads().Slow(time.Now())
	require.Equal(t, reads/2, b.Reads().Rate())
	require.Equal(t, events, b.Events().Rate())
	require.Equal(t, stream, b.Stream().Rate())
	require.Equal(t, other, b.Other().Rate())
	require.Equal(t, adjust, b.Adjust().Rate())
	// A bulk cancellation refused by Stripe slows adjustments alone.
	b.Adjust().Slow(time.Now())
	require.Equal(t, adjust/2, b.Adjust().Rate())
	require.Equal(t, events, b.Events().Rate(), "never meter events")
	require.Equal(t, float64(DefaultLiveRate), events)
	require.Equal(t, float64(DefaultReadsLiveRate), reads, "below Stripe's 25 requests a second per endpoint")
	require.Equal(t, float64(DefaultAdjustLiveRate), adjust, "below Stripe's 25 requests a second per endpoint")
	require.Equal(t, float64(DefaultStreamLiveRate), stream, "below 10,000 events a second")

	test := NewBudget(stripeapi.ModeTest, false, Rates{})
	require.Equal(t, float64(DefaultTestRate), test.Events().Rate())
	require.Equal(t, float64(DefaultReadsTestRate), test.Reads().Rate())
	require.Equal(t, float64(DefaultAdjustTestRate), test.Adjust().Rate())
}

// The stream's class counts events, a request of n events taking n, and
// the shared basic bucket counts its requests: a take of 250 events takes
// the slots of three requests; a request of 40 events waits for 40.
func TestStreamClassCountsEvents(t *testing.T) {
	t.Parallel()
	b := NewBudget(stripeapi.ModeTest, false, Rates{Stream: 1000, Basic: 10}) // bursts of 100 events and 1 request
	n, err := b.Stream().Take(soon(t), 250)
	require.NoError(t, err)
	require.Equal(t, 100, n, "the class's burst: a tenth of a second's events, at least a full request")
	require.Error(t, b.Other().Wait(soon(t)), "the basic bucket gave its one slot for them: one request")

	l := NewStreamLimiter(4000) // a burst of 400 events
	n, err = l.Take(soon(t), 250)
	require.NoError(t, err)
	require.Equal(t, 250, n)
	n, err = l.Take(soon(t), 250)
	require.NoError(t, err)
	require.Equal(t, 150, n, "what is left")
	// An empty bucket: the take waits for a full request's events, not one.
	start := time.Now()
	n, err = l.Take(context.Background(), 250)
	require.NoError(t, err)
	require.Equal(t, StreamMaxEvents, n)
	require.GreaterOrEqual(t, time.Since(start), 15*time.Millisecond, "100 events at 4,000 a second")
	require.Equal(t, 3, l.requests(250))

	// 429s slow the stream to a request a second at the least: a full
	// request of events, never one event a second.
	for range 20 {
		l.Slow(time.Now())
	}
	require.Equal(t, float64(StreamMaxEvents), l.Rate(), "the floor is one request's events")
}

// The client's pace hook waits for the Other class for every call no
// deliverer paced, and lets v1 meter events, adjustments and stream
// requests through (their deliverers took their slots before claiming).
func TestBudgetPacesEveryOtherCall(t *testing.T) {
	t.Parallel()
	b := NewBudget(stripeapi.ModeTest, false, Rates{Other: 1, Basic: 100})
	require.NoError(t, b.pace(soon(t), http.MethodGet, "/v1/account"))
	require.Error(t, b.pace(soon(t), http.MethodPost, "/v2/billing/meter_event_session"), "the one Other slot is gone")
	require.NoError(t, b.pace(soon(t), http.MethodPost, "/v1/billing/meter_events"))
	require.NoError(t, b.pace(soon(t), http.MethodPost, stripeapi.StreamPath))
	require.NoError(t, b.pace(soon(t), http.MethodPost, stripeapi.AdjustmentsPath), "adjustments are paced by their deliverer, before the claim")
	require.Error(t, b.pace(soon(t), http.MethodGet, "/v2/core/events/evt_1"))
}

// Take takes what the bucket holds now, up to n, and waits for one slot
// only when it holds none: a slowed rate delays a claim by one slot's
// time, not by n slots'.
func TestLimiterTakeWaitsForOneOnly(t *testing.T) {
	t.Parallel()
	l := NewLimiter(100) // a burst of 10
	n, err := l.Take(soon(t), 50)
	require.NoError(t, err)
	require.Equal(t, 10, n, "the whole burst, not the 50 asked for")
	n, err = l.Take(soon(t), 50)
	require.NoError(t, err)
	require.Equal(t, 1, n, "an empty bucket: one slot, the first to come")

	for range 10 {
		l.Slow(time.Now())
	}
	require.Equal(t, 1.0, l.Rate(), "the floor")
	// Empty the bucket first: the tokens it gathered at 100 a second
	// before the slowdown (a loaded machine takes tens of milliseconds
	// between the lines above) are not what this measures.
	_, err = l.Take(context.Background(), 50)
	require.NoError(t, err)
	start := time.Now()
	n, err = l.Take(context.Background(), 5)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Less(t, time.Since(start), 4*time.Second, "one slot at one a second, not five")
}
