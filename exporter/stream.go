package exporter

import (
	"context"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// What Stripe's v2 meter event stream takes.
const (
	// StreamMaxEvents is the most events one stream request may carry.
	StreamMaxEvents = 100
	// DefaultStreamLiveRate and DefaultStreamTestRate are the stream's
	// default rates in events a second (a request of n events takes n):
	// Stripe's pages say both 10,000 requests and 10,000 events a second
	// live, and Tally reads the safer, below 10,000 events; an operator
	// may raise it. In test mode the requests count toward the basic
	// limit, like v1's calls, which bounds them first: the default is the
	// events of the basic bucket's 20 full requests a second.
	DefaultStreamLiveRate = 9000
	DefaultStreamTestRate = 2000
	// sessionMargin is how long before its expiry a session is replaced.
	sessionMargin = time.Minute
	// sessionTries bounds how often one send renews an expired session.
	sessionTries = 3
)

// BatchExporter is an exporter that sends several items in one request. The
// deliverer hands it at most MaxBatch leased items at a time.
type BatchExporter interface {
	Exporter
	// MaxBatch is the most items one SendBatch takes.
	MaxBatch() int
	// SendBatch sends the items and returns one outcome per item, in order
	// (their Lease is set by the caller). It calls wait with the number of
	// events before every request it makes to the provider — the
	// destination's flow control — and never retries a request the provider
	// may have processed.
	SendBatch(ctx context.Context, items []outbox.Lease, wait func(ctx context.Context, events int) error) []outbox.Outcome
}

// StripeStream is the v2 meter event stream exporter: events go in batches
// of up to 100 to POST /v2/billing/meter_event_stream on the meter-events
// host, authenticated by a meter event session that it creates with the API
// key (POST /v2/billing/meter_event_session, on the destination account),
// keeps, and replaces a minute before it expires; an expired-session answer
// (nothing processed) replaces it and sends the same request again.
//
// Every event carries the item's identifier, payload and timestamp, the
// same bytes on every attempt; the batch an event travels in may differ
// from one attempt to the next. A 2xx accepts every event of the request:
// Stripe validates the events afterwards and reports failures as error
// reports (see reconcile.RecordReport). A request refused as a whole for its
// content (400) was processed for no event, so it is split in halves until
// the refused events stand alone and are classified one by one as v1's
// answers are. Every other answer (401/403, 409, 429, 5xx, no answer) is
// the outcome of every event of the request, classified as v1's.
type StripeStream struct {
	client  *stripeapi.Client
	timeout time.Duration
	now     func() time.Time // the local clock the session's renewal is timed on

	header func(account string) string // the Stripe-Account rule (ForAccounts); nil: none

	mu sync.Mutex
	// sess holds a session per Stripe-Account header ("" for the client's
	// own account): a session acts on the account it was created on.
	sess map[string]*streamSession
	// creating serialises the creation of each account's session, so that
	// concurrent senders of one account wait for one creation while a slow
	// or refused creation for one account never holds up another's sends.
	creating map[string]*sync.Mutex

	sessions prometheus.Counter
}

// streamSession is a meter event session: a client authenticating with its
// token, and when to replace it (on the local monotonic clock).
type streamSession struct {
	sc      *stripe.Client
	renewAt time.Time
}

// NewStripeStream returns the stream exporter over client; timeout 0 means
// DefaultRequestTimeout. It bounds one SendBatch: session renewals, and
// the requests of a split, included.
func NewStripeStream(client *stripeapi.Client, timeout time.Duration) *StripeStream {
	if timeout <= 0 {
		timeout = DefaultRequestTimeout
	}
	return &StripeStream{client: client, timeout: timeout, now: time.Now, sess: map[string]*streamSession{}, creating: map[string]*sync.Mutex{},
		sessions: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_stream_sessions_total",
			Help: "Meter event sessions created for the v2 stream (one every ~14 minutes, more after expired-session answers).",
		})}
}

