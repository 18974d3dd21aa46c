package api

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// filterOf reads the quarantine filters of a query.
func filterOf(q url.Values) quarantine.Filter {
	return quarantine.Filter{Reason: q.Get("reason"), Tenant: q.Get("tenant"), Feature: q.Get("feature"), Period: q.Get("period")}
}

// validFilter refuses (400) a quarantine filter with a malformed period or
// a reason that is none of the outbox's.
func validFilter(w http.ResponseWriter, f quarantine.Filter) bool {
	if f.Period != "" {
		if _, _, err := quarantine.ParsePeriod(f.Period); err != nil {
			WriteError(w, http.StatusBadRequest, "invalid_period", "period must be YYYY-MM")
			return false
		}
	}
	if f.Reason != "" && !slices.Contains(outbox.Reasons, outbox.Reason(f.Reason)) {
		names := make([]string, len(outbox.Reasons))
		for i, r := range outbox.Reasons {
			names[i] = string(r)
		}
		WriteError(w, http.StatusBadRequest, "invalid_reason", "reason must be one of "+strings.Join(names, ", "))
		return false
	}
	return true
}

// csvFormat reads the format parameter: json (the default) or csv.
func csvFormat(w http.ResponseWriter, q url.Values) (csv, ok bool) {
	switch q.Get("format") {
	case "", "json":
		return false, true
	case "csv":
		return true, true
	}
	WriteError(w, http.StatusBadRequest, "invalid_format", "format must be json or csv")
	return false, false
}

// csvHeaders are the headers of a CSV download named name.
func csvHeaders(w http.ResponseWriter, name string) {
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	w.Header().Set("Content-Disposition", `attachment; filename="`+name+`"`)
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Content-Type-Options", "nosniff")
}

func (h *handlers) getQuarantine(w http.ResponseWriter, r *http.Request) {
	if !onlyParams(w, r, "reason", "tenant", "feature", "period", "format") {
		return
	}
	q := r.URL.Query()
	f := filterOf(q)
	if !validFilter(w, f) {
		return
	}
	asCSV, ok := csvFormat(w, q)
	if !ok {
		return
	}
	rep, err := quarantine.Quarantined(r.Context(), h.Pool, f)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	if asCSV {
		csvHeaders(w, "tally-quarantine.csv")
		_ = rep.CSV(w)
		return
	}
	writeJSON(w, http.StatusOK, rep)
}

// quarantinedItemView is a quarantined item as GET /v1/quarantine/items
// shows it.
type quarantinedItemView struct {
	ID       int64  `json:"id"`
	Reason   string `json:"reason"`
	Tenant   string `json:"tenant"`
	Feature  string `json:"feature"`
	Customer string `json:"customer"`
	// Account is the destination account the item was staged for.
	Account string `json:"destination_account"`
	Period  string `json:"period"`
	Value   string `json:"value"`
	// LastError is as stored: sanitised when written.
	LastError             *outbox.ErrorInfo `json:"last_error,omitempty"`
	MappingVersion        int               `json:"mapping_version"`
	CurrentMappingVersion int               `json:"current_mapping_version"`
}

// Pages of GET /v1/quarantine/items as JSON.
const (
	quarantineItemsPage    = 100
	quarantineItemsMaxPage = 1000
)

