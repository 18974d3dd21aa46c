package api

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// Metrics are the API's own series; none carries a tenant label.
type Metrics struct {
	ingestEvents    *prometheus.CounterVec
	ingestRequests  *prometheus.CounterVec
	ingestThrottled *prometheus.CounterVec
}

// NewMetrics registers the API's metrics on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		ingestEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_ingest_events_total",
			Help: "Usage events posted, by result: accepted (stored) or duplicate (stored before).",
		}, []string{"result"}),
		ingestRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_ingest_requests_total",
			Help: "POST /v1/usage requests, by result code.",
		}, []string{"result"}),
		ingestThrottled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_ingest_throttled_total",
			Help: "POST /v1/usage requests refused by a quota, by reason: events (a token's events a second), requests (its requests a second), quarantine_cap (the quarantined items one request may make).",
		}, []string{"reason"}),
	}
	for _, c := range []prometheus.Collector{m.ingestEvents, m.ingestRequests, m.ingestThrottled} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	// Every known label value at 0, so that a scrape shows the series (and
	// a dashboard's rate() has a baseline) before the first request.
	for _, r := range []string{throttledEvents, throttledRequests, throttledQuarantineCap} {
		m.ingestThrottled.WithLabelValues(r)
	}
	for _, r := range []string{"accepted", "duplicate"} {
		m.ingestEvents.WithLabelValues(r)
	}
	for _, r := range []string{"accepted", "invalid", "forbidden", "too_large", "throttled", "error"} {
		m.ingestRequests.WithLabelValues(r)
	}
	return m, nil
}

func (m *Metrics) request(result string) {
	if m != nil {
		m.ingestRequests.WithLabelValues(result).Inc()
	}
}

// postUsage is POST /v1/usage: the token's request budget is checked, the
// batch decoded, checked against the token's tenants, its permission to
// post corrections (negative values) and its events budget, and ingested
// by meter.Ingester.Post in a READ COMMITTED transaction — shared with
// other small batches posted at the same time (group commit), answered
// only once it committed; any problem of this batch stores nothing of it
// and fails no other.
func (h *handlers) postUsage(w http.ResponseWriter, r *http.Request) {
	token := principal(r).TokenID
	if wait, ok := h.quotas.admitRequest(token); !ok {
		h.throttle(w, throttledRequests, wait, fmt.Sprintf("this token may make %g requests a second to this node; nothing was stored", h.Quota.RequestsPerSecond))
		return
	}
	events, ok := h.decodeUsage(w, r)
	if !ok {
		return
	}
	if denied := deniedTenants(principal(r), events); denied > 0 {
		h.Metrics.request("forbidden")
		WriteError(w, http.StatusForbidden, "forbidden_tenant", fmt.Sprintf("this token may not post usage for %d of the batch's tenants; nothing was stored", denied))
		return
	}
	if corrections := deniedCorrections(principal(r), events); corrections > 0 {
		h.Metrics.request("forbidden")
		WriteError(w, http.StatusForbidden, "corrections_not_allowed", fmt.Sprintf("this token may not post corrections (negative values), "+
			"and %d of the batch's events are; nothing was stored: use a token made with tally tokens create --corrections", corrections))
		return
	}
	wait, ok, possible, refund := h.quotas.takeEvents(token, len(events))
	switch {
	case !possible:
		h.Metrics.request("too_large")
		WriteError(w, http.StatusRequestEntityTooLarge, "batch_too_large",
			fmt.Sprintf("a batch is at most %d events from one token (TALLY_INGEST_EVENTS_BURST)", h.quotas.cfg.EventsBurst))
		return
	case !ok:
		h.throttle(w, throttledEvents, wait, fmt.Sprintf("this token may post %g events a second to this node (a burst of %d); nothing was stored",
			h.Quota.EventsPerSecond, h.quotas.cfg.EventsBurst))
		return
	}
	res, err := h.Ingester.Post(r.Context(), h.Pool, events)
	var (
		invalid *meter.InvalidBatchError
		capped  *meter.QuarantineCapError
	)
	if err != nil {
		refund() // nothing was stored: the batch costs the token nothing
	}
	if errors.As(err, &invalid) {
		h.Metrics.request("invalid")
		writeProblems(w, "invalid_batch", problemsCounted(len(invalid.Problems))+"; nothing was stored", invalid.Problems)
		return
	}
	if errors.As(err, &capped) {
		h.Metrics.request("throttled")
		h.Metrics.throttled(throttledQuarantineCap)
		writeProblems(w, "too_many_quarantined", fmt.Sprintf("the batch would make %d quarantined items, more than the %d one request may; "+
			"nothing was stored: map its features and tenants first, or send less usage Stripe will not take", capped.Items, capped.Max),
			quarantineProblems(capped))
		return
	}
	if err != nil {
		h.Metrics.request("error")
		h.internal(w, r, err)
		return
	}
	h.Metrics.request("accepted")
	if h.Metrics != nil {
		h.Metrics.ingestEvents.WithLabelValues("accepted").Add(float64(res.Accepted))
		h.Metrics.ingestEvents.WithLabelValues("duplicate").Add(float64(res.Duplicates))
	}
	writeJSON(w, http.StatusAccepted, res)
}