// ForAccounts makes the exporter send each item on a session created with
// the Stripe-Account header header gives its destination account ("" for
// none); see StripeV1.ForAccounts. It returns e.
func (e *StripeStream) ForAccounts(header func(account string) string) *StripeStream {
	e.header = header
	return e
}

// Collector is the exporter's session counter, to register.
func (e *StripeStream) Collector() prometheus.Collector { return e.sessions }

// Name is StripeMeterEventStream.
func (e *StripeStream) Name() string { return StripeMeterEventStream }

// DedupWindow is Stripe's 24 hours, as for v1.
func (e *StripeStream) DedupWindow() time.Duration { return StripeDedupWindow }

// Accepts is Stripe's 35 days back, 5 minutes ahead, as for v1.
func (e *StripeStream) Accepts() (past, future time.Duration) {
	return StripeAcceptPast, StripeAcceptFuture
}

// MaxBatch is StreamMaxEvents.
func (e *StripeStream) MaxBatch() int { return StreamMaxEvents }

// Send sends one item alone.
func (e *StripeStream) Send(ctx context.Context, item outbox.Lease) outbox.Outcome {
	return e.SendBatch(ctx, []outbox.Lease{item}, nil)[0]
}

// StreamEvent is an item's event on the stream, the same on every attempt.
func StreamEvent(p outbox.Payload) *stripe.V2BillingMeterEventStreamCreateEventParams {
	return &stripe.V2BillingMeterEventStreamCreateEventParams{
		EventName:  stripe.String(p.EventName),
		Identifier: stripe.String(p.Identifier),
		Payload:    payloadOf(p),
		Timestamp:  stripe.Time(time.Unix(p.Timestamp, 0).UTC()),
	}
}

// SendBatch sends the items in one request, or in several when Stripe
// refuses the request for its content.
func (e *StripeStream) SendBatch(ctx context.Context, items []outbox.Lease, wait func(context.Context, int) error) []outbox.Outcome {
	ctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	out := make([]outbox.Outcome, len(items))
	if len(items) == 0 {
		return out
	}
	// A session acts on one account: a batch of several accounts' items
	// (the deliverer sends none) goes as one request per account.
	start := 0
	for i := 1; i <= len(items); i++ {
		if i == len(items) || items[i].DestinationAccount != items[start].DestinationAccount {
			e.send(ctx, headerOf(e.header, items[start].DestinationAccount), items[start:i], out[start:i], wait)
			start = i
		}
	}
	return out
}

// send posts items, all for the account of the Stripe-Account header
// account ("" for the client's own), and writes their outcomes into out.
func (e *StripeStream) send(ctx context.Context, account string, items []outbox.Lease, out []outbox.Outcome, wait func(context.Context, int) error) {
	o, status := e.post(ctx, account, items, wait)
	if len(items) > 1 && refusedWhole(status) {
		// Nothing of the request was processed: find the refused events.
		mid := len(items) / 2
		e.send(ctx, account, items[:mid], out[:mid], wait)
		e.send(ctx, account, items[mid:], out[mid:], wait)
		return
	}
	for i := range out {
		out[i] = o
	}
}

// refusedWhole reports whether a stream request's status is Stripe refusing
// it for what it carries — any 4xx but the key's (401, 403), the endpoint's
// (404), a conflict (409) or the rate limit (429) — which processed none of
// its events, whatever the message or code says (even a duplicate, v1's
// words or v2's duplicate_meter_event, which would otherwise read as
// success for every event of it: split, the event Stripe has is accepted
// alone).
func refusedWhole(status int) bool {
	switch status {
	case http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound, http.StatusConflict, http.StatusTooManyRequests:
		return false
	}
	return status >= 400 && status < 500
}

