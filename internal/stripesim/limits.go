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

// Faults are injected into meter-event calls: v1 POST
// /v1/billing/meter_events and POST /v2/billing/meter_event_stream, the v2
// stream, whose requests carry up to 100 events each. Each probability is in
// [0, 1] and is drawn per call — per stream request — from the simulator's
// seedable random source ([Options.Seed]), except AsyncDrop, which the
// stream draws per event. They act in this order, after the rate limits:
// rate-limit fault, latency, hang, fail before record, then the call is
// processed with lose reply and async drop. ReadFault applies to GETs.
type Faults struct {
	// FailBeforeRecord answers 500 api_error without processing the call:
	// nothing is recorded or reported and no response is kept for its
	// Idempotency-Key.
	FailBeforeRecord float64
	// LoseReply processes the call — the events are recorded (and the
	// stream's invalid ones reported) and a 2xx answer kept for its
	// Idempotency-Key — then answers 502 api_error instead, as if the reply
	// was lost on the way back. A retry with the same key gets the kept
	// answer (unless its reply is lost too).
	LoseReply float64
	// RateLimitFault answers 429 rate_limit without processing the call.
	RateLimitFault float64
	// Hang never answers: the call waits until the client gives up (its
	// request context ends) or [Server.Close]. Nothing is recorded.
	Hang float64
	// AsyncDrop processes and answers success, but marks a recorded event
	// EventDropped: it leaves the summaries and aggregates, and an
	// ErrorReport with CodeDropped names it. v1 draws it per call, the
	// stream per valid event; the stream's drops of one request are grouped
	// into reports like its validation failures.
	AsyncDrop float64
	// ReadFault answers a GET (meters, event summaries, the account) with
	// 500 half the time and 429 the other half, without reading anything:
	// the reconciler's reads meet transient failures too.
	ReadFault float64
	// Latency delays every meter-event call that passed the rate limits by
	// Latency plus a random extra in [0, LatencyJitter), on the real clock.
	Latency       time.Duration
	LatencyJitter time.Duration
}

// Limits are the rate limits and faults of one account for meter-event
// calls (v1 and the v2 stream). The zero value has none. Other calls,
// creating a stream session among them, are never limited.
type Limits struct {
	// RatePerSecond is a token bucket of v1 meter-event calls per second
	// for the account (both modes), on the real clock; a call without a
	// token is answered 429 rate_limit. 0 means no limit. (Stripe: 1,000
	// calls/s live; test mode counts toward the basic 25 ops/s.)
	RatePerSecond float64
	// Burst is the bucket's size. Default: RatePerSecond rounded down, at
	// least 1.
	Burst int
	// StreamRatePerSecond is a separate token bucket of v2 stream requests
	// per second for the account (both modes), on the real clock; a request
	// without a token is answered 429 rate_limit and nothing in it is
	// processed. 0 means no limit. (Stripe: up to 10,000 requests/s live.)
	// Stream requests never take v1 tokens, nor v1 calls stream tokens.
	StreamRatePerSecond float64
	// StreamBurst is the stream bucket's size. Default:
	// StreamRatePerSecond rounded down, at least 1.
	StreamBurst int
	// OneCallPerCustomerMeter answers 429 rate_limit to a v1 meter-event
	// call while another for the same account, customer and event name is
	// in flight: Stripe's one-concurrent-call rule, a v1 rule that the
	// stream does not have. [Server.MaxConcurrentPerKey] tracks the overlap
	// whether or not this is set.
	OneCallPerCustomerMeter bool
	Faults                  Faults
}

