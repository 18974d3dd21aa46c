package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// ReconcileDeps are what the reconcile routes need.
type ReconcileDeps struct {
	// Enabled is false without a Stripe key: there is nothing to reconcile
	// against.
	Enabled bool
	// Settle is the default settle delay of a requested run.
	Settle time.Duration
	// Enqueue schedules the River job that works a queued run, inside the
	// transaction that queued it.
	Enqueue func(ctx context.Context, tx pgx.Tx, runID int64) error
}

// runView is a run with its discrepancies.
type runView struct {
	reconcile.Run
	DiscrepancyList []reconcile.Discrepancy `json:"discrepancy_list"`
}

// postReconcileRun queues a run: 202 with the run; it is worked by a River
// job on some node. Body (optional): {"settle":"2h","since":"RFC 3339"}.
func (h *handlers) postReconcileRun(w http.ResponseWriter, r *http.Request) {
	if h.Reconcile == nil || !h.Reconcile.Enabled {
		WriteError(w, http.StatusConflict, "export_stalled", "no Stripe key is configured: there is nothing to reconcile against")
		return
	}
	var in struct {
		Settle *string    `json:"settle"`
		Since  *time.Time `json:"since"`
	}
	if r.ContentLength != 0 && !decodeJSON(w, r, &in) {
		return
	}
	opts := reconcile.Options{Settle: h.Reconcile.Settle}
	if in.Settle != nil {
		d, err := time.ParseDuration(*in.Settle)
		if err != nil || d < 0 {
			writeProblems(w, "invalid_request", "settle must be a non-negative duration such as 2h",
				[]mappings.FieldError{{Field: "settle", Reason: "invalid"}})
			return
		}
		opts.Settle = d
	}
	if in.Since != nil {
		opts.Since = *in.Since
	}
	var id int64
	err := pgx.BeginFunc(r.Context(), h.Pool, func(tx pgx.Tx) error {
		var err error
		if id, err = reconcile.Queue(r.Context(), tx, reconcile.TriggerAPI, by(r), opts); err != nil {
			return err
		}
		return h.Reconcile.Enqueue(r.Context(), tx, id)
	})
	if err != nil {
		h.internal(w, r, err)
		return
	}
	run, err := reconcile.Get(r.Context(), h.Pool, id)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	w.Header().Set("Location", fmt.Sprintf("/v1/reconcile/runs/%d", id))
	writeJSON(w, http.StatusAccepted, run)
}

func (h *handlers) listReconcileRuns(w http.ResponseWriter, r *http.Request) {
	runs, err := reconcile.List(r.Context(), h.Pool, 50)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	if runs == nil {
		runs = []reconcile.Run{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"runs": runs})
}

func (h *handlers) getReconcileRun(w http.ResponseWriter, r *http.Request) {
	id, ok := runID(w, r)
	if !ok {
		return
	}
	run, err := reconcile.Get(r.Context(), h.Pool, id)
	if err != nil {
		h.refuse(w, r, err)
		return
	}
	ds, err := reconcile.Discrepancies(r.Context(), h.Pool, id)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, runView{Run: run, DiscrepancyList: ds})
}

func runID(w http.ResponseWriter, r *http.Request) (int64, bool) {
	id, err := strconv.ParseInt(chi.URLParam(r, "id"), 10, 64)
	if err != nil || id <= 0 {
		WriteError(w, http.StatusBadRequest, "invalid_id", "the run id must be a positive integer")
		return 0, false
	}
	return id, true
}

// getReconcilePlan is the run's plan, against the items as they are now:
// save it, review it, apply it with `tally recover --plan FILE`.
func (h *handlers) getReconcilePlan(w http.ResponseWriter, r *http.Request) {
	id, ok := runID(w, r)
	if !ok {
		return
	}
	p, err := reconcile.PlanOf(r.Context(), h.Pool, h.Outbox, id)
	if err != nil {
		h.refuse(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, p)
}

// recover is outbox recover: {"expect":"uncertain","to":"accepted|pending|rejected",
// "reason":"…","not_reached":false,"provider_ref":"…","lease_token":N}.
func (h *handlers) recover(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(w, r)
	if !ok {
		return
	}
	var in struct {
		Expect      string `json:"expect"`
		To          string `json:"to"`
		Reason      string `json:"reason"`
		NotReached  bool   `json:"not_reached"`
		ProviderRef string `json:"provider_ref"`
		LeaseToken  *int64 `json:"lease_token"`
	}
	if !decodeJSON(w, r, &in) {
		return
	}
	var problems []mappings.FieldError
	if in.Expect == "" {
		problems = append(problems, mappings.FieldError{Field: "expect", Reason: "required"})
	}
	if in.To == "" {
		problems = append(problems, mappings.FieldError{Field: "to", Reason: "required"})
	}
	if len(problems) > 0 {
		writeProblems(w, "invalid_request", "expect and to are required", problems)
		return
	}
	it, err := reconcile.Recover(r.Context(), h.Pool, h.Outbox, id, reconcile.Recovery{
		Expect: outbox.State(in.Expect), To: outbox.State(in.To), Reason: in.Reason, NotReached: in.NotReached,
		ProviderRef: in.ProviderRef, LeaseToken: in.LeaseToken, By: by(r)})
	var se *reconcile.ExpectedStateError
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, ViewOf(it))
	case errors.As(err, &se):
		status, code, _ := problemOf(err)
		writeJSON(w, status, map[string]any{"error": map[string]any{
			"code": code, "message": se.Error(), "current_state": se.Current}})
	default:
		h.refuse(w, r, err)
	}
}

