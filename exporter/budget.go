package exporter

import (
	"context"
	"net/http"
	"strings"

	"golang.org/x/time/rate"

	"github.com/tallymeter/tally/internal/stripeapi"
)

// Stripe's basic rate limit of an account — every API call but, in live
// mode on the account's own key, the meter-event endpoints, which have
// limits of their own — and Tally's defaults below it (docs/stripe.md).
const (
	// DefaultBasicLiveRate is Tally's share of Stripe's 100 operations a
	// second in live mode.
	DefaultBasicLiveRate = 90
	// DefaultBasicTestRate is Tally's share of Stripe's 25 operations a
	// second in test mode (a sandbox), which meter events and the stream
	// count toward too.
	DefaultBasicTestRate = 20
	// DefaultReadsLiveRate and DefaultReadsTestRate pace reconciliation's
	// reads (meters, event summaries): below Stripe's default of 25
	// requests a second per endpoint, and in test mode a quarter of the
	// basic budget, so that a run never starves export.
	DefaultReadsLiveRate = 20
	DefaultReadsTestRate = 5
	// DefaultOtherLiveRate and DefaultOtherTestRate pace every other call:
	// the account lookup, stream sessions, meter checks of a mapping
	// change, the events an error report's notification names.
	DefaultOtherLiveRate = 20
	DefaultOtherTestRate = 5
	// DefaultAdjustLiveRate and DefaultAdjustTestRate pace meter event
	// adjustments (cancellations), an endpoint of Stripe's default 25
	// requests a second that counts toward the basic limit in both modes:
	// below it live, and in test mode a quarter of the basic budget.
	DefaultAdjustLiveRate = 20
	DefaultAdjustTestRate = 5
)

// Rates are the request rates of a destination's budget, calls a second;
// a zero field takes its default for the key's mode.
type Rates struct {
	// Events paces v1 meter events (TALLY_RATE_LIVE / TALLY_RATE_TEST).
	// Defaults to DefaultLiveRate or DefaultTestRate.
	Events float64
	// Stream paces v2 stream events, a request of n events taking n
	// (TALLY_STREAM_RATE_LIVE / _TEST). Defaults to DefaultStreamLiveRate
	// or DefaultStreamTestRate.
	Stream float64
	// Basic is the share of Stripe's basic limit. Defaults to
	// DefaultBasicLiveRate or DefaultBasicTestRate.
	Basic float64
	// Reads paces reconciliation's reads. Defaults to DefaultReadsLiveRate
	// or DefaultReadsTestRate.
	Reads float64
	// Other paces every other call. Defaults to DefaultOtherLiveRate or
	// DefaultOtherTestRate.
	Other float64
	// Adjust paces meter event adjustments (TALLY_ADJUST_RATE_LIVE /
	// _TEST). Defaults to DefaultAdjustLiveRate or DefaultAdjustTestRate.
	Adjust float64
}

// Budget is every call Tally makes to one Stripe account, in classes that
// each have an adaptive limiter of their own — v1 meter events, v2 stream
// requests, meter event adjustments, reconciliation's reads, everything
// else — so that one class's 429s slow that class alone (a reconcile run or
// a bulk cancellation refused by Stripe never halves export's rate), and a
// shared bucket for Stripe's basic limit that every class counting toward
// it also takes from: in test mode every class, in live mode every class
// but the meter-event ones, unless the destination is a connected account
// (Connect calls count toward the basic limit). Only POST
// /v1/billing/meter_events (and the stream) has a live limit of its own;
// adjustments are an endpoint like any other.
type Budget struct {
	events, stream, adjust, reads, other *Limiter
	basic                                *rate.Limiter
}

// connect makes the meter-event classes take from the basic bucket too:
// the node exports to a connected account a tenant mapping names, and
// Connect meter events count toward the basic limit. Whose basic limit —
// the connected account's or the platform's — Stripe does not say
// (docs/stripe.md): Tally assumes the worst, one bucket for every
// account the platform's key calls. Idempotent.
func (b *Budget) connect() {
	b.events.shared.CompareAndSwap(nil, b.basic)
	b.stream.shared.CompareAndSwap(nil, b.basic)
}

// NewBudget makes the budget of a destination in mode; connected says the
// destination is a connected account (STRIPE_ACCOUNT is set).
func NewBudget(mode stripeapi.Mode, connected bool, r Rates) *Budget {
	live := mode == stripeapi.ModeLive
	pick := func(v, liveDefault, testDefault float64) float64 {
		switch {
		case v > 0:
			return v
		case live:
			return liveDefault
		}
		return testDefault
	}
	basic := newBucket(pick(r.Basic, DefaultBasicLiveRate, DefaultBasicTestRate))
	meterBasic := basic
	if live && !connected {
		meterBasic = nil // live meter events have limits of their own
	}
	return &Budget{
		events: newLimiter(pick(r.Events, DefaultLiveRate, DefaultTestRate), 1, meterBasic),
		stream: newLimiter(pick(r.Stream, DefaultStreamLiveRate, DefaultStreamTestRate), StreamMaxEvents, meterBasic),
		adjust: newLimiter(pick(r.Adjust, DefaultAdjustLiveRate, DefaultAdjustTestRate), 1, basic),
		reads:  newLimiter(pick(r.Reads, DefaultReadsLiveRate, DefaultReadsTestRate), 1, basic),
		other:  newLimiter(pick(r.Other, DefaultOtherLiveRate, DefaultOtherTestRate), 1, basic),
		basic:  basic,
	}
}

// Events paces v1 meter events; the v1 deliverer waits on it before each
// send.
func (b *Budget) Events() *Limiter { return b.events }

// Stream paces v2 stream events, and its requests in the shared bucket;
// the stream deliverer takes its slots before it claims.
func (b *Budget) Stream() *Limiter { return b.stream }

// Adjust paces meter event adjustments; their deliverer takes its slots
// before it claims, and a probe of an earlier attempt's key waits for one.
func (b *Budget) Adjust() *Limiter { return b.adjust }

// Reads paces reconciliation's reads.
func (b *Budget) Reads() *Limiter { return b.reads }

// Other paces every other call made with the destination's client.
func (b *Budget) Other() *Limiter { return b.other }

// pace is the client's hook for calls no deliverer paced: every call but v1
// meter events, stream requests and meter event adjustments (paced by
// their deliverers before their items are claimed, and an adjustment's
// probes by its exporter: a wait here, after the claim, would be taken
// from the request's timeout and turn a queue into failed attempts) waits
// for a slot of the Other class.
func (b *Budget) pace(ctx context.Context, method, path string) error {
	if method == http.MethodPost && (path == stripeapi.MeterEventsPath || path == stripeapi.AdjustmentsPath ||
		strings.HasSuffix(path, stripeapi.StreamPath)) {
		return nil
	}
	return b.other.Wait(ctx)
}

// newBucket is a plain token bucket of perSecond with a burst of a tenth of
// a second's worth (at least one).
func newBucket(perSecond float64) *rate.Limiter {
	return rate.NewLimiter(rate.Limit(perSecond), max(1, int(perSecond/10)))
}
