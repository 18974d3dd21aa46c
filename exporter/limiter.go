package exporter

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
)

// Default rates of a destination's v1 meter events, below Stripe's limits
// (1,000 calls/s live; test mode counts toward the basic 25/s).
const (
	DefaultLiveRate = 900
	DefaultTestRate = 20
)

// Limiter is a destination's token bucket, adaptive: a 429 halves its rate
// (down to a floor of one call a second), and every success gives back a
// two-hundredth of the configured rate, so that it recovers gradually rather
// than straight back into the limit.
//
// A rate halves once per congestion signal, not once per 429: the answers to
// calls sent before the last halving were paced by the old rate and say
// nothing about the new one, so their 429s do not halve it again. Without
// that, the in-flight calls of one burst would each halve it and a single
// overload would drive it to the floor.
//
// A limiter of a Budget also takes every request from a bucket it shares
// with the account's other classes (Stripe's basic limit, which counts
// requests), which is not adaptive: a 429 slows the class whose call it
// answered, never the others.
//
// A limiter counts units: calls, or for the v2 stream events, of which one
// request carries up to perRequest (Stripe's pages give the stream's limit
// both as requests and as events a second: Tally reads events, the safer).
// A request takes its units from the class and one slot from the shared
// bucket.
type Limiter struct {
	mu  sync.Mutex
	lim *rate.Limiter
	// shared is the account's basic limit; nil when the class has none.
	// A live meter-event class gains it once the node exports to a
	// connected account (Budget.connect).
	shared atomic.Pointer[rate.Limiter]
	// perRequest is the most units one request carries: 1, or for the
	// stream StreamMaxEvents.
	perRequest int
	max        rate.Limit
	cur        rate.Limit
	lastSlow   time.Time
}

// NewLimiter makes a limiter of perSecond calls, with a burst of a tenth of
// a second's worth (at least one), that shares no bucket.
func NewLimiter(perSecond float64) *Limiter { return newLimiter(perSecond, 1, nil) }

// NewStreamLimiter makes a limiter of perSecond stream events, of which a
// request carries up to StreamMaxEvents, with a burst of a tenth of a
// second's worth (at least a full request's), that shares no bucket.
func NewStreamLimiter(perSecond float64) *Limiter {
	return newLimiter(perSecond, StreamMaxEvents, nil)
}

// newLimiter is a limiter of perSecond units, perRequest of which one
// request carries at most, taking a slot of shared (nil: none) per request.
func newLimiter(perSecond float64, perRequest int, shared *rate.Limiter) *Limiter {
	lim := newBucket(perSecond)
	lim.SetBurst(max(lim.Burst(), perRequest))
	l := &Limiter{lim: lim, perRequest: perRequest, max: rate.Limit(perSecond), cur: rate.Limit(perSecond)}
	l.shared.Store(shared)
	return l
}

// requests is how many requests carry units.
func (l *Limiter) requests(units int) int { return (units + l.perRequest - 1) / l.perRequest }

// Wait blocks until a call of one unit may go out — a slot of the class
// and, when it has one, of the shared bucket — or ctx ends.
func (l *Limiter) Wait(ctx context.Context) error { return l.WaitN(ctx, 1) }

// WaitN blocks until one request carrying units may go out — that many of
// the class (at most its burst) and, when it has one, a slot of the shared
// bucket — or ctx ends. With units 0 it waits for the shared slot alone: a
// request whose units were taken before (Take) but not its own slot.
func (l *Limiter) WaitN(ctx context.Context, units int) error {
	if units > 0 {
		if err := l.lim.WaitN(ctx, min(units, l.lim.Burst())); err != nil {
			return err
		}
	}
	if shared := l.shared.Load(); shared != nil {
		return shared.Wait(ctx)
	}
	return nil
}

// Take waits until at least one request's worth may go out (one call, or
// up to a full stream request of events), then takes up to n units: as many
// as the bucket (and the shared bucket, a slot per request) hold now, never
// more than their bursts. It returns how many units it took, and the
// shared bucket's slots it took are those of the fewest requests that
// carry them. A deliverer takes its requests' slots before it claims the
// items they will carry, so that leased items never queue at the limiter;
// it never waits for more than a request's worth, so that a slowed rate
// delays the first item by one request's time, not by n's, and a stream
// request still goes out full.
func (l *Limiter) Take(ctx context.Context, n int) (int, error) {
	now := time.Now()
	shared := l.shared.Load()
	avail := l.lim.TokensAt(now)
	n = min(n, l.lim.Burst())
	if shared != nil {
		n = min(n, shared.Burst()*l.perRequest)
		avail = min(avail, shared.TokensAt(now)*float64(l.perRequest))
	}
	n = max(1, min(n, l.perRequest), min(n, int(avail)))
	if err := l.lim.WaitN(ctx, n); err != nil {
		return 0, err
	}
	if shared != nil {
		if err := shared.WaitN(ctx, l.requests(n)); err != nil {
			return 0, err
		}
	}
	return n, nil
}

// Slow halves the rate after a 429 to a call that went out at sent, unless
// that call went out before the last halving. It never goes below one
// request a second: perRequest units (for the stream, a full request of
// events, which would otherwise wait longer than its lease).
func (l *Limiter) Slow(sent time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if sent.Before(l.lastSlow) {
		return
	}
	l.lastSlow = time.Now()
	l.cur = max(l.cur/2, min(l.max, rate.Limit(l.perRequest)))
	l.lim.SetLimit(l.cur)
}

// Ok raises the rate a step toward the configured one after a success.
func (l *Limiter) Ok() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cur >= l.max {
		return
	}
	l.cur = min(l.max, l.cur+l.max/200)
	l.lim.SetLimit(l.cur)
}

// Rate is the current rate in units a second: calls, or stream events.
func (l *Limiter) Rate() float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return float64(l.cur)
}
