package stripesim

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
)

// Faults are injected into meter-event calls — v1 POST
// /v1/billing/meter_events and POST /v2/billing/meter_event_stream, the v2
// stream, whose requests carry up to 100 events each — and into meter event
// adjustments (POST /v1/billing/meter_event_adjustments), which draw every
// fault but AsyncDrop. Each probability is in
// [0, 1] and is drawn per call — per stream request — from the simulator's
// seedable random source ([Options.Seed]), except AsyncDrop, which the
// stream draws per event.
//
// They act where their real counterparts would. RateLimitFault acts with
// the rate limits, in front of Stripe's idempotency layer, so nothing is
// kept for the call's Idempotency-Key. Latency, Hang, FailBeforeRecord,
// FailAfterRecord and AsyncDrop act inside it, on a call that is executed
// (not on a replay): a 500 they answer is kept for the key and replayed to
// every later request with it, as Stripe keeps the result of every request
// whose endpoint started executing. LoseReply acts outside everything, as
// a proxy between the client and Stripe would: it can lose a replay's
// reply too. ReadFault applies to GETs. Every call that passes the rate
// limits draws, in this order, the latency jitter, Hang,
// FailBeforeRecord, LoseReply, FailAfterRecord and (v1) AsyncDrop — a
// replay too, though only LoseReply acts on it — so that one seed gives
// one sequence of outcomes whatever the keys.
type Faults struct {
	// FailBeforeRecord answers 500 api_error with Stripe-Should-Retry:
	// false without processing the call: nothing is recorded or reported.
	// The endpoint had started executing, so the 500 is kept for the call's
	// Idempotency-Key and replayed to every later request with that key;
	// only a request with another key (or none) is processed.
	FailBeforeRecord float64
	// FailAfterRecord processes the call — the events are recorded (and the
	// stream's invalid ones reported) — then answers 500 api_error with
	// Stripe-Should-Retry: false instead of the result; the 500 is kept
	// for the key and replayed like FailBeforeRecord's. A resend of the
	// events with another key meets the identifiers' dedup.
	FailAfterRecord float64
	// LoseReply lets the call through — processed, and its answer (a 2xx
	// or any other) kept for its Idempotency-Key as usual — then answers
	// 502 api_error instead, as if a proxy lost the reply on the way back.
	// A retry with the same key gets the kept answer (unless its reply is
	// lost too).
	LoseReply float64
	// RateLimitFault answers 429 rate_limit without processing the call;
	// nothing is kept for its key.
	RateLimitFault float64
	// LockTimeouts answers a v1 meter-event call for one of its customers
	// (a Stripe customer id, the payload's customer under the meter's key)
	// 429 lock_timeout with the customer's probability, as Stripe answers a
	// call that timed out waiting for an object's lock
	// (https://docs.stripe.com/rate-limits, "Object lock timeouts"): type
	// invalid_request_error, code lock_timeout, Stripe's message, and no
	// Stripe-Rate-Limited-Reason, since no limiter refused it. It acts after
	// the rate limits, in front of the idempotency layer: "Stripe doesn't
	// process these failed requests", so nothing is recorded and nothing is
	// kept for the call's Idempotency-Key. [Server.LockTimeouts] counts
	// them.
	LockTimeouts map[string]float64
	// Hang holds the call before it executes until the client gives up
	// (its request context ends) or [Server.Close], then answers 500.
	// Nothing is recorded and nothing is kept for its key; while held, a
	// request with the same key is answered 409.
	Hang float64
	// AsyncDrop processes and answers success, but marks a recorded event
	// EventDropped: it leaves the summaries and aggregates, and an
	// ErrorReport with CodeDropped names it. v1 draws it per call, the
	// stream per valid event; the stream's drops of one request are grouped
	// into reports like its validation failures.
	AsyncDrop float64
	// ReadFault answers a GET (meters, event summaries, the account,
	// customers, prices, subscriptions, invoices, v1 and v2 events) with
	// 500 half the time and 429 the other half,
	// without reading anything: the reconciler's reads meet transient
	// failures too.
	ReadFault float64
	// Latency delays every meter-event call that passed the rate limits,
	// before it executes, by Latency plus a random extra in
	// [0, LatencyJitter), on the real clock. A client that gives up
	// meanwhile leaves nothing executed or kept.
	Latency       time.Duration
	LatencyJitter time.Duration
	// ReplyDelay holds the answer of every meter-event, stream or
	// adjustment call that passed the rate limits — executed, its result
	// kept for its Idempotency-Key — this long before writing it, on the
	// real clock, as a slow way back would. A client that gives up
	// meanwhile (a timeout, a process killed between sending and
	// recording) never hears that its call was carried out;
	// [Server.Unheard] counts those successes.
	ReplyDelay time.Duration
}