// post makes one stream request for items and classifies its answer; it
// also returns the request's status (0 when none came back or nothing was
// sent).
func (e *StripeStream) post(ctx context.Context, account string, items []outbox.Lease, wait func(context.Context, int) error) (outbox.Outcome, int) {
	params := &stripe.V2BillingMeterEventStreamCreateParams{Events: make([]*stripe.V2BillingMeterEventStreamCreateEventParams, len(items))}
	for i, l := range items {
		params.Events[i] = StreamEvent(l.Payload)
	}
	for try := 1; ; try++ {
		sess, sresp, err := e.session(ctx, account)
		if err != nil {
			// Nothing was sent: the session could not be had.
			o := Classify(answerOf(sresp, err))
			o.Refused = true
			if o.Kind != outbox.RateLimited && !refusedKeyOrAccount(o.Error.Code) {
				o.Kind, o.Error.Code = outbox.Retry, "stream_session"
			}
			return o, 0
		}
		if wait != nil {
			if err := wait(ctx, len(items)); err != nil {
				return outbox.Outcome{Kind: outbox.Retry, Refused: true,
					Error: outbox.ErrorInfo{Code: "limiter", Message: "the rate limiter gave no slot before the deadline"}}, 0
			}
		}
		rctx, resp := stripeapi.WithResponse(ctx)
		err = sess.sc.V2BillingMeterEventStreams.Create(rctx, params)
		if resp.Status == http.StatusUnauthorized {
			// The stream refused the token — expired (Stripe's
			// temporary_session_expired) or not — so it processed nothing:
			// renew the session. (A key Stripe refuses shows when the
			// session is created; a 401 of the stream itself is the
			// session's, never reported as the key's.)
			e.forget(account, sess)
			if try < sessionTries {
				continue
			}
			return outbox.Outcome{Kind: outbox.Retry, Refused: true, Error: outbox.ErrorInfo{Code: "stream_session", Status: resp.Status,
				Message: "the stream refused the meter event session again right after it was renewed"}}, resp.Status
		}
		return Classify(answerOf(resp, err)), resp.Status
	}
}

// session returns the current session of the account (a Stripe-Account
// header, "" for the client's own), creating one when there is none or it
// is due for replacement. Concurrent senders wait for one creation.
func (e *StripeStream) session(ctx context.Context, account string) (*streamSession, *stripeapi.Response, error) {
	if s := e.current(account); s != nil {
		return s, nil, nil
	}
	e.mu.Lock()
	create := e.creating[account]
	if create == nil {
		create = &sync.Mutex{}
		e.creating[account] = create
	}
	e.mu.Unlock()
	create.Lock()
	defer create.Unlock()
	if s := e.current(account); s != nil {
		return s, nil, nil // another sender created it meanwhile
	}
	started := e.now()
	rctx, resp := stripeapi.WithResponse(ctx)
	params := &stripe.V2BillingMeterEventSessionCreateParams{}
	if account != "" {
		params.SetStripeAccount(account)
	}
	ms, err := e.client.Stripe().V2BillingMeterEventSessions.Create(rctx, params)
	if err == nil && (ms.AuthenticationToken == "" || !ms.ExpiresAt.After(ms.Created)) {
		err = &stripeapi.Error{Code: stripeapi.CodeBadResponse}
	}
	if err != nil {
		if resp.Status >= 200 && resp.Status < 300 {
			resp.Status = 0 // an unreadable session is no session
		}
		return nil, resp, err
	}
	// The session's lifetime by Stripe's own clock, counted from when the
	// request went out on ours, less a margin (less half of it for a short
	// session).
	life := ms.ExpiresAt.Sub(ms.Created)
	margin := min(sessionMargin, life/2)
	s := &streamSession{sc: e.client.SessionClient(ms.AuthenticationToken), renewAt: started.Add(life - margin)}
	e.mu.Lock()
	e.sess[account] = s
	e.mu.Unlock()
	e.sessions.Inc()
	return s, resp, nil
}

// current is the account's session while it is not due for replacement,
// else nil.
func (e *StripeStream) current(account string) *streamSession {
	e.mu.Lock()
	defer e.mu.Unlock()
	if s := e.sess[account]; s != nil && e.now().Before(s.renewAt) {
		return s
	}
	return nil
}

// forget drops s if it is still the account's current session.
func (e *StripeStream) forget(account string, s *streamSession) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sess[account] == s {
		delete(e.sess, account)
	}
}
