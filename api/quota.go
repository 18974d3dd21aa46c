package api

import (
	"cmp"
	"math"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/meter"
)

// IngestQuota bounds what one token may post to POST /v1/usage on one
// node. The limits are per node: across a cluster a token may post the
// number of nodes times as much.
type IngestQuota struct {
	// EventsPerSecond is the usage events a second one token may post
	// (TALLY_INGEST_EVENTS_PER_SECOND); 0 means no limit, the zero
	// value's. serve's default is DefaultIngestEventsPerSecond.
	EventsPerSecond float64
	// EventsBurst is how many events one token may post at once above
	// that rate (TALLY_INGEST_EVENTS_BURST): at least MaxEvents, or a
	// full batch could never pass (it is answered 413). Defaults to
	// MaxEvents; serve's default is DefaultIngestEventsBurst.
	EventsBurst int
	// RequestsPerSecond is the POST /v1/usage requests a second one token
	// may make (TALLY_INGEST_REQUESTS_PER_SECOND), with a burst of one
	// second's worth; 0 means no limit, the zero value's. serve's default
	// is DefaultIngestRequestsPerSecond.
	RequestsPerSecond float64
	// MaxEvents is the most events one request may carry
	// (TALLY_INGEST_MAX_EVENTS), 1 to meter.MaxEvents. Defaults to
	// meter.MaxEvents.
	MaxEvents int
}

// serve's defaults of IngestQuota: generous for one busy client, finite
// for a runaway or hostile one.
const (
	// DefaultIngestEventsPerSecond is 10,000 events a second a token.
	DefaultIngestEventsPerSecond = 10_000
	// DefaultIngestEventsBurst is ten full batches.
	DefaultIngestEventsBurst = 10 * meter.MaxEvents
	// DefaultIngestRequestsPerSecond is 5,000 requests a second a token:
	// a product service posting one event a request (the common way) at
	// about a node's whole single-event rate, which group commit makes
	// cheap; the events rate bounds what it stores.
	DefaultIngestRequestsPerSecond = 5_000
)

// maxQuotaTokens bounds the tokens whose limiters a node keeps.
const maxQuotaTokens = 10_000

// The reasons of tally_ingest_throttled_total.
const (
	throttledEvents        = "events"
	throttledRequests      = "requests"
	throttledQuarantineCap = "quarantine_cap"
)

// quotas hold the limiters of the tokens that posted lately, and the
// tokens this node verified lately (the per-token state a node keeps).
type quotas struct {
	cfg IngestQuota
	now func() time.Time

	// verified answers authenticate for a token verified within
	// auth.VerifiedTTL.
	verified auth.VerifiedCache

	mu      sync.Mutex
	byToken map[int64]*tokenLimiters // guarded by mu
}

// tokenLimiters are one token's limiters; nil is no limit.
type tokenLimiters struct {
	events, requests *rate.Limiter
}

func newQuotas(cfg IngestQuota) *quotas {
	if cfg.MaxEvents <= 0 || cfg.MaxEvents > meter.MaxEvents {
		cfg.MaxEvents = meter.MaxEvents
	}
	if cfg.EventsBurst <= 0 {
		cfg.EventsBurst = cfg.MaxEvents
	}
	return &quotas{cfg: cfg, now: time.Now, byToken: map[int64]*tokenLimiters{}}
}

// limitsOf returns the token's limiters, made on first use. The map is
// bounded: when it is full, the limiters of tokens that are idle (both
// buckets full: the same as new ones) go first, then, if the node really
// serves more than maxQuotaTokens busy tokens, those that would be full
// soonest: forgetting a limiter gives its token a full burst early, so the
// ones that lose the least are dropped, never a token that spent its
// budget for a long while ahead.
func (q *quotas) limitsOf(token int64, now time.Time) *tokenLimiters {
	q.mu.Lock()
	defer q.mu.Unlock()
	if l, ok := q.byToken[token]; ok {
		return l
	}
	if len(q.byToken) >= maxQuotaTokens {
		for id, l := range q.byToken {
			if l.idle(now) {
				delete(q.byToken, id)
			}
		}
		if len(q.byToken) >= maxQuotaTokens*3/4 {
			ids := make([]int64, 0, len(q.byToken))
			full := make(map[int64]time.Duration, len(q.byToken))
			for id, l := range q.byToken {
				ids = append(ids, id)
				full[id] = l.untilFull(now)
			}
			slices.SortFunc(ids, func(a, b int64) int { return cmp.Compare(full[a], full[b]) })
			for _, id := range ids[:len(ids)-maxQuotaTokens*3/4+1] {
				delete(q.byToken, id)
			}
		}
	}
	l := &tokenLimiters{}
	if q.cfg.EventsPerSecond > 0 {
		l.events = rate.NewLimiter(rate.Limit(q.cfg.EventsPerSecond), q.cfg.EventsBurst)
	}
	if q.cfg.RequestsPerSecond > 0 {
		l.requests = rate.NewLimiter(rate.Limit(q.cfg.RequestsPerSecond), max(1, int(math.Ceil(q.cfg.RequestsPerSecond))))
	}
	q.byToken[token] = l
	return l
}