// Limits are the rate limits and faults of one account, and how it
// validates v1 meter events. The zero value has none and validates v1
// synchronously.
type Limits struct {
	// BasicRatePerSecond is Stripe's basic rate limit: a token bucket per
	// account and mode that every API-key call takes from — reads (the
	// account, meters, event summaries, customers, v2 events) and writes
	// (meters, customers, adjustments, meter event sessions) — and v1 meter
	// events and v2 stream requests too in test mode, or when made for a
	// connected account (the Stripe-Account header, or a session created
	// with it); a platform's own live-mode meter events and stream requests
	// have only their own limits. A call without a token is answered 429
	// rate_limit, and nothing is kept for its Idempotency-Key. On the real
	// clock; 0 means no limit. (Stripe: 100 operations/s live, 25 in a
	// sandbox or test mode.)
	BasicRatePerSecond float64
	// BasicBurst is the basic bucket's size. Default: BasicRatePerSecond
	// rounded down, at least 1.
	BasicBurst int
	// EndpointRatePerSecond is Stripe's default limit of each endpoint: a
	// token bucket per account, mode and endpoint (method and route, so
	// GET /v1/billing/meters/{id}/event_summaries is one endpoint whatever
	// the meter) for every API-key call other than meter events, which
	// have RatePerSecond and StreamRatePerSecond. A call takes its basic
	// token first. On the real clock; 0 means no limit. (Stripe: 25
	// requests/s unless an endpoint's limit is noted otherwise.)
	EndpointRatePerSecond float64
	// EndpointBurst is each endpoint bucket's size. Default:
	// EndpointRatePerSecond rounded down, at least 1.
	EndpointBurst int
	// RatePerSecond is a token bucket of v1 meter-event calls per second
	// for the account (both modes), on the real clock; a call without a
	// token is answered 429 rate_limit. 0 means no limit. (Stripe: 1,000
	// calls/s live; in test mode the calls count toward the basic limit,
	// see BasicRatePerSecond.)
	RatePerSecond float64
	// Burst is the bucket's size. Default: RatePerSecond rounded down, at
	// least 1.
	Burst int
	// StreamRatePerSecond is a separate token bucket of v2 stream requests
	// per second for the account (both modes), on the real clock; a request
	// without a token is answered 429 rate_limit and nothing in it is
	// processed. 0 means no limit. (Stripe: up to 10,000 requests/s live;
	// in test mode they count toward the basic limit.) Stream requests
	// never take v1 tokens, nor v1 calls stream tokens.
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
	// AsyncValidation makes POST /v1/billing/meter_events validate like
	// Stripe may after answering: an event for an unknown customer, a
	// payload without the meter's customer or value key, an invalid value
	// or one of more than 15 digits, no active meter for the event name, or
	// a timestamp outside the window is answered 200 with the usual
	// billing.meter_event, not recorded, and reported in an [ErrorReport]
	// as the stream reports it. The shape of the request (unknown or
	// missing parameters, an identifier too long, a timestamp that is not
	// an integer) and a duplicate identifier are still refused at once.
	AsyncValidation bool
	Faults          Faults
}