// throttle answers 429 for a quota and counts it.
func (h *handlers) throttle(w http.ResponseWriter, reason string, wait time.Duration, message string) {
	h.Metrics.request("throttled")
	h.Metrics.throttled(reason)
	writeThrottled(w, wait, message)
}

// quarantineProblems are a quarantine cap's refusal as problems of the
// batch: one per reason, with its count, in reason order.
func quarantineProblems(e *meter.QuarantineCapError) []meter.Problem {
	reasons := make([]string, 0, len(e.Reasons))
	for r := range e.Reasons {
		reasons = append(reasons, string(r))
	}
	slices.Sort(reasons)
	ps := make([]meter.Problem, 0, len(reasons))
	for _, r := range reasons {
		ps = append(ps, meter.Problem{Field: "events", Reason: fmt.Sprintf("%d would be quarantined as %s", e.Reasons[outbox.Reason(r)], r)})
	}
	return ps
}

// decodeUsage reads a usage batch; when it cannot, it answers (and counts
// the request) and returns false.
func (h *handlers) decodeUsage(w http.ResponseWriter, r *http.Request) ([]meter.Event, bool) {
	dec := meter.Decoder{MaxEvents: h.quotas.cfg.MaxEvents}
	if r.ContentLength > meter.MaxBodyBytes {
		h.Metrics.request("too_large")
		WriteError(w, http.StatusRequestEntityTooLarge, "batch_too_large",
			fmt.Sprintf("a batch is at most %d events and %d bytes", dec.MaxEvents, meter.MaxBodyBytes))
		return nil, false
	}
	events, err := dec.Decode(http.MaxBytesReader(w, r.Body, meter.MaxBodyBytes+1), time.Now())
	var (
		invalid *meter.InvalidBatchError
		mbe     *http.MaxBytesError
	)
	switch {
	case err == nil:
		return events, true
	case errors.Is(err, meter.ErrTooLarge):
		h.Metrics.request("too_large")
		WriteError(w, http.StatusRequestEntityTooLarge, "batch_too_large",
			fmt.Sprintf("a batch is at most %d events and %d bytes", dec.MaxEvents, meter.MaxBodyBytes))
	case errors.Is(err, meter.ErrMalformed):
		h.Metrics.request("invalid")
		WriteError(w, http.StatusBadRequest, "invalid_json", err.Error())
	case errors.As(err, &invalid):
		h.Metrics.request("invalid")
		writeProblems(w, "invalid_batch", problemsCounted(len(invalid.Problems))+"; nothing was stored", invalid.Problems)
	case errors.As(err, &mbe):
		h.Metrics.request("too_large")
		WriteError(w, http.StatusRequestEntityTooLarge, "batch_too_large", fmt.Sprintf("a batch is at most %d bytes", meter.MaxBodyBytes))
	default:
		h.Metrics.request("error")
		WriteError(w, http.StatusBadRequest, "unreadable_body", "the body could not be read")
	}
	return nil, false
}

// deniedCorrections counts the batch's corrections (negative values)
// when the principal may not post any; zero when it may.
func deniedCorrections(p auth.Principal, events []meter.Event) int {
	if p.MayCorrect() {
		return 0
	}
	n := 0
	for _, ev := range events {
		if ev.Value < 0 {
			n++
		}
	}
	return n
}

// deniedTenants counts the batch's tenants the principal may not post
// usage for.
func deniedTenants(p auth.Principal, events []meter.Event) int {
	denied := map[string]bool{}
	for _, ev := range events {
		if !p.MayPostFor(ev.Tenant) {
			denied[ev.Tenant] = true
		}
	}
	return len(denied)
}