func (l Limits) validate() error {
	if l.RatePerSecond < 0 || math.IsNaN(l.RatePerSecond) || l.Burst < 0 ||
		l.StreamRatePerSecond < 0 || math.IsNaN(l.StreamRatePerSecond) || l.StreamBurst < 0 {
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
	buckets    map[string]*bucket // v1 meter-event calls, per account
	streamBkts map[string]*bucket // v2 stream requests, per account
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
	l.streamBkts = map[string]*bucket{}
	l.inflight = map[flightKey]int{}
	l.rng = rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

// Configure sets the limits and faults of account, replacing the defaults
// for it (Limits{} means none), while the simulator runs. The token
// buckets keep their tokens, capped at the new sizes. It panics on a
// negative rate or a probability outside [0, 1].
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
// Stream requests are not counted: the rule is v1's.
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

// take takes a token at now from the account's bucket in buckets, which
// fills at rate per second up to burst (0: rate rounded down, at least 1).
// A rate of 0 means no limit.
func take(buckets map[string]*bucket, account string, rate float64, burst int, now time.Time) bool {
	if rate <= 0 {
		return true
	}
	size := float64(burst)
	if size == 0 {
		size = max(1, math.Floor(rate))
	}
	b := buckets[account]
	if b == nil {
		b = &bucket{tokens: size, last: now}
		buckets[account] = b
	}
	b.tokens = min(size, b.tokens+now.Sub(b.last).Seconds()*rate)
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
	dropP                  float64 // the stream's per-event AsyncDrop
}

// plan is what the meter-event handlers must know of the gate's decision:
// whether v1 drops its event, with what probability the stream drops each
// valid event.
type plan struct {
	asyncDrop  bool
	streamDrop float64
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
	case !take(l.buckets, c.account, lim.RatePerSecond, lim.Burst, time.Now()):
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
	l.rollFaults(&d, lim.Faults)
	d.drop = l.roll(lim.Faults.AsyncDrop)
	return d, key
}

// rollFaults draws the latency and the hang, fail and lose faults of one
// call that passed the rate limits, in this order.
func (l *limiter) rollFaults(d *decision, f Faults) {
	d.delay = f.Latency
	if f.LatencyJitter > 0 {
		d.delay += time.Duration(l.rng.Int64N(int64(f.LatencyJitter)))
	}
	d.hang, d.fail = l.roll(f.Hang), l.roll(f.FailBeforeRecord)
	d.lose = l.roll(f.LoseReply)
}

// admitStream decides the fate of one v2 stream request: its own token
// bucket and the faults of the account, drawn like v1's but for the whole
// request; AsyncDrop is left to the handler, per event. The stream has no
// one-call-per-customer rule and is not counted in flight.
func (s *Server) admitStream(c caller) decision {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := &s.lim
	lim := l.limitsOf(c.account)
	var d decision
	switch {
	case !take(l.streamBkts, c.account, lim.StreamRatePerSecond, lim.StreamBurst, time.Now()):
		d.err = errRateLimit()
	case l.roll(lim.Faults.RateLimitFault):
		d.err = errRateLimit()
	}
	if d.err != nil {
		return d
	}
	l.rollFaults(&d, lim.Faults)
	d.dropP = lim.Faults.AsyncDrop
	return d
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

// gate applies the account's limits and faults to meter-event calls (v1
// and the v2 stream) and the read fault to GETs. It runs before the
// idempotency layer, so that a rate-limited or failed call keeps nothing
// for its key, and a lost reply's answer is kept for it.
func (s *Server) gate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			if e := s.readFault(callerOf(r)); e != nil {
				writeError(w, e)
				return
			}
		}
		var d decision
		switch {
		case r.Method == http.MethodPost && r.URL.Path == meterEventsPath:
			var key flightKey
			d, key = s.admit(callerOf(r), r.Form)
			defer s.release(key)
		case r.Method == http.MethodPost && r.URL.Path == streamPath:
			d = s.admitStream(callerOf(r))
		default:
			next.ServeHTTP(w, r)
			return
		}
		s.serveGated(w, r, d, next)
	})
}

// serveGated carries out the gate's decision d on one meter-event call.
func (s *Server) serveGated(w http.ResponseWriter, r *http.Request, d decision, next http.Handler) {
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
	r = r.WithContext(context.WithValue(ctx, planKey, plan{asyncDrop: d.drop, streamDrop: d.dropP}))
	if d.lose {
		next.ServeHTTP(&discardWriter{header: http.Header{}}, r)
		writeError(w, &apiError{Status: http.StatusBadGateway, Type: typeAPI,
			Message: "Bad gateway. (stripesim: Faults.LoseReply)"})
		return
	}
	next.ServeHTTP(w, r)
}