func (l Limits) validate() error {
	for _, r := range []float64{l.RatePerSecond, l.StreamRatePerSecond, l.BasicRatePerSecond, l.EndpointRatePerSecond} {
		if r < 0 || math.IsNaN(r) {
			return fmt.Errorf("negative rate")
		}
	}
	if l.Burst < 0 || l.StreamBurst < 0 || l.BasicBurst < 0 || l.EndpointBurst < 0 {
		return fmt.Errorf("negative burst")
	}
	f := l.Faults
	for _, p := range []float64{f.FailBeforeRecord, f.FailAfterRecord, f.LoseReply, f.RateLimitFault, f.Hang, f.AsyncDrop, f.ReadFault} {
		if !(p >= 0 && p <= 1) {
			return fmt.Errorf("fault probability %v is outside [0, 1]", p)
		}
	}
	for customer, p := range f.LockTimeouts {
		if !(p >= 0 && p <= 1) {
			return fmt.Errorf("lock-timeout probability %v of %s is outside [0, 1]", p, customer)
		}
	}
	if f.Latency < 0 || f.LatencyJitter < 0 {
		return fmt.Errorf("negative latency")
	}
	return nil
}

// Limiters a 429 rate_limit comes from, as [Server.RateLimited] counts them.
const (
	LimiterBasic       = "basic"        // Limits.BasicRatePerSecond
	LimiterEndpoint    = "endpoint"     // Limits.EndpointRatePerSecond
	LimiterMeterEvents = "meter_events" // Limits.RatePerSecond
	LimiterStream      = "stream"       // Limits.StreamRatePerSecond
	LimiterConcurrency = "concurrency"  // Limits.OneCallPerCustomerMeter
	LimiterFault       = "fault"        // Faults.RateLimitFault and ReadFault
)

// RateLimitKey is what [Server.RateLimited] counts 429s by: the limiter and
// the endpoint, its method and route ("GET /v1/billing/meters/{id}").
type RateLimitKey struct {
	Limiter  string
	Endpoint string
}

// limiter is the state of limits and faults; guarded by Server.mu.
type limiter struct {
	defaults   Limits
	perAccount map[string]Limits
	buckets    map[bucketKey]*bucket
	inflight   map[flightKey][]*flight
	maxFlight  int
	overlaps   []Overlap
	unheard    int                             // successes whose client had gone (Faults.ReplyDelay)
	holding    int                             // successes being held now (Faults.ReplyDelay)
	limited    map[string]map[RateLimitKey]int // account -> 429s
	locked     map[string]int                  // account -> lock timeouts (Faults.LockTimeouts)
	rng        *rand.Rand
}

// bucketKey names one token bucket: a limiter's, for an account, and for
// the basic and endpoint limiters a mode and an endpoint.
type bucketKey struct {
	limiter  string
	account  string
	livemode bool
	endpoint string
}

// flightKey is what Stripe allows one concurrent meter-event call for.
type flightKey struct{ account, customer, eventName string }

// flight is one v1 meter-event call in flight: admitted by the gate and not
// yet answered.
type flight struct {
	identifier, idemKey string
	start               time.Time
	ctx                 context.Context // the request's: done once the client gave up
}

// maxOverlaps bounds the overlaps a simulator keeps.
const maxOverlaps = 50

// Overlap describes a v1 meter-event call that arrived while others for the
// same account, customer and event name were in flight: every call then in
// flight, the arriving one last.
type Overlap struct {
	Account, Customer, EventName string
	Calls                        []FlightCall
}

// FlightCall is one call of an [Overlap].
type FlightCall struct {
	Identifier     string
	IdempotencyKey string
	// Arrived is when the simulator admitted the call; Age is how long it
	// had been in flight when the overlap began.
	Arrived time.Time
	Age     time.Duration
	// ClientGone says the call's client had already given up (closed the
	// connection or timed out) while the simulator still worked on it.
	ClientGone bool
}

func (o Overlap) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s/%s/%s:", o.Account, o.Customer, o.EventName)
	for _, c := range o.Calls {
		fmt.Fprintf(&b, " [identifier %s key %s arrived %s age %s client gone %t]", c.Identifier, c.IdempotencyKey,
			c.Arrived.UTC().Format("15:04:05.000000"), c.Age.Round(time.Microsecond), c.ClientGone)
	}
	return b.String()
}

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
	l.buckets = map[bucketKey]*bucket{}
	l.inflight = map[flightKey][]*flight{}
	l.limited = map[string]map[RateLimitKey]int{}
	l.locked = map[string]int{}
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

