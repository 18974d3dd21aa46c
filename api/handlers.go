package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
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

type handlers struct {
	*Deps
	log *slog.Logger
}

// maxJSONBody bounds every JSON body but a usage batch.
const maxJSONBody = 64 << 10

func (h *handlers) routes(r chi.Router) {
	// Stripe's event destination is authenticated by its Stripe-Signature;
	// every other /v1 route needs a token, and so do unknown ones, which
	// answer 401 before 404 or 405.
	r.Post(stripeEventsPath, h.stripeEvents)
	r.NotFound(h.authenticate(http.HandlerFunc(notFound)).ServeHTTP)
	r.MethodNotAllowed(h.authenticate(http.HandlerFunc(methodNotAllowed)).ServeHTTP)
	r.Group(h.authenticated)
}

func (h *handlers) authenticated(r chi.Router) {
	r.Use(h.authenticate)
	r.With(require(auth.RoleIngest)).Post("/usage", h.postUsage)

	r.Group(func(r chi.Router) {
		r.Use(require(auth.RoleFinance))
		r.Get("/mappings/features", h.listFeatures)
		r.Get("/mappings/features/{feature}", h.getFeature)
		r.Get("/mappings/tenants", h.listTenants)
		r.Get("/mappings/tenants/{tenant}", h.getTenant)
		r.Get("/quarantine", h.getQuarantine)
		r.Get("/reports/completeness", h.getCompleteness)
		r.Get("/outbox/summary", h.getSummary)
		r.Get("/outbox/items", h.listItems)
		r.Get("/outbox/items/{id}", h.getItem)
		r.Get("/reconcile/runs", h.listReconcileRuns)
		r.Get("/reconcile/runs/{id}", h.getReconcileRun)
		r.Get("/reconcile/runs/{id}/plan", h.getReconcilePlan)
		r.Get("/audit", h.listAudit)
	})
	r.Group(func(r chi.Router) {
		r.Use(require(auth.RoleOperator))
		r.Put("/mappings/features/{feature}", h.putFeature)
		r.Put("/mappings/tenants/{tenant}", h.putTenant)
		r.Post("/outbox/items/{id}/requeue", h.requeue)
		r.Post("/reconcile/runs", h.postReconcileRun)
		r.Post("/outbox/items/{id}/recover", h.recover)
	})
}

// internal answers 500 and logs the error with the request id; the body says
// nothing of it.
func (h *handlers) internal(w http.ResponseWriter, r *http.Request, err error) {
	h.log.ErrorContext(r.Context(), "request failed", "method", r.Method, "route", chi.RouteContext(r.Context()).RoutePattern(),
		"request_id", middleware.GetReqID(r.Context()), "error", err)
	WriteError(w, http.StatusInternalServerError, "internal", "the server failed; the request id is in the logs: "+middleware.GetReqID(r.Context()))
}

// decodeJSON reads a small JSON body strictly: unknown fields are an error.
func decodeJSON(w http.ResponseWriter, r *http.Request, v any) bool {
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxJSONBody))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			WriteError(w, http.StatusRequestEntityTooLarge, "body_too_large", fmt.Sprintf("the body is over %d bytes", maxJSONBody))
			return false
		}
		WriteError(w, http.StatusBadRequest, "invalid_json", "the body is not the expected JSON: "+err.Error())
		return false
	}
	if dec.More() {
		WriteError(w, http.StatusBadRequest, "invalid_json", "the body holds more than one JSON value")
		return false
	}
	return true
}