// untilFull is how long until both of the token's buckets are full again.
func (l *tokenLimiters) untilFull(now time.Time) time.Duration {
	var d time.Duration
	for _, r := range []*rate.Limiter{l.events, l.requests} {
		if r == nil || r.Limit() <= 0 {
			continue
		}
		if missing := float64(r.Burst()) - r.TokensAt(now); missing > 0 {
			d = max(d, time.Duration(missing/float64(r.Limit())*float64(time.Second)))
		}
	}
	return d
}

func (l *tokenLimiters) idle(now time.Time) bool {
	full := func(r *rate.Limiter) bool { return r == nil || r.TokensAt(now) >= float64(r.Burst()) }
	return full(l.events) && full(l.requests)
}

// admit takes n from the limiter, or nothing: wait is how long until it
// could, possible false when it never could (n over the burst).
func admit(r *rate.Limiter, n int, now time.Time) (wait time.Duration, possible bool) {
	wait, possible, _ = reserve(r, n, now)
	return wait, possible
}

// reserve is admit that also returns, when it admitted, the reservation,
// so that a request refused later can give its budget back.
func reserve(r *rate.Limiter, n int, now time.Time) (wait time.Duration, possible bool, res *rate.Reservation) {
	if r == nil {
		return 0, true, nil
	}
	res = r.ReserveN(now, n)
	if !res.OK() {
		return 0, false, nil
	}
	if d := res.DelayFrom(now); d > 0 {
		res.CancelAt(now) // a refused request costs no budget
		return d, true, nil
	}
	return 0, true, res
}

// admitRequest takes one request from the token's budget; ok false says
// to retry after wait.
func (q *quotas) admitRequest(token int64) (wait time.Duration, ok bool) {
	if q.cfg.RequestsPerSecond <= 0 {
		return 0, true
	}
	now := q.now()
	wait, _ = admit(q.limitsOf(token, now).requests, 1, now)
	return wait, wait == 0
}

// admitEvents takes n events from the token's budget; ok false says to
// retry after wait, possible false that n is over the burst.
func (q *quotas) admitEvents(token int64, n int) (wait time.Duration, ok, possible bool) {
	wait, ok, possible, _ = q.takeEvents(token, n)
	return wait, ok, possible
}

// takeEvents is admitEvents that also answers, when it admitted the events,
// refund: it gives them back, for a batch refused after it was admitted
// (invalid, over the quarantine cap, a failed transaction), so that nothing
// stored costs nothing.
func (q *quotas) takeEvents(token int64, n int) (wait time.Duration, ok, possible bool, refund func()) {
	refund = func() {}
	if q.cfg.EventsPerSecond <= 0 {
		return 0, true, true, refund
	}
	now := q.now()
	wait, possible, res := reserve(q.limitsOf(token, now).events, n, now)
	if res != nil {
		refund = func() { res.CancelAt(q.now()) }
	}
	return wait, possible && wait == 0, possible, refund
}

// writeThrottled answers 429 with Retry-After: whole seconds, at least 1.
func writeThrottled(w http.ResponseWriter, wait time.Duration, message string) {
	w.Header().Set("Retry-After", strconv.Itoa(max(1, int(math.Ceil(wait.Seconds())))))
	WriteError(w, http.StatusTooManyRequests, "rate_limited", message)
}

func (m *Metrics) throttled(reason string) {
	if m != nil {
		m.ingestThrottled.WithLabelValues(reason).Inc()
	}
}
