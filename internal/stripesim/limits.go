package stripesim

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"net/url"
	"time"
)

// Faults are injected into v1 meter-event calls (POST
// /v1/billing/meter_events) only. Each probability is in [0, 1] and is
// drawn per call from the simulator's seedable random source
// ([Options.Seed]). They act in this order, after the rate limits: latency,
// hang, fail before record, then the request is processed with lose reply
// and async drop.
type Faults struct {
	// FailBeforeRecord answers 500 api_error without processing the call:
	// nothing is recorded and no response is kept for its Idempotency-Key.
	FailBeforeRecord float64
	// LoseReply processes the call — the event is recorded and a 2xx answer
	// kept for its Idempotency-Key — then answers 502 api_error instead, as
	// if the reply was lost on the way back. A retry with the same key gets
	// the kept answer (unless its reply is lost too).
	LoseReply float64
	// RateLimitFault answers 429 rate_limit without processing the call.
	RateLimitFault float64
	// Hang never answers: the call waits until the client gives up (its
	// request context ends) or [Server.Close]. Nothing is recorded.
	Hang float64
	// AsyncDrop processes and answers 200, but marks the recorded event
	// EventDropped: it leaves the summaries and aggregates, and an
	// ErrorReport with CodeDropped is produced.
	AsyncDrop float64
	// ReadFault answers a GET (meters, event summaries, the account) with
	// 500 half the time and 429 the other half, without reading anything:
	// the reconciler's reads meet transient failures too.
	ReadFault float64
	// Latency delays every call that passed the rate limits by Latency plus
	// a random extra in [0, LatencyJitter), on the real clock.
	Latency       time.Duration
	LatencyJitter time.Duration
}

// Limits are the rate limits and faults of one account for v1 meter-event
// calls. The zero value has none.
type Limits struct {
	// RatePerSecond is a token bucket of meter-event calls per second for
	// the account (both modes), on the real clock; a call without a token is
	// answered 429 rate_limit. 0 means no limit.
	RatePerSecond float64
	// Burst is the bucket's size. Default: RatePerSecond rounded down, at
	// least 1.
	Burst int
	// OneCallPerCustomerMeter answers 429 rate_limit to a meter-event call
	// while another for the same account, customer and event name is in
	// flight: Stripe's one-concurrent-call rule. [Server.MaxConcurrentPerKey]
	// tracks the overlap whether or not this is set.
	OneCallPerCustomerMeter bool
	Faults                  Faults
}

func (l Limits) validate() error {
	if l.RatePerSecond < 0 || math.IsNaN(l.RatePerSecond) || l.Burst < 0 {
		return fmt.Errorf("negative rate or burst")
	}
	f := l.Faults
	for _, p := range []float64{f.FailBeforeRecord, f.LoseReply, f.RateLimitFault, f.Hang, f.AsyncDrop, f.ReadFault} {
		if !(p >= 0 && p <= 1) {
			return fmt.Errorf("fault probability %v is outside [0, 1]", p)
		}
	}
	if f.Latency < 0 || f.LatencyJitter < 0 {
		return fmt.Errorf("negative latency")
	}
	return nil
}

// limiter is the state of limits and faults; guarded by Server.mu.
type limiter struct {
	defaults   Limits
	perAccount map[string]Limits
	buckets    map[string]*bucket
	inflight   map[flightKey]int
	maxFlight  int
	rng        *rand.Rand
}

// flightKey is what Stripe allows one concurrent meter-event call for.
type flightKey struct{ account, customer, eventName string }

type bucket struct {
	tokens float64
	last   time.Time
}