func (h *handlers) postUsage(w http.ResponseWriter, r *http.Request) {
	if r.ContentLength > meter.MaxBodyBytes {
		h.Metrics.request("too_large")
		WriteError(w, http.StatusRequestEntityTooLarge, "batch_too_large",
			fmt.Sprintf("a batch is at most %d events and %d bytes", meter.MaxEvents, meter.MaxBodyBytes))
		return
	}
	events, err := meter.Decode(http.MaxBytesReader(w, r.Body, meter.MaxBodyBytes+1), time.Now())
	var invalid *meter.InvalidBatchError
	switch {
	case errors.Is(err, meter.ErrTooLarge):
		h.Metrics.request("too_large")
		WriteError(w, http.StatusRequestEntityTooLarge, "batch_too_large",
			fmt.Sprintf("a batch is at most %d events and %d bytes", meter.MaxEvents, meter.MaxBodyBytes))
		return
	case errors.Is(err, meter.ErrMalformed):
		h.Metrics.request("invalid")
		WriteError(w, http.StatusBadRequest, "invalid_json", err.Error()[len("meter: "):])
		return
	case errors.As(err, &invalid):
		h.Metrics.request("invalid")
		writeProblems(w, "invalid_batch", fmt.Sprintf("%d problems; nothing was stored", len(invalid.Problems)), invalid.Problems)
		return
	case err != nil:
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			h.Metrics.request("too_large")
			WriteError(w, http.StatusRequestEntityTooLarge, "batch_too_large", fmt.Sprintf("a batch is at most %d bytes", meter.MaxBodyBytes))
			return
		}
		h.Metrics.request("error")
		WriteError(w, http.StatusBadRequest, "unreadable_body", "the body could not be read")
		return
	}
	p := principal(r)
	denied := map[string]bool{}
	for _, ev := range events {
		if !p.MayPostFor(ev.Tenant) {
			denied[ev.Tenant] = true
		}
	}
	if len(denied) > 0 {
		h.Metrics.request("forbidden")
		WriteError(w, http.StatusForbidden, "forbidden_tenant", fmt.Sprintf("this token may not post usage for %d of the batch's tenants; nothing was stored", len(denied)))
		return
	}
	var res meter.Result
	err = pgx.BeginTxFunc(r.Context(), h.Pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		res, err = h.Ingester.Ingest(r.Context(), tx, events)
		return err
	})
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

func by(r *http.Request) string { return "token:" + principal(r).Name }

func (h *handlers) mappingError(w http.ResponseWriter, r *http.Request, err error) {
	var (
		ve *mappings.ValidationError
		me *mappings.MeterError
		pu *mappings.ErrProviderUnavailable
	)
	switch {
	case errors.As(err, &pu):
		WriteError(w, http.StatusServiceUnavailable, "stripe_unavailable",
			fmt.Sprintf("the mapping could not be checked against Stripe's meters (%s, status %d); try again", pu.Code, pu.Status))
	case errors.As(err, &ve):
		writeProblems(w, "invalid_mapping", ve.Error()[len("mappings: "):], ve.Fields)
	case errors.As(err, &me):
		WriteError(w, http.StatusUnprocessableEntity, me.Code, me.Message)
	case errors.Is(err, mappings.ErrNotFound):
		WriteError(w, http.StatusNotFound, "not_found", "no such mapping")
	default:
		h.internal(w, r, err)
	}
}

type featureView struct {
	mappings.Feature
	History []mappings.Feature `json:"history,omitempty"`
	Changed *bool              `json:"changed,omitempty"`
}

func (h *handlers) listFeatures(w http.ResponseWriter, r *http.Request) {
	fs, err := h.Mappings.Features(r.Context(), h.Pool)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"features": fs})
}

func (h *handlers) getFeature(w http.ResponseWriter, r *http.Request) {
	name := chi.URLParam(r, "feature")
	f, err := h.Mappings.GetFeature(r.Context(), h.Pool, name)
	if err != nil {
		h.mappingError(w, r, err)
		return
	}
	hist, err := h.Mappings.FeatureHistory(r.Context(), h.Pool, name)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, featureView{Feature: f, History: hist})
}

