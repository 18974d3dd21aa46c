package api

import (
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tallymeter/tally/mappings"
)

// mappingError answers a mapping the mappings package refused with the
// refusal's code, as the CLI and the console show it: 422 (503 when Stripe
// could not be asked), with the fields of malformed input; any other error
// as refuse does.
func (h *handlers) mappingError(w http.ResponseWriter, r *http.Request, err error) {
	if refusal, ok := mappings.RefusalOf(err); ok {
		switch {
		case refusal.Unavailable:
			WriteError(w, http.StatusServiceUnavailable, refusal.Code, refusal.Message)
		case refusal.Fields != nil:
			writeProblems(w, refusal.Code, refusal.Message, refusal.Fields)
		default:
			WriteError(w, http.StatusUnprocessableEntity, refusal.Code, refusal.Message)
		}
		return
	}
	h.refuse(w, r, err)
}

type featureView struct {
	mappings.Feature
	History []mappings.Feature `json:"history,omitempty"`
	Changed *bool              `json:"changed,omitempty"`
	// Warning, on a PUT, is mappings.UncheckedWarning when the node has
	// no Stripe key to check the mapping against.
	Warning string `json:"warning,omitempty"`
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
	writeJSON(w, http.StatusOK, featureView{Feature: f, Changed: &changed, Warning: h.Mappings.Warning()})
}

type tenantView struct {
	mappings.Tenant
	History []mappings.Tenant `json:"history,omitempty"`
	Changed *bool             `json:"changed,omitempty"`
	// Warning is as featureView's.
	Warning string `json:"warning,omitempty"`
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
	// The anchor and the grace arrive as text, so that a bad one is a field
	// problem (422), as the window of a feature. Absent or null, each is
	// unset: calendar months, the node's TALLY_INVOICE_GRACE. The account
	// is optional like a feature's exporter: absent, null or empty is the
	// node's destination (a PUT sets the whole mapping, so leaving it out
	// of a mapping that named one goes back to the node's).
	var raw struct {
		StripeCustomerID string  `json:"stripe_customer_id"`
		StripeAccount    *string `json:"stripe_account"`
		PeriodAnchor     *string `json:"period_anchor"`
		InvoiceGrace     *string `json:"invoice_grace"`
	}
	if !decodeJSON(w, r, &raw) {
		return
	}
	in := mappings.TenantInput{StripeCustomerID: raw.StripeCustomerID}
	if raw.StripeAccount != nil {
		in.StripeAccount = *raw.StripeAccount
	}
	if raw.PeriodAnchor != nil {
		a, err := time.Parse(time.RFC3339, *raw.PeriodAnchor)
		if err != nil {
			writeProblems(w, "invalid_mapping", "period_anchor: not RFC 3339",
				[]mappings.FieldError{{Field: "period_anchor", Reason: "an RFC 3339 time, e.g. 2026-01-15T00:00:00Z"}})
			return
		}
		in.PeriodAnchor = &a
	}
	if raw.InvoiceGrace != nil {
		g, err := time.ParseDuration(*raw.InvoiceGrace)
		if err != nil {
			writeProblems(w, "invalid_mapping", "invoice_grace: not a duration",
				[]mappings.FieldError{{Field: "invoice_grace", Reason: "a Go duration from 0s to 72h in whole seconds, e.g. 1h, 90m, 72h"}})
			return
		}
		grace := mappings.Duration(g)
		in.InvoiceGrace = &grace
	}
	t, changed, err := h.Mappings.PutTenant(r.Context(), h.Pool, chi.URLParam(r, "tenant"), in, by(r))
	if err != nil {
		h.mappingError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, tenantView{Tenant: t, Changed: &changed, Warning: h.Mappings.Warning()})
}