func (h *handlers) listAudit(w http.ResponseWriter, r *http.Request) {
	entries, err := audit.List(r.Context(), h.Pool, r.URL.Query().Get("subject"), 200)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"entries": entries})
}

// listDiscrepancies lists discrepancies, Stripe-has-more first: ?run=N
// (default: the current ones of every run) and ?status=open|resolved|all
// (default open).
func (h *handlers) listDiscrepancies(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	for k := range q {
		if k != "run" && k != "status" {
			WriteError(w, http.StatusBadRequest, "unknown_filter", "unknown query parameter "+strconv.Quote(k)+": run and status are known")
			return
		}
	}
	var run int64
	if s := q.Get("run"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n <= 0 {
			WriteError(w, http.StatusBadRequest, "invalid_run", "run must be a positive integer")
			return
		}
		run = n
	}
	status, err := reconcile.ParseStatus(q.Get("status"))
	if err != nil {
		WriteError(w, http.StatusBadRequest, "invalid_status", "status must be open, resolved or all")
		return
	}
	run, ds, err := reconcile.ListDiscrepancies(r.Context(), h.Pool, run, status)
	if err != nil {
		h.refuse(w, r, err)
		return
	}
	var runID *int64
	if run != 0 {
		runID = &run
	}
	writeJSON(w, http.StatusOK, map[string]any{"run": runID, "status": status, "discrepancies": ds})
}

func discrepancyID(w http.ResponseWriter, r *http.Request) (int64, bool) {
	id, err := strconv.ParseInt(chi.URLParam(r, "id"), 10, 64)
	if err != nil || id <= 0 {
		WriteError(w, http.StatusBadRequest, "invalid_id", "the discrepancy id must be a positive integer")
		return 0, false
	}
	return id, true
}

func (h *handlers) getDiscrepancy(w http.ResponseWriter, r *http.Request) {
	id, ok := discrepancyID(w, r)
	if !ok {
		return
	}
	d, err := reconcile.GetDiscrepancy(r.Context(), h.Pool, id)
	if err != nil {
		h.refuse(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, d)
}

// resolveDiscrepancy resolves a discrepancy: {"reason":
// "credited_in_stripe|reposted|accept_stripe|accept_tally", "note": "…"}.
// Its accepted items are confirmed and the resolution audited, in one
// transaction; 200 with the discrepancy resolved.
func (h *handlers) resolveDiscrepancy(w http.ResponseWriter, r *http.Request) {
	id, ok := discrepancyID(w, r)
	if !ok {
		return
	}
	in, ok := decodeResolution(w, r, func(reason string) bool { return reconcile.ResolutionReason(reason).Valid() },
		"credited_in_stripe, reposted, accept_stripe or accept_tally")
	if !ok {
		return
	}
	d, err := reconcile.Resolve(r.Context(), h.Pool, h.Outbox, id,
		reconcile.Decision{Reason: reconcile.ResolutionReason(in.Reason), Note: in.Note, By: by(r)})
	var moved *reconcile.ItemsMovedError
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, d)
	case errors.As(err, &moved):
		status, code, _ := problemOf(err)
		writeJSON(w, status, map[string]any{"error": map[string]any{"code": code,
			"message": "items of the discrepancy are no longer accepted or confirmed: run reconcile again and resolve what it finds",
			"items":   moved.Items}})
	default:
		h.refuse(w, r, err)
	}
}

// resolution is finance's decision as a resolve request carries it.
type resolution struct {
	Reason string `json:"reason"`
	Note   string `json:"note"`
}

// decodeResolution reads a resolve request: a reason valid says is one of
// the fixed set (reasons, in words), and a note. Anything else is answered
// 422 invalid_resolution, naming each field.
func decodeResolution(w http.ResponseWriter, r *http.Request, valid func(string) bool, reasons string) (resolution, bool) {
	var in resolution
	if !decodeJSON(w, r, &in) {
		return in, false
	}
	var problems []mappings.FieldError
	if !valid(in.Reason) {
		problems = append(problems, mappings.FieldError{Field: "reason", Reason: "must be " + reasons})
	}
	if strings.TrimSpace(in.Note) == "" {
		problems = append(problems, mappings.FieldError{Field: "note", Reason: "required"})
	}
	if len(problems) > 0 {
		writeProblems(w, "invalid_resolution", "a reason from the fixed set and a note are required", problems)
		return in, false
	}
	return in, true
}