func (l *limiter) init(defaults Limits, seed uint64) {
	if err := defaults.validate(); err != nil {
		panic("stripesim: Options.Limits: " + err.Error())
	}
	if seed == 0 {
		seed = rand.Uint64()
	}
	l.defaults = defaults
	l.perAccount = map[string]Limits{}
	l.buckets = map[string]*bucket{}
	l.inflight = map[flightKey]int{}
	l.rng = rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

// Configure sets the limits and faults of account, replacing the defaults
// for it (Limits{} means none), while the simulator runs. The token bucket
// keeps its tokens, capped at the new size. It panics on a negative rate
// or a probability outside [0, 1].
func (s *Server) Configure(account string, l Limits) {
	if err := l.validate(); err != nil {
		panic("stripesim: Configure: " + err.Error())
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lim.perAccount[account] = l
}

// ConfigureDefault sets the limits and faults of every account that has
// none of its own from [Server.Configure], while the simulator runs.
func (s *Server) ConfigureDefault(l Limits) {
	if err := l.validate(); err != nil {
		panic("stripesim: ConfigureDefault: " + err.Error())
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lim.defaults = l
}

// MaxConcurrentPerKey returns the largest number of v1 meter-event calls
// seen in flight at once for one (account, customer, event name), counting
// every call that reached the simulator, including those it answered 429.
func (s *Server) MaxConcurrentPerKey() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lim.maxFlight
}

func (l *limiter) limitsOf(account string) Limits {
	if lim, ok := l.perAccount[account]; ok {
		return lim
	}
	return l.defaults
}

// take takes a token from the account's bucket at now.
func (l *limiter) take(account string, lim Limits, now time.Time) bool {
	if lim.RatePerSecond <= 0 {
		return true
	}
	size := float64(lim.Burst)
	if size == 0 {
		size = max(1, math.Floor(lim.RatePerSecond))
	}
	b := l.buckets[account]
	if b == nil {
		b = &bucket{tokens: size, last: now}
		l.buckets[account] = b
	}
	b.tokens = min(size, b.tokens+now.Sub(b.last).Seconds()*lim.RatePerSecond)
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// roll draws whether a fault of probability p happens.
func (l *limiter) roll(p float64) bool {
	return p > 0 && l.rng.Float64() < p
}

// decision is what the gate does with one meter-event call.
type decision struct {
	err                    *apiError // answer this at once
	delay                  time.Duration
	hang, fail, lose, drop bool
}

// plan is what the meter-event handler must know of the gate's decision.
type plan struct {
	asyncDrop bool
}

func planOf(r *http.Request) plan {
	p, _ := r.Context().Value(planKey).(plan)
	return p
}

func errRateLimit() *apiError {
	return errInvalid(http.StatusTooManyRequests, "rate_limit", "",
		"Request rate limit exceeded. You can learn more about rate limits here https://stripe.com/docs/rate-limits.")
}

// readFault decides whether a read fails (Faults.ReadFault).
func (s *Server) readFault(c caller) *apiError {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := &s.lim
	if !l.roll(l.limitsOf(c.account).Faults.ReadFault) {
		return nil
	}
	if l.roll(0.5) {
		return errRateLimit()
	}
	return &apiError{Status: http.StatusInternalServerError, Type: typeAPI,
		Message: "An unknown error occurred. (stripesim: Faults.ReadFault)"}
}

// admit counts the call in flight and decides its fate. The caller must
// release the key.
func (s *Server) admit(c caller, form url.Values) (decision, flightKey) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := &s.lim
	lim := l.limitsOf(c.account)
	name := form.Get("event_name")
	custKey := DefaultCustomerPayloadKey
	if a := s.accounts[c.account]; a != nil {
		if m := a.activeMeterLocked(c.livemode, name, nil); m != nil {
			custKey = m.CustomerPayloadKey
		}
	}
	key := flightKey{account: c.account, customer: form.Get("payload[" + custKey + "]"), eventName: name}
	n := l.inflight[key] + 1
	l.inflight[key] = n
	l.maxFlight = max(l.maxFlight, n)

	var d decision
	switch {
	case !l.take(c.account, lim, time.Now()):
		d.err = errRateLimit()
	case lim.OneCallPerCustomerMeter && n > 1:
		d.err = errInvalid(http.StatusTooManyRequests, "rate_limit", "",
			"Too many concurrent requests for customer '%s' and event_name '%s': send one meter event at a time for each customer and meter.",
			key.customer, key.eventName)
	case l.roll(lim.Faults.RateLimitFault):
		d.err = errRateLimit()
	}
	if d.err != nil {
		return d, key
	}
	f := lim.Faults
	d.delay = f.Latency
	if f.LatencyJitter > 0 {
		d.delay += time.Duration(l.rng.Int64N(int64(f.LatencyJitter)))
	}
	d.hang, d.fail = l.roll(f.Hang), l.roll(f.FailBeforeRecord)
	d.lose, d.drop = l.roll(f.LoseReply), l.roll(f.AsyncDrop)
	return d, key
}

func (s *Server) release(key flightKey) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lim.inflight[key]--; s.lim.inflight[key] <= 0 {
		delete(s.lim.inflight, key)
	}
}

// discardWriter swallows a response whose reply is "lost".
type discardWriter struct{ header http.Header }

func (w *discardWriter) Header() http.Header         { return w.header }
func (w *discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (w *discardWriter) WriteHeader(int)             {}

// gate applies the account's limits and faults to v1 meter-event calls. It
// runs before the idempotency layer, so that a rate-limited or failed call
// keeps nothing for its key, and a lost reply's answer is kept for it.
func (s *Server) gate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			if e := s.readFault(callerOf(r)); e != nil {
				writeError(w, e)
				return
			}
		}
		if r.Method != http.MethodPost || r.URL.Path != meterEventsPath {
			next.ServeHTTP(w, r)
			return
		}
		d, key := s.admit(callerOf(r), r.Form)
		defer s.release(key)
		if d.err != nil {
			writeError(w, d.err)
			return
		}
		ctx := r.Context()
		if d.delay > 0 {
			t := time.NewTimer(d.delay)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				writeError(w, &apiError{Status: http.StatusInternalServerError, Type: typeAPI,
					Message: "stripesim: the client gave up during the simulated latency."})
				return
			}
		}
		if d.hang {
			select {
			case <-ctx.Done():
			case <-s.closed:
			}
			writeError(w, &apiError{Status: http.StatusInternalServerError, Type: typeAPI,
				Message: "stripesim: the request was held until the client gave up (Faults.Hang)."})
			return
		}
		if d.fail {
			writeError(w, &apiError{Status: http.StatusInternalServerError, Type: typeAPI,
				Message: "An unknown error occurred. (stripesim: Faults.FailBeforeRecord)"})
			return
		}
		r = r.WithContext(context.WithValue(ctx, planKey, plan{asyncDrop: d.drop}))
		if d.lose {
			next.ServeHTTP(&discardWriter{header: http.Header{}}, r)
			writeError(w, &apiError{Status: http.StatusBadGateway, Type: typeAPI,
				Message: "Bad gateway. (stripesim: Faults.LoseReply)"})
			return
		}
		next.ServeHTTP(w, r)
	})
}