func (h *handlers) putFeature(w http.ResponseWriter, r *http.Request) {
	// The window arrives as text so that a bad one is a field problem (422),
	// like every other bad field, not a malformed body. The exporter is
	// optional: absent or empty is the node's default (TALLY_EXPORTER); a
	// PUT sets the whole mapping, so leaving it out of a mapping that named
	// one goes back to the default. The payload keys are not part of the
	// body (an unknown field): the mapping takes them from the Stripe meter
	// with the event name (Stripe's defaults without a Stripe key).
	var raw struct {
		EventName   string               `json:"event_name"`
		Aggregation mappings.Aggregation `json:"aggregation"`
		Window      *string              `json:"window"`
		Exporter    string               `json:"exporter"`
	}
	if !decodeJSON(w, r, &raw) {
		return
	}
	in := mappings.FeatureInput{EventName: raw.EventName, Aggregation: raw.Aggregation, Exporter: raw.Exporter}
	if raw.Window != nil {
		if err := in.Window.UnmarshalText([]byte(*raw.Window)); err != nil {
			writeProblems(w, "invalid_mapping", "window: not a duration",
				[]mappings.FieldError{{Field: "window", Reason: "a duration dividing a day, e.g. 15m, 1h, 24h"}})
			return
		}
	}
	f, changed, err := h.Mappings.PutFeature(r.Context(), h.Pool, chi.URLParam(r, "feature"), in, by(r))
	if err != nil {
		h.mappingError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, featureView{Feature: f, Changed: &changed})
}

type tenantView struct {
	mappings.Tenant
	History []mappings.Tenant `json:"history,omitempty"`
	Changed *bool             `json:"changed,omitempty"`
}

func (h *handlers) listTenants(w http.ResponseWriter, r *http.Request) {
	ts, err := h.Mappings.Tenants(r.Context(), h.Pool)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"tenants": ts})
}

func (h *handlers) getTenant(w http.ResponseWriter, r *http.Request) {
	name := chi.URLParam(r, "tenant")
	t, err := h.Mappings.GetTenant(r.Context(), h.Pool, name)
	if err != nil {
		h.mappingError(w, r, err)
		return
	}
	hist, err := h.Mappings.TenantHistory(r.Context(), h.Pool, name)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, tenantView{Tenant: t, History: hist})
}

func (h *handlers) putTenant(w http.ResponseWriter, r *http.Request) {
	var raw struct {
		StripeCustomerID string  `json:"stripe_customer_id"`
		PeriodAnchor     *string `json:"period_anchor"`
	}
	if !decodeJSON(w, r, &raw) {
		return
	}
	in := mappings.TenantInput{StripeCustomerID: raw.StripeCustomerID}
	if raw.PeriodAnchor != nil {
		a, err := time.Parse(time.RFC3339, *raw.PeriodAnchor)
		if err != nil {
			writeProblems(w, "invalid_mapping", "period_anchor: not RFC 3339",
				[]mappings.FieldError{{Field: "period_anchor", Reason: "an RFC 3339 time, e.g. 2026-01-15T00:00:00Z"}})
			return
		}
		in.PeriodAnchor = &a
	}
	t, changed, err := h.Mappings.PutTenant(r.Context(), h.Pool, chi.URLParam(r, "tenant"), in, by(r))
	if err != nil {
		h.mappingError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, tenantView{Tenant: t, Changed: &changed})
}

func (h *handlers) getQuarantine(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := quarantine.Filter{Reason: q.Get("reason"), Tenant: q.Get("tenant"), Feature: q.Get("feature"), Period: q.Get("period")}
	if f.Period != "" {
		if _, _, err := quarantine.ParsePeriod(f.Period); err != nil {
			WriteError(w, http.StatusBadRequest, "invalid_period", "period must be YYYY-MM")
			return
		}
	}
	format := q.Get("format")
	if format != "" && format != "json" && format != "csv" {
		WriteError(w, http.StatusBadRequest, "invalid_format", "format must be json or csv")
		return
	}
	rep, err := quarantine.Quarantined(r.Context(), h.Pool, f)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	if format == "csv" {
		w.Header().Set("Content-Type", "text/csv; charset=utf-8")
		w.Header().Set("Content-Disposition", `attachment; filename="tally-quarantine.csv"`)
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		_ = rep.CSV(w)
		return
	}
	writeJSON(w, http.StatusOK, rep)
}