// getQuarantineItems is GET /v1/quarantine/items: the quarantined items
// one by one, with the report's filters; as JSON a page at a time (limit,
// after, next_after), as CSV every matching item at once, up to
// quarantine.MaxItemsCSV (more is refused: narrow the filters).
func (h *handlers) getQuarantineItems(w http.ResponseWriter, r *http.Request) {
	if !onlyParams(w, r, "reason", "tenant", "feature", "period", "format", "limit", "after") {
		return
	}
	q := r.URL.Query()
	f := filterOf(q)
	if !validFilter(w, f) {
		return
	}
	asCSV, ok := csvFormat(w, q)
	if !ok {
		return
	}
	if asCSV {
		if q.Has("limit") || q.Has("after") {
			WriteError(w, http.StatusBadRequest, "invalid_parameter", "the CSV holds every matching item: narrow it with reason, tenant, feature or period, not limit or after")
			return
		}
		h.quarantineItemsCSV(w, r, f)
		return
	}
	limit, after := quarantineItemsPage, int64(0)
	var err error
	if s := q.Get("limit"); s != "" {
		if limit, err = strconv.Atoi(s); err != nil || limit < 1 || limit > quarantineItemsMaxPage {
			WriteError(w, http.StatusBadRequest, "invalid_limit", fmt.Sprintf("limit must be 1 to %d", quarantineItemsMaxPage))
			return
		}
	}
	if s := q.Get("after"); s != "" {
		if after, err = strconv.ParseInt(s, 10, 64); err != nil || after < 0 {
			WriteError(w, http.StatusBadRequest, "invalid_after", "after must be an item id")
			return
		}
	}
	items, err := quarantine.ItemsAfter(r.Context(), h.Pool, f, after, limit)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	views := make([]quarantinedItemView, len(items))
	for i, it := range items {
		views[i] = quarantinedItemView{ID: it.ID, Reason: it.Reason, Tenant: it.Tenant, Feature: it.Feature, Customer: it.Customer, Account: it.Account,
			Period: it.Period, Value: it.Value, MappingVersion: it.ItemVersion, CurrentMappingVersion: it.CurrentVersion}
		if it.LastError != (outbox.ErrorInfo{}) {
			views[i].LastError = &it.LastError
		}
	}
	out := map[string]any{"items": views}
	if len(items) == limit {
		out["next_after"] = items[len(items)-1].ID // a full page: there may be more
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *handlers) quarantineItemsCSV(w http.ResponseWriter, r *http.Request, f quarantine.Filter) {
	items, err := quarantine.Items(r.Context(), h.Pool, f, quarantine.MaxItemsCSV+1)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	if len(items) > quarantine.MaxItemsCSV {
		WriteError(w, http.StatusUnprocessableEntity, "too_many_items", fmt.Sprintf(
			"more than %d items match: narrow the CSV with reason, tenant, feature or period", quarantine.MaxItemsCSV))
		return
	}
	csvHeaders(w, "tally-quarantine-items.csv")
	_ = quarantine.ItemsCSV(w, items)
}

func (h *handlers) getCompleteness(w http.ResponseWriter, r *http.Request) {
	if !onlyParams(w, r, "period", "tenant", "format", "refresh") {
		return
	}
	q := r.URL.Query()
	period := q.Get("period")
	if _, _, err := quarantine.ParsePeriod(period); err != nil {
		WriteError(w, http.StatusBadRequest, "invalid_period", "period is required, as YYYY-MM")
		return
	}
	asCSV, ok := csvFormat(w, q)
	if !ok {
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
	if asCSV {
		c, err := h.Reports.Completeness(r.Context(), h.Pool, period, q.Get("tenant"), refresh)
		if err != nil {
			h.internal(w, r, err)
			return
		}
		csvHeaders(w, "tally-completeness-"+c.Period+".csv")
		_ = c.CSV(w)
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

// getCompletenessAudit answers the latest audit of a month's completeness
// counters (quarantine.LatestAudit): one row.
func (h *handlers) getCompletenessAudit(w http.ResponseWriter, r *http.Request) {
	if !onlyParams(w, r, "period") {
		return
	}
	period := r.URL.Query().Get("period")
	if _, _, err := quarantine.ParsePeriod(period); err != nil {
		WriteError(w, http.StatusBadRequest, "invalid_period", "period is required, as YYYY-MM")
		return
	}
	a, ok, err := quarantine.LatestAudit(r.Context(), h.Pool, period)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	if !ok {
		WriteError(w, http.StatusNotFound, "not_found", "the month was never audited")
		return
	}
	writeJSON(w, http.StatusOK, a)
}

func (h *handlers) requeue(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(w, r)
	if !ok {
		return
	}
	var in struct {
		MappingVersion *int `json:"mapping_version"`
		// AcceptPeriodClosed sends usage whose billing period's invoice
		// has closed, knowingly (quarantine.RequeueOptions).
		AcceptPeriodClosed bool `json:"accept_period_closed"`
	}
	if !decodeJSON(w, r, &in) {
		return
	}
	if in.MappingVersion == nil {
		writeProblems(w, "invalid_request", "mapping_version is required", []mappings.FieldError{{Field: "mapping_version", Reason: "required"}})
		return
	}
	res, err := h.Requeuer.RequeueWith(r.Context(), h.Pool, id, *in.MappingVersion, by(r),
		quarantine.RequeueOptions{AcceptPeriodClosed: in.AcceptPeriodClosed})
	if err != nil {
		h.requeueError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

func (h *handlers) requeueError(w http.ResponseWriter, r *http.Request, err error) {
	// A requeue refuses an item in another state as not quarantined, the
	// name its API has always given it.
	var se *outbox.StateError
	if errors.As(err, &se) && !errors.Is(err, outbox.ErrMappingChanged) {
		WriteError(w, http.StatusConflict, "not_quarantined", fmt.Sprintf("the item is %s, not quarantined", se.Current))
		return
	}
	h.refuse(w, r, err)
}
