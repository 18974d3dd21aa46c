package api

import (
	"net/http"
	"strconv"

	"github.com/go-chi/chi/v5"

	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/quarantine"
)

// listInvoiceChecks answers the invoice checks of a month, a tenant, or
// both: those open (differing, unresolved) unless status says otherwise.
func (h *handlers) listInvoiceChecks(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	for k := range q {
		if k != "period" && k != "tenant" && k != "status" {
			WriteError(w, http.StatusBadRequest, "unknown_filter", "unknown query parameter "+strconv.Quote(k)+": period, tenant and status are known")
			return
		}
	}
	f := invoices.Filter{Period: q.Get("period"), Tenant: q.Get("tenant"), Status: q.Get("status")}
	if f.Period != "" {
		if _, _, err := quarantine.ParsePeriod(f.Period); err != nil {
			WriteError(w, http.StatusBadRequest, "invalid_period", "period must be a month, YYYY-MM")
			return
		}
	}
	checks, err := invoices.List(r.Context(), h.Pool, f)
	if err != nil {
		h.refuse(w, r, err)
		return
	}
	if f.Status == "" {
		f.Status = invoices.ListOpen
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": f.Status, "checks": checks})
}

func checkID(w http.ResponseWriter, r *http.Request) (int64, bool) {
	id, err := strconv.ParseInt(chi.URLParam(r, "id"), 10, 64)
	if err != nil || id <= 0 {
		WriteError(w, http.StatusBadRequest, "invalid_id", "the check id must be a positive integer")
		return 0, false
	}
	return id, true
}

func (h *handlers) getInvoiceCheck(w http.ResponseWriter, r *http.Request) {
	id, ok := checkID(w, r)
	if !ok {
		return
	}
	c, err := invoices.Get(r.Context(), h.Pool, id)
	if err != nil {
		h.refuse(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, c)
}

// resolveInvoiceCheck records finance's decision on a check that differs.
func (h *handlers) resolveInvoiceCheck(w http.ResponseWriter, r *http.Request) {
	id, ok := checkID(w, r)
	if !ok {
		return
	}
	in, ok := decodeResolution(w, r, func(reason string) bool { return invoices.ResolutionReason(reason).Valid() },
		"credited_in_stripe, invoiced_separately, accept_stripe or accept_tally")
	if !ok {
		return
	}
	c, err := invoices.Resolve(r.Context(), h.Pool, id, invoices.Decision{Reason: invoices.ResolutionReason(in.Reason), Note: in.Note, By: by(r)})
	if err != nil {
		h.refuse(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, c)
}

// listInvoiceGates answers the invoice gates: the open ones (a draft not
// yet proven complete, or held), or with status=all every one of the last
// 100 days.
func (h *handlers) listInvoiceGates(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	for k := range q {
		if k != "status" {
			WriteError(w, http.StatusBadRequest, "unknown_filter", "unknown query parameter "+strconv.Quote(k)+": status is known")
			return
		}
	}
	status := q.Get("status")
	if status == "" {
		status = "open"
	}
	if status != "open" && status != "all" {
		WriteError(w, http.StatusUnprocessableEntity, "invalid_status", "status must be open or all")
		return
	}
	gates, err := invoices.Gates(r.Context(), h.Pool, status == "all")
	if err != nil {
		h.refuse(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": status, "gates": gates})
}