// Unheard returns how many meter-event, stream and adjustment calls
// succeeded while their client had already gone, during Faults.ReplyDelay:
// calls carried out whose client never learnt it.
func (s *Server) Unheard() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lim.unheard
}

// HeldSuccesses returns how many successful meter-event, stream and
// adjustment answers the simulator is holding at this moment
// (Faults.ReplyDelay): calls carried out whose client has not heard yet.
// A crash test kills its client while one is held.
func (s *Server) HeldSuccesses() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lim.holding
}

// Overlaps returns the first overlaps of v1 meter-event calls for one
// account, customer and event name (up to 50): what
// [Server.MaxConcurrentPerKey] counts, call by call.
func (s *Server) Overlaps() []Overlap {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.lim.overlaps)
}

// RateLimited returns how many calls of account (both modes) were answered
// 429 rate_limit so far, by limiter (the Limiter constants) and endpoint.
func (s *Server) RateLimited(account string) map[RateLimitKey]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[RateLimitKey]int{}
	for k, n := range s.lim.limited[account] {
		out[k] = n
	}
	return out
}

// LockTimeouts returns how many v1 meter-event calls of account (both
// modes) were answered 429 lock_timeout so far (Faults.LockTimeouts).
func (s *Server) LockTimeouts(account string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lim.locked[account]
}

func (l *limiter) limitsOf(account string) Limits {
	if lim, ok := l.perAccount[account]; ok {
		return lim
	}
	return l.defaults
}

