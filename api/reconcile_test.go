package api_test

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/internal/auth"
)

// POST /v1/reconcile/runs queues a run and its job in one transaction; GET
// shows it. A failure to enqueue leaves no run behind; bad input stores
// nothing.
func TestReconcileRunsAPI(t *testing.T) {
	t.Parallel()
	var (
		mu       sync.Mutex
		enqueued []int64
		fail     bool
	)
	h := newHarnessWith(t, false, &api.ReconcileDeps{Enabled: true, Settle: 90 * time.Minute,
		Enqueue: func(ctx context.Context, tx pgx.Tx, id int64) error {
			mu.Lock()
			defer mu.Unlock()
			if fail {
				return errors.New("the job queue is unavailable")
			}
			// The job is inserted in the transaction that queued the run.
			var status string
			if err := tx.QueryRow(ctx, `SELECT status FROM reconcile_runs WHERE id = $1`, id).Scan(&status); err != nil {
				return err
			}
			if status != "queued" {
				return errors.New("the run is not queued")
			}
			enqueued = append(enqueued, id)
			return nil
		}})
	op := h.as(h.token("alice", auth.RoleOperator))
	fin := h.as(h.token("fin", auth.RoleFinance))

	resp := h.request(http.MethodPost, "/v1/reconcile/runs", op, nil)
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	var run struct {
		ID          int64      `json:"id"`
		Status      string     `json:"status"`
		Trigger     string     `json:"trigger"`
		RequestedBy string     `json:"requested_by"`
		Settle      string     `json:"settle"`
		Since       *time.Time `json:"since"`
	}
	resp.decode(t, &run)
	require.Equal(t, "queued", run.Status)
	require.Equal(t, "api", run.Trigger)
	require.Equal(t, "alice", run.RequestedBy, "the token's name: who asked")
	require.Equal(t, "01:30:00", run.Settle, "the configured default")
	require.Nil(t, run.Since)
	require.Equal(t, []int64{run.ID}, enqueued)
	require.Equal(t, "/v1/reconcile/runs/"+strconv.FormatInt(run.ID, 10), resp.header.Get("Location"))

	resp = h.request(http.MethodPost, "/v1/reconcile/runs", op, map[string]any{"settle": "0s", "since": "2026-11-01T00:00:00Z"})
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	resp.decode(t, &run)
	require.Equal(t, "00:00:00", run.Settle)
	require.Equal(t, time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC), run.Since.UTC())

	for _, body := range []any{map[string]any{"settle": "soon"}, map[string]any{"settle": "-1h"}, map[string]any{"nope": 1}, "{"} {
		resp = h.request(http.MethodPost, "/v1/reconcile/runs", op, body)
		require.Contains(t, []int{http.StatusBadRequest, http.StatusUnprocessableEntity}, resp.status, "%v: %s", body, resp)
	}
	mu.Lock()
	fail = true
	mu.Unlock()
	resp = h.try(http.MethodPost, "/v1/reconcile/runs", op, nil)
	require.Equal(t, http.StatusInternalServerError, resp.status)
	require.Equal(t, int64(2), h.count(`SELECT count(*) FROM reconcile_runs`), "nothing half-stored")

	resp = h.request(http.MethodGet, "/v1/reconcile/runs/"+strconv.FormatInt(run.ID, 10), fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var view struct {
		ID              int64 `json:"id"`
		DiscrepancyList []any `json:"discrepancy_list"`
	}
	resp.decode(t, &view)
	require.Equal(t, run.ID, view.ID)
	require.NotNil(t, view.DiscrepancyList)
	require.Empty(t, view.DiscrepancyList)

	resp = h.request(http.MethodGet, "/v1/reconcile/runs", fin, nil)
	var list struct {
		Runs []struct {
			ID int64 `json:"id"`
		} `json:"runs"`
	}
	resp.decode(t, &list)
	require.Len(t, list.Runs, 2)
	require.Equal(t, run.ID, list.Runs[0].ID, "newest first")

	resp = h.request(http.MethodGet, "/v1/reconcile/runs/x", fin, nil)
	require.Equal(t, http.StatusBadRequest, resp.status)
	require.Equal(t, "invalid_id", resp.errorCode(t))
}
