package api

import (
	"errors"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// DefaultReadRetryAfter is the Retry-After of a read refused by a
// ReadLimiter: a report takes seconds, not minutes.
const DefaultReadRetryAfter = 2 * time.Second

// ReadLimiter bounds the expensive reads in flight — the reports, their
// console pages, the reconcile listings — per token and in all, so that one
// token, or all of them, cannot take every connection of the reads pool. A
// read over a bound is refused at once (429 with Retry-After), never
// queued: a queue would hold the client's connection and keep the work
// coming. One limiter serves the API and the console, so the global bound
// covers both. Its zero value is not usable: use NewReadLimiter.
type ReadLimiter struct {
	perToken, global int
	refused          *prometheus.CounterVec

	mu sync.Mutex
	// inFlight counts each token's reads in flight; total is their sum.
	inFlight map[int64]int
	total    int
}

// NewReadLimiter returns a limiter of perToken reads in flight per token
// and global in all (each at least 1), with its counter of refused reads
// registered on reg (nil: not registered).
func NewReadLimiter(perToken, global int, reg prometheus.Registerer) (*ReadLimiter, error) {
	if perToken < 1 || global < 1 {
		return nil, errors.New("api: a read limiter's bounds must be at least 1")
	}
	l := &ReadLimiter{perToken: perToken, global: global, inFlight: map[int64]int{},
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_reads_refused_total",
			Help: "Expensive reads (reports, their console pages, reconcile listings) refused with 429, by bound: token or global.",
		}, []string{"bound"})}
	if reg != nil {
		if err := reg.Register(l.refused); err != nil {
			return nil, err
		}
	}
	// Both bounds at 0, so that a scrape shows them before the first refusal.
	for _, b := range []string{"token", "global"} {
		l.refused.WithLabelValues(b)
	}
	return l, nil
}

// Acquire takes a slot for one read of token: ok is false, and nothing is
// taken, when the token or the node is at its bound. release gives the slot
// back; call it once.
func (l *ReadLimiter) Acquire(token int64) (release func(), ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.inFlight[token] >= l.perToken:
		l.refused.WithLabelValues("token").Inc()
		return nil, false
	case l.total >= l.global:
		l.refused.WithLabelValues("global").Inc()
		return nil, false
	}
	l.inFlight[token]++
	l.total++
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.inFlight[token]--; l.inFlight[token] == 0 {
				delete(l.inFlight, token)
			}
			l.total--
		})
	}, true
}

// RetryAfter is how long a refused client is asked to wait.
func (l *ReadLimiter) RetryAfter() time.Duration { return DefaultReadRetryAfter }

// readSlot bounds an expensive read (the reports, the reconcile listings:
// the routes that use it) with h.ReadLimit, nil meaning unbounded. It runs
// after authentication: the request's token takes a slot or is answered
// 429 with Retry-After at once, never queued.
func (h *handlers) readSlot(next http.Handler) http.Handler {
	l := h.ReadLimit
	if l == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		release, ok := l.Acquire(principal(r).TokenID)
		if !ok {
			w.Header().Set("Retry-After", strconv.Itoa(int(l.RetryAfter().Seconds())))
			WriteError(w, http.StatusTooManyRequests, "too_many_reads",
				"too many reports are running for this token or on this node; retry after a moment")
			return
		}
		defer release()
		next.ServeHTTP(w, r)
	})
}