// take takes a token at now from the bucket k, which fills at rate per
// second up to burst (0: rate rounded down, at least 1). A rate of 0 means
// no limit.
func (l *limiter) take(k bucketKey, rate float64, burst int, now time.Time) bool {
	if rate <= 0 {
		return true
	}
	size := float64(burst)
	if size == 0 {
		size = max(1, math.Floor(rate))
	}
	b := l.buckets[k]
	if b == nil {
		b = &bucket{tokens: size, last: now}
		l.buckets[k] = b
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

// limit returns the 429 of limiter for a call of account to endpoint and
// counts it.
func (l *limiter) limit(account, limiter, endpoint string) *apiError {
	m := l.limited[account]
	if m == nil {
		m = map[RateLimitKey]int{}
		l.limited[account] = m
	}
	m[RateLimitKey{Limiter: limiter, Endpoint: endpoint}]++
	e := errRateLimit()
	e.rateLimitedReason = rateLimitedReasons[limiter]
	return e
}

// rateLimitedReasons are the Stripe-Rate-Limited-Reason values Stripe
// documents (https://docs.stripe.com/rate-limits, "Rate limited requests":
// global-concurrency, global-rate, endpoint-concurrency, endpoint-rate,
// resource-specific) for the simulator's limiters. Which one Stripe gives
// for the meter-event limits is not documented; the nearest is taken. An
// injected rate-limit fault stands for a limiter too.
var rateLimitedReasons = map[string]string{
	LimiterBasic:       "global-rate",
	LimiterEndpoint:    "endpoint-rate",
	LimiterMeterEvents: "endpoint-rate",
	LimiterStream:      "endpoint-rate",
	LimiterConcurrency: "resource-specific",
	LimiterFault:       "global-rate",
}

// decision is what the gate does with one call: err is answered at once;
// the rest is the fate of a meter-event call that passed, carried out by
// the gate (lose) and the execute layer (the others).
type decision struct {
	err                               *apiError
	delay, replyDelay                 time.Duration
	hang, fail, failAfter, lose, drop bool
	dropP                             float64 // the stream's per-event AsyncDrop
}

// decisionOf returns the gate's decision on a meter-event call, and
// whether there is one (other calls have none).
func decisionOf(r *http.Request) (decision, bool) {
	d, ok := r.Context().Value(planKey).(decision)
	return d, ok
}

// errLockTimeout is Stripe's answer to a call that timed out waiting for an
// object's lock (https://docs.stripe.com/rate-limits, "Object lock
// timeouts"): not a limiter's, so without Stripe-Rate-Limited-Reason, and
// not executed, so nothing is kept for its key.
func errLockTimeout() *apiError {
	e := errInvalid(http.StatusTooManyRequests, "lock_timeout", "",
		"This object cannot be accessed right now because another API request or Stripe process is currently accessing it. "+
			"If you see this error intermittently, retry the request. If you see this error frequently and are making multiple "+
			"concurrent requests to a single object, make your requests serially or at a lower rate.")
	e.notExecuted = true
	return e
}

func errRateLimit() *apiError {
	e := errInvalid(http.StatusTooManyRequests, "rate_limit", "",
		"Request rate limit exceeded. You can learn more about rate limits here https://stripe.com/docs/rate-limits.")
	e.notExecuted = true
	return e
}

// basicLocked takes a token of the account's basic bucket for the mode,
// and for endpoint from its endpoint bucket unless it is a meter-event
// endpoint; it returns the 429 when one is missing.
func (l *limiter) basicLocked(c caller, lim Limits, endpoint string, meterEvents bool, now time.Time) *apiError {
	if !l.take(bucketKey{limiter: LimiterBasic, account: c.account, livemode: c.livemode}, lim.BasicRatePerSecond, lim.BasicBurst, now) {
		return l.limit(c.account, LimiterBasic, endpoint)
	}
	if !meterEvents && !l.take(bucketKey{limiter: LimiterEndpoint, account: c.account, livemode: c.livemode, endpoint: endpoint},
		lim.EndpointRatePerSecond, lim.EndpointBurst, now) {
		return l.limit(c.account, LimiterEndpoint, endpoint)
	}
	return nil
}

// admitCall applies the basic and endpoint limits to a call other than a
// meter event, and the read fault to a GET.
func (s *Server) admitCall(c caller, method, endpoint string) *apiError {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := &s.lim
	lim := l.limitsOf(c.account)
	if e := l.basicLocked(c, lim, endpoint, false, time.Now()); e != nil {
		return e
	}
	if method != http.MethodGet || !l.roll(lim.Faults.ReadFault) {
		return nil
	}
	if l.roll(0.5) {
		return l.limit(c.account, LimiterFault, endpoint)
	}
	return errServer("An unknown error occurred. (stripesim: Faults.ReadFault)")
}

// admit counts a v1 meter-event call in flight and decides its fate: the
// basic limit in test mode or for a connected account, the v1 bucket, the
// one-call-per-customer rule, the rate-limit fault and the customer's lock
// timeouts, then the other faults. The caller must call release once the call is answered.
func (s *Server) admit(c caller, r *http.Request, endpoint string) (d decision, release func()) {
	form := r.Form
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
	now := time.Now()
	f := &flight{identifier: form.Get("identifier"), idemKey: r.Header.Get("Idempotency-Key"), start: now, ctx: r.Context()}
	release = func() { s.land(key, f) }
	l.inflight[key] = append(l.inflight[key], f)
	n := len(l.inflight[key])
	l.maxFlight = max(l.maxFlight, n)
	if n > 1 && len(l.overlaps) < maxOverlaps {
		o := Overlap{Account: key.account, Customer: key.customer, EventName: key.eventName}
		for _, g := range l.inflight[key] {
			o.Calls = append(o.Calls, FlightCall{Identifier: g.identifier, IdempotencyKey: g.idemKey,
				Arrived: g.start, Age: now.Sub(g.start), ClientGone: g.ctx.Err() != nil})
		}
		l.overlaps = append(l.overlaps, o)
	}

	if !c.livemode || c.connect {
		d.err = l.basicLocked(c, lim, endpoint, true, now)
	}
	switch {
	case d.err != nil:
	case !l.take(bucketKey{limiter: LimiterMeterEvents, account: c.account}, lim.RatePerSecond, lim.Burst, now):
		d.err = l.limit(c.account, LimiterMeterEvents, endpoint)
	case lim.OneCallPerCustomerMeter && n > 1:
		d.err = l.limit(c.account, LimiterConcurrency, endpoint)
		d.err.Message = fmt.Sprintf("Too many concurrent requests for customer '%s' and event_name '%s': send one meter event at a time for each customer and meter.",
			key.customer, key.eventName)
	case l.roll(lim.Faults.RateLimitFault):
		d.err = l.limit(c.account, LimiterFault, endpoint)
	case l.roll(lim.Faults.LockTimeouts[key.customer]):
		l.locked[c.account]++
		d.err = errLockTimeout()
	}
	if d.err != nil {
		return d, release
	}
	l.rollFaults(&d, lim.Faults)
	d.drop = l.roll(lim.Faults.AsyncDrop)
	return d, release
}

// rollFaults draws the latency and the hang, fail, lose and fail-after
// faults of one call that passed the rate limits, in this order.
func (l *limiter) rollFaults(d *decision, f Faults) {
	d.delay = f.Latency
	if f.LatencyJitter > 0 {
		d.delay += time.Duration(l.rng.Int64N(int64(f.LatencyJitter)))
	}
	d.hang, d.fail = l.roll(f.Hang), l.roll(f.FailBeforeRecord)
	d.lose = l.roll(f.LoseReply)
	d.failAfter = l.roll(f.FailAfterRecord)
	d.replyDelay = f.ReplyDelay
}

// admitAdjustment decides the fate of a meter event adjustment: the basic
// and endpoint limits of any API call, the rate-limit fault, then the
// faults of a meter-event call but AsyncDrop. An adjustment is not counted
// in flight: the one-call-per-customer rule is the meter events'.
func (s *Server) admitAdjustment(c caller, endpoint string) decision {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := &s.lim
	lim := l.limitsOf(c.account)
	var d decision
	if d.err = l.basicLocked(c, lim, endpoint, false, time.Now()); d.err != nil {
		return d
	}
	if l.roll(lim.Faults.RateLimitFault) {
		d.err = l.limit(c.account, LimiterFault, endpoint)
		return d
	}
	l.rollFaults(&d, lim.Faults)
	return d
}

// admitStream decides the fate of one v2 stream request: the basic limit
// in test mode or for a connected account, its own token bucket and the faults of the account, drawn
// like v1's but for the whole request; AsyncDrop is left to the handler,
// per event. The stream has no one-call-per-customer rule and is not
// counted in flight.
func (s *Server) admitStream(c caller, endpoint string) decision {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := &s.lim
	lim := l.limitsOf(c.account)
	var d decision
	now := time.Now()
	if !c.livemode || c.connect {
		d.err = l.basicLocked(c, lim, endpoint, true, now)
	}
	switch {
	case d.err != nil:
	case !l.take(bucketKey{limiter: LimiterStream, account: c.account}, lim.StreamRatePerSecond, lim.StreamBurst, now):
		d.err = l.limit(c.account, LimiterStream, endpoint)
	case l.roll(lim.Faults.RateLimitFault):
		d.err = l.limit(c.account, LimiterFault, endpoint)
	}
	if d.err != nil {
		return d
	}
	l.rollFaults(&d, lim.Faults)
	d.dropP = lim.Faults.AsyncDrop
	return d
}

// land removes the call f from the calls in flight for key.
func (s *Server) land(key flightKey, f *flight) {
	s.mu.Lock()
	defer s.mu.Unlock()
	calls := slices.DeleteFunc(s.lim.inflight[key], func(g *flight) bool { return g == f })
	if len(calls) == 0 {
		delete(s.lim.inflight, key)
		return
	}
	s.lim.inflight[key] = calls
}

// discardWriter swallows a response whose reply is lost or replaced.
type discardWriter struct{ header http.Header }

func (w *discardWriter) Header() http.Header         { return w.header }
func (w *discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (w *discardWriter) WriteHeader(int)             {}

// endpointOf names the endpoint of r as Stripe counts endpoints for rate
// limits: its method and route pattern, or its path when no route matches.
func (s *Server) endpointOf(r *http.Request) string {
	if p := s.mux.Find(chi.NewRouteContext(), r.Method, r.URL.Path); p != "" {
		return r.Method + " " + p
	}
	return r.Method + " " + r.URL.Path
}

// gate applies the account's rate limits to every authenticated call, the
// read fault to GETs, and to meter-event calls (v1 and the v2 stream) and
// adjustments their own limits and the rate-limit, lose-reply and
// reply-delay faults. It runs in front of
// the idempotency layer, so that a rate-limited call keeps nothing for its
// key, and a lost reply's answer is kept for it. The other faults it draws
// are carried out by the execute layer, behind the idempotency layer.
func (s *Server) gate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, endpoint := callerOf(r), s.endpointOf(r)
		var d decision
		switch {
		case r.Method == http.MethodPost && r.URL.Path == meterEventsPath:
			var release func()
			d, release = s.admit(c, r, endpoint)
			defer release()
		case r.Method == http.MethodPost && r.URL.Path == streamPath:
			d = s.admitStream(c, endpoint)
		case r.Method == http.MethodPost && r.URL.Path == adjustmentsPath:
			d = s.admitAdjustment(c, endpoint)
		default:
			if e := s.admitCall(c, r.Method, endpoint); e != nil {
				writeError(w, e)
				return
			}
			next.ServeHTTP(w, r)
			return
		}
		if d.err != nil {
			writeError(w, d.err)
			return
		}
		r = r.WithContext(context.WithValue(r.Context(), planKey, d))
		if d.lose {
			next.ServeHTTP(&discardWriter{header: http.Header{}}, r)
			writeError(w, &apiError{Status: http.StatusBadGateway, Type: typeAPI,
				Message: "Bad gateway. (stripesim: Faults.LoseReply)"})
			return
		}
		if d.replyDelay > 0 {
			s.delayReply(w, r, next, d.replyDelay)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// delayReply serves r into a buffer, then writes the answer after delay
// unless the client gave up (or the simulator closed) meanwhile: a success
// it never hears is counted (Unheard).
func (s *Server) delayReply(w http.ResponseWriter, r *http.Request, next http.Handler, delay time.Duration) {
	buf := &bufferWriter{header: http.Header{}}
	next.ServeHTTP(buf, r)
	if buf.status >= 200 && buf.status < 300 {
		s.mu.Lock()
		s.lim.holding++
		s.mu.Unlock()
		defer func() {
			s.mu.Lock()
			s.lim.holding--
			s.mu.Unlock()
		}()
	}
	t := time.NewTimer(delay)
	defer t.Stop()
	select {
	case <-t.C:
	case <-r.Context().Done():
		if buf.status >= 200 && buf.status < 300 {
			s.mu.Lock()
			s.lim.unheard++
			s.mu.Unlock()
		}
		return
	case <-s.closed:
	}
	for k, v := range buf.header {
		w.Header()[k] = v
	}
	w.WriteHeader(buf.status)
	_, _ = w.Write(buf.body.Bytes())
}

// bufferWriter keeps an answer to write later.
type bufferWriter struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (w *bufferWriter) Header() http.Header { return w.header }
func (w *bufferWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.body.Write(b)
}
func (w *bufferWriter) WriteHeader(status int) {
	if w.status == 0 {
		w.status = status
	}
}

// execute carries out, behind the idempotency layer, the faults the gate
// drew for a meter-event or adjustment call that is executed (a replay never gets here):
// latency and the hang before it executes, whose 500 to a client that gave
// up is not kept; FailBeforeRecord, a kept 500 instead of executing; and
// FailAfterRecord, a kept 500 after executing. Both 500s carry
// Stripe-Should-Retry: false, as Stripe's do when its idempotency layer
// would replay them.
func (s *Server) execute(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d, ok := decisionOf(r)
		if !ok {
			next.ServeHTTP(w, r)
			return
		}
		ctx := r.Context()
		if d.delay > 0 {
			t := time.NewTimer(d.delay)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				writeError(w, errHeld("stripesim: the client gave up during the simulated latency."))
				return
			}
		}
		if d.hang {
			select {
			case <-ctx.Done():
			case <-s.closed:
			}
			writeError(w, errHeld("stripesim: the request was held until the client gave up (Faults.Hang)."))
			return
		}
		switch {
		case d.fail:
			w.Header().Set("Stripe-Should-Retry", "false")
			writeError(w, errServer("An unknown error occurred. (stripesim: Faults.FailBeforeRecord)"))
		case d.failAfter:
			next.ServeHTTP(&discardWriter{header: http.Header{}}, r)
			w.Header().Set("Stripe-Should-Retry", "false")
			writeError(w, errServer("An unknown error occurred. (stripesim: Faults.FailAfterRecord)"))
		default:
			next.ServeHTTP(w, r)
		}
	})
}
