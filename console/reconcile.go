package console

import (
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/reconcile"
)

// reconcilePageData is what the reconciliation page shows: the latest runs
// and, on a run's page, that run with its discrepancies and plan.
type reconcilePageData struct {
	Runs          []reconcile.Run
	Run           *reconcile.Run
	Discrepancies []reconcile.Discrepancy
	Plan          reconcile.Plan
	Settle        string
}

func (c *Console) reconcilePage(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	runs, err := reconcile.List(ctx, c.pool, 30)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	data := reconcilePageData{Runs: runs, Settle: c.Settle.String()}
	if s := chi.URLParam(r, "id"); s != "" {
		id, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			http.NotFound(w, r)
			return
		}
		run, err := reconcile.Get(ctx, c.pool, id)
		if errors.Is(err, reconcile.ErrNotFound) {
			http.NotFound(w, r)
			return
		}
		if err != nil {
			c.fail(w, r, err)
			return
		}
		data.Run = &run
		if data.Discrepancies, err = reconcile.Discrepancies(ctx, c.pool, id); err != nil {
			c.fail(w, r, err)
			return
		}
		if data.Plan, err = reconcile.PlanOf(ctx, c.pool, c.Outbox, id); err != nil {
			c.fail(w, r, err)
			return
		}
	}
	c.render(w, r, "reconcile", "Reconciliation", data)
}

func (c *Console) startRun(w http.ResponseWriter, r *http.Request) {
	if c.Reconcile == nil {
		back(w, r, "/console/reconcile", "no_stripe")
		return
	}
	settle, err := time.ParseDuration(strings.TrimSpace(r.PostFormValue("settle")))
	if err != nil || settle < 0 {
		back(w, r, "/console/reconcile", "invalid_settle")
		return
	}
	err = pgx.BeginFunc(r.Context(), c.pool, func(tx pgx.Tx) error {
		id, err := reconcile.Queue(r.Context(), tx, reconcile.TriggerAPI, actor(r), reconcile.Options{Settle: settle})
		if err != nil {
			return err
		}
		return c.Reconcile(r.Context(), tx, id)
	})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	back(w, r, "/console/reconcile", "run_queued")
}