func (h *handlers) getCompleteness(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	period := q.Get("period")
	if _, _, err := quarantine.ParsePeriod(period); err != nil {
		WriteError(w, http.StatusBadRequest, "invalid_period", "period is required, as YYYY-MM")
		return
	}
	c, err := quarantine.CompletenessOf(r.Context(), h.Pool, period, q.Get("tenant"))
	if err != nil {
		h.internal(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, c)
}

func (h *handlers) getSummary(w http.ResponseWriter, r *http.Request) {
	g, err := h.Outbox.ReadGauge(r.Context(), h.Pool)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	counts := make(map[string]int64, len(g.Counts))
	for st, n := range g.Counts {
		counts[string(st)] = n
	}
	writeJSON(w, http.StatusOK, map[string]any{"counts": counts, "oldest_pending_age_seconds": g.OldestPendingAgeSeconds})
}

// itemView is an item as the API shows it.
type itemView struct {
	ID                 int64             `json:"id"`
	Tenant             string            `json:"tenant"`
	SubjectKind        string            `json:"subject_kind"`
	SubjectRef         string            `json:"subject_ref"`
	Exporter           string            `json:"exporter"`
	DestinationAccount string            `json:"destination_account"`
	Mode               outbox.Mode       `json:"mode"`
	MappingVersion     int               `json:"mapping_version"`
	Identifier         string            `json:"identifier"`
	Payload            outbox.Payload    `json:"payload"`
	State              outbox.State      `json:"state"`
	Attempts           int               `json:"attempts"`
	LeaseToken         int64             `json:"lease_token"`
	NextAttemptAt      time.Time         `json:"next_attempt_at"`
	FirstAttemptAt     *time.Time        `json:"first_attempt_at,omitempty"`
	ProviderRef        string            `json:"provider_ref,omitempty"`
	AcceptedAt         *time.Time        `json:"accepted_at,omitempty"`
	ConfirmedAt        *time.Time        `json:"confirmed_at,omitempty"`
	LastError          *outbox.ErrorInfo `json:"last_error,omitempty"`
	QuarantineReason   outbox.Reason     `json:"quarantine_reason,omitempty"`
	SupersededBy       *int64            `json:"superseded_by,omitempty"`
	CreatedAt          time.Time         `json:"created_at"`
	UpdatedAt          time.Time         `json:"updated_at"`
	AttemptLog         []outbox.Attempt  `json:"attempt_log,omitempty"`
	Audit              []audit.Entry     `json:"audit,omitempty"`
	// Evidence is what Stripe's meter error reports say of the item.
	Evidence []reconcile.Evidence `json:"evidence,omitempty"`
}

func viewOf(it outbox.Item) itemView {
	return itemView{
		ID: it.ID, Tenant: it.TenantKey, SubjectKind: it.SubjectKind, SubjectRef: it.SubjectRef, Exporter: it.Exporter,
		DestinationAccount: it.DestinationAccount, Mode: it.Mode, MappingVersion: it.MappingVersion,
		Identifier: it.Identifier, Payload: it.Payload, State: it.State, Attempts: it.Attempts, LeaseToken: it.LeaseToken,
		NextAttemptAt: it.NextAttemptAt, FirstAttemptAt: it.FirstAttemptAt, ProviderRef: it.ProviderRef,
		AcceptedAt: it.AcceptedAt, ConfirmedAt: it.ConfirmedAt, LastError: it.LastError,
		QuarantineReason: it.QuarantineReason, SupersededBy: it.SupersededBy, CreatedAt: it.CreatedAt, UpdatedAt: it.UpdatedAt,
	}
}

func (h *handlers) listItems(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := outbox.ListFilter{State: outbox.State(q.Get("state")), Tenant: q.Get("tenant"), Feature: q.Get("feature")}
	if f.State != "" && !validState(f.State) {
		WriteError(w, http.StatusBadRequest, "invalid_state", "state must be one of the outbox states")
		return
	}
	var err error
	if s := q.Get("limit"); s != "" {
		if f.Limit, err = strconv.Atoi(s); err != nil || f.Limit < 1 || f.Limit > 1000 {
			WriteError(w, http.StatusBadRequest, "invalid_limit", "limit must be 1 to 1000")
			return
		}
	}
	if s := q.Get("after"); s != "" {
		if f.After, err = strconv.ParseInt(s, 10, 64); err != nil || f.After < 0 {
			WriteError(w, http.StatusBadRequest, "invalid_after", "after must be an item id")
			return
		}
	}
	items, err := h.Outbox.List(r.Context(), h.Pool, f)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	views := make([]itemView, len(items))
	for i, it := range items {
		views[i] = viewOf(it)
	}
	out := map[string]any{"items": views}
	if limit := max(f.Limit, 100); len(items) == limit || (f.Limit > 0 && len(items) == f.Limit) {
		out["next_after"] = items[len(items)-1].ID // a full page: there may be more
	}
	writeJSON(w, http.StatusOK, out)
}

func validState(s outbox.State) bool {
	for _, st := range outbox.States {
		if s == st {
			return true
		}
	}
	return false
}

func itemID(w http.ResponseWriter, r *http.Request) (int64, bool) {
	id, err := strconv.ParseInt(chi.URLParam(r, "id"), 10, 64)
	if err != nil || id < 1 {
		WriteError(w, http.StatusNotFound, "not_found", "no such item")
		return 0, false
	}
	return id, true
}

func (h *handlers) getItem(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(w, r)
	if !ok {
		return
	}
	it, err := h.Outbox.Get(r.Context(), h.Pool, id)
	if errors.Is(err, outbox.ErrNotFound) {
		WriteError(w, http.StatusNotFound, "not_found", "no such item")
		return
	}
	if err != nil {
		h.internal(w, r, err)
		return
	}
	attempts, err := h.Outbox.Attempts(r.Context(), h.Pool, id)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	trail, err := audit.List(r.Context(), h.Pool, audit.Item(id), 100)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	evidence, err := reconcile.EvidenceOf(r.Context(), h.Pool, []int64{id})
	if err != nil {
		h.internal(w, r, err)
		return
	}
	v := viewOf(it)
	v.AttemptLog = attempts
	v.Audit = trail
	v.Evidence = evidence
	writeJSON(w, http.StatusOK, v)
}

func (h *handlers) requeue(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(w, r)
	if !ok {
		return
	}
	var in struct {
		MappingVersion *int `json:"mapping_version"`
	}
	if !decodeJSON(w, r, &in) {
		return
	}
	if in.MappingVersion == nil {
		writeProblems(w, "invalid_request", "mapping_version is required", []mappings.FieldError{{Field: "mapping_version", Reason: "required"}})
		return
	}
	res, err := h.Requeuer.Requeue(r.Context(), h.Pool, id, *in.MappingVersion, by(r))
	if err != nil {
		h.requeueError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

func (h *handlers) requeueError(w http.ResponseWriter, r *http.Request, err error) {
	var (
		mc *quarantine.MappingChangedError
		se *outbox.StateError
		ie *quarantine.StillIneligibleError
	)
	switch {
	case errors.Is(err, outbox.ErrNotFound):
		WriteError(w, http.StatusNotFound, "not_found", "no such item")
	case errors.As(err, &mc):
		WriteError(w, http.StatusConflict, "mapping_changed", mc.Error()[len("quarantine: "):])
	case errors.As(err, &se):
		WriteError(w, http.StatusConflict, "not_quarantined", fmt.Sprintf("the item is %s, not quarantined", se.Current))
	case errors.As(err, &ie):
		WriteError(w, http.StatusConflict, "still_ineligible", ie.Error()[len("quarantine: "):])
	case errors.Is(err, outbox.ErrMayHaveReached):
		WriteError(w, http.StatusConflict, "may_have_reached", "an attempt of this item may have reached Stripe: it keeps its identifier and cannot be re-addressed; see recovery")
	case errors.Is(err, outbox.ErrNotSendable):
		WriteError(w, http.StatusConflict, "not_sendable", "the item lacks a customer, meter or account; fix the mapping so that it can be re-addressed")
	case errors.Is(err, meter.ErrAggregationChanged):
		WriteError(w, http.StatusConflict, "aggregation_changed", "the feature is now exported per event; a window's item cannot be rebuilt as one item")
	case errors.Is(err, meter.ErrStalled):
		WriteError(w, http.StatusConflict, "export_stalled", "no Stripe destination is configured (STRIPE_API_KEY unset)")
	case errors.Is(err, outbox.ErrSuccessorExists):
		WriteError(w, http.StatusConflict, "successor_exists", "an item with the successor's identity exists already")
	default:
		h.internal(w, r, err)
	}
}
