package api

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

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
	format := q.Get("format")
	if format != "" && format != "json" && format != "csv" {
		WriteError(w, http.StatusBadRequest, "invalid_format", "format must be json or csv")
		return
	}
	var refresh bool
	switch q.Get("refresh") {
	case "", "false", "0":
	case "true", "1":
		refresh = true
	default:
		WriteError(w, http.StatusBadRequest, "invalid_refresh", "refresh must be true or false")
		return
	}
	if format == "csv" {
		c, err := h.Reports.Completeness(r.Context(), h.Pool, period, q.Get("tenant"), refresh)
		if err != nil {
			h.internal(w, r, err)
			return
		}
		writeCompletenessCSV(w, c)
		return
	}
	body, err := h.Reports.CompletenessJSON(r.Context(), h.Pool, period, q.Get("tenant"), refresh)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(body)
}

// writeCompletenessCSV answers the completeness report as a CSV download.
func writeCompletenessCSV(w http.ResponseWriter, c quarantine.Completeness) {
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	w.Header().Set("Content-Disposition", fmt.Sprintf(`attachment; filename="tally-completeness-%s.csv"`, c.Period))
	w.Header().Set("Cache-Control", "no-store")
	_ = c.CSV(w)
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
