package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/mappings"
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
		if id, err = reconcile.Queue(r.Context(), tx, reconcile.TriggerAPI, principal(r).Name, opts); err != nil {
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
	id, err := strconv.ParseInt(chi.URLParam(r, "id"), 10, 64)
	if err != nil || id <= 0 {
		WriteError(w, http.StatusBadRequest, "invalid_id", "the run id must be a positive integer")
		return
	}
	run, err := reconcile.Get(r.Context(), h.Pool, id)
	if errors.Is(err, reconcile.ErrNotFound) {
		WriteError(w, http.StatusNotFound, "not_found", "no such run")
		return
	}
	if err != nil {
		h.internal(w, r, err)
		return
	}
	ds, err := reconcile.Discrepancies(r.Context(), h.Pool, id)
	if err != nil {
		h.internal(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, runView{Run: run, DiscrepancyList: ds})
}
