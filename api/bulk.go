package api

import (
	"fmt"
	"net/http"

	"github.com/tallymeter/tally/quarantine"
)

// bulkRequeueRequest is the body of POST /v1/quarantine/requeue: the
// quarantine report's filters (empty matches everything), the page and
// whether only to look. Any other field is refused.
type bulkRequeueRequest struct {
	Reason  string `json:"reason"`
	Tenant  string `json:"tenant"`
	Feature string `json:"feature"`
	Period  string `json:"period"`
	// After is the next_after of the call before.
	After int64 `json:"after"`
	// Limit is 1 to quarantine.MaxBulkLimit; quarantine.DefaultBulkLimit
	// when absent.
	Limit  *int `json:"limit"`
	DryRun bool `json:"dry_run"`
	// AcceptPeriodClosed sends the matching items whose billing period's
	// invoice has closed, knowingly; without it they are refused
	// period_closed.
	AcceptPeriodClosed bool `json:"accept_period_closed"`
}

// requeueMatching is POST /v1/quarantine/requeue: every quarantined item
// the filters match (a page of them, by id) requeued under the current
// mappings, each item in its own transaction and audited as the token, or
// with dry_run what that would do. It answers 200 with each item's action
// (requeued, readdressed, or refused with its code) and the totals; a
// refusal is an answer, not an error.
func (h *handlers) requeueMatching(w http.ResponseWriter, r *http.Request) {
	if !onlyParams(w, r) {
		return
	}
	var in bulkRequeueRequest
	if !decodeJSON(w, r, &in) {
		return
	}
	f := quarantine.Filter{Reason: in.Reason, Tenant: in.Tenant, Feature: in.Feature, Period: in.Period}
	if !validFilter(w, f) {
		return
	}
	req := quarantine.BulkRequest{Filter: f, After: in.After, DryRun: in.DryRun, By: by(r),
		Options: quarantine.RequeueOptions{AcceptPeriodClosed: in.AcceptPeriodClosed}}
	if in.Limit != nil {
		if *in.Limit < 1 || *in.Limit > quarantine.MaxBulkLimit {
			WriteError(w, http.StatusBadRequest, "invalid_limit", fmt.Sprintf("limit must be 1 to %d", quarantine.MaxBulkLimit))
			return
		}
		req.Limit = *in.Limit
	}
	if in.After < 0 {
		WriteError(w, http.StatusBadRequest, "invalid_after", "after must be an item id: the next_after of the call before")
		return
	}
	res, err := h.Requeuer.RequeueMatching(r.Context(), h.Pool, req)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}
