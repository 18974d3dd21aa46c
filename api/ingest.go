package api

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/meter"
)

// Metrics are the API's own series; none carries a tenant label.
type Metrics struct {
	ingestEvents   *prometheus.CounterVec
	ingestRequests *prometheus.CounterVec
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
	}
	for _, c := range []prometheus.Collector{m.ingestEvents, m.ingestRequests} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *Metrics) request(result string) {
	if m != nil {
		m.ingestRequests.WithLabelValues(result).Inc()
	}
}

// postUsage is POST /v1/usage: a batch is decoded, checked against the
// token's tenants, and ingested in one READ COMMITTED transaction; any
// problem stores nothing.
func (h *handlers) postUsage(w http.ResponseWriter, r *http.Request) {
	events, ok := h.decodeUsage(w, r)
	if !ok {
		return
	}
	if denied := deniedTenants(principal(r), events); denied > 0 {
		h.Metrics.request("forbidden")
		WriteError(w, http.StatusForbidden, "forbidden_tenant", fmt.Sprintf("this token may not post usage for %d of the batch's tenants; nothing was stored", denied))
		return
	}
	var res meter.Result
	err := pgx.BeginTxFunc(r.Context(), h.Pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		var err error
		res, err = h.Ingester.Ingest(r.Context(), tx, events)
		return err
	})
	var invalid *meter.InvalidBatchError
	if errors.As(err, &invalid) {
		h.Metrics.request("invalid")
		writeProblems(w, "invalid_batch", fmt.Sprintf("%d problems; nothing was stored", len(invalid.Problems)), invalid.Problems)
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

// decodeUsage reads a usage batch; when it cannot, it answers (and counts
// the request) and returns false.
func (h *handlers) decodeUsage(w http.ResponseWriter, r *http.Request) ([]meter.Event, bool) {
	if r.ContentLength > meter.MaxBodyBytes {
		h.Metrics.request("too_large")
		WriteError(w, http.StatusRequestEntityTooLarge, "batch_too_large",
			fmt.Sprintf("a batch is at most %d events and %d bytes", meter.MaxEvents, meter.MaxBodyBytes))
		return nil, false
	}
	events, err := meter.Decode(http.MaxBytesReader(w, r.Body, meter.MaxBodyBytes+1), time.Now())
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
			fmt.Sprintf("a batch is at most %d events and %d bytes", meter.MaxEvents, meter.MaxBodyBytes))
	case errors.Is(err, meter.ErrMalformed):
		h.Metrics.request("invalid")
		WriteError(w, http.StatusBadRequest, "invalid_json", err.Error()[len("meter: "):])
	case errors.As(err, &invalid):
		h.Metrics.request("invalid")
		writeProblems(w, "invalid_batch", fmt.Sprintf("%d problems; nothing was stored", len(invalid.Problems)), invalid.Problems)
	case errors.As(err, &mbe):
		h.Metrics.request("too_large")
		WriteError(w, http.StatusRequestEntityTooLarge, "batch_too_large", fmt.Sprintf("a batch is at most %d bytes", meter.MaxBodyBytes))
	default:
		h.Metrics.request("error")
		WriteError(w, http.StatusBadRequest, "unreadable_body", "the body could not be read")
	}
	return nil, false
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
