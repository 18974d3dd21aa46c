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
	"github.com/tallymeter/tally/outbox"
)

// runQueue is the job queue TestReconcileRunsAPI gives the API: it records
// the runs it is asked to enqueue, or fails once told to.
type runQueue struct {
	mu       sync.Mutex
	enqueued []int64
	fail     bool
}

func (q *runQueue) enqueue(ctx context.Context, tx pgx.Tx, id int64) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.fail {
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
	q.enqueued = append(q.enqueued, id)
	return nil
}

// runView is a reconcile run as POST /v1/reconcile/runs answers it.
type runView struct {
	ID          int64      `json:"id"`
	Status      string     `json:"status"`
	Trigger     string     `json:"trigger"`
	RequestedBy string     `json:"requested_by"`
	Settle      string     `json:"settle"`
	Since       *time.Time `json:"since"`
}

// runsScenario is what the steps of TestReconcileRunsAPI share besides the
// database.
type runsScenario struct {
	queue   *runQueue
	op, fin string
	run     runView // the run last queued
}

// POST /v1/reconcile/runs queues a run and its job in one transaction; GET
// shows it. A failure to enqueue leaves no run behind; bad input stores
// nothing.
func TestReconcileRunsAPI(t *testing.T) {
	t.Parallel()
	s := &runsScenario{queue: &runQueue{}}
	h := newHarnessWith(t, false, func(d *api.Deps) {
		d.Reconcile = &api.ReconcileDeps{Enabled: true, Settle: 90 * time.Minute, Enqueue: s.queue.enqueue}
	})
	s.op = h.as(h.token("alice", auth.RoleOperator))
	s.fin = h.as(h.token("fin", auth.RoleFinance))
	// In order, on one database: each step counts or reads the runs the
	// steps before it queued.
	runSteps(t, h,
		step{"queued", s.queues},
		step{"queued with settle and since", s.queuesWithOptions},
		step{"bad input", s.refusesBadInput},
		step{"a failed enqueue", s.storesNothingOnFailure},
		step{"read", s.reads},
	)
}

func (s *runsScenario) queues(t *testing.T, h *harness) {
	resp := h.request(http.MethodPost, "/v1/reconcile/runs", s.op, nil)
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	resp.decode(t, &s.run)
	require.Equal(t, "queued", s.run.Status)
	require.Equal(t, "api", s.run.Trigger)
	require.Equal(t, "token:alice", s.run.RequestedBy, "the token's name: who asked")
	require.Equal(t, "01:30:00", s.run.Settle, "the configured default")
	require.Nil(t, s.run.Since)
	require.Equal(t, []int64{s.run.ID}, s.queue.enqueued)
	require.Equal(t, "/v1/reconcile/runs/"+strconv.FormatInt(s.run.ID, 10), resp.header.Get("Location"))
}

func (s *runsScenario) queuesWithOptions(t *testing.T, h *harness) {
	resp := h.request(http.MethodPost, "/v1/reconcile/runs", s.op, map[string]any{"settle": "0s", "since": "2026-11-01T00:00:00Z"})
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	resp.decode(t, &s.run)
	require.Equal(t, "00:00:00", s.run.Settle)
	require.Equal(t, time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC), s.run.Since.UTC())
}

func (s *runsScenario) refusesBadInput(t *testing.T, h *harness) {
	for _, body := range []any{map[string]any{"settle": "soon"}, map[string]any{"settle": "-1h"}, map[string]any{"nope": 1}, "{"} {
		resp := h.request(http.MethodPost, "/v1/reconcile/runs", s.op, body)
		require.Contains(t, []int{http.StatusBadRequest, http.StatusUnprocessableEntity}, resp.status, "%v: %s", body, resp)
	}
}

// storesNothingOnFailure: a failure to enqueue leaves no run behind.
func (s *runsScenario) storesNothingOnFailure(t *testing.T, h *harness) {
	s.queue.mu.Lock()
	s.queue.fail = true
	s.queue.mu.Unlock()
	resp := h.try(http.MethodPost, "/v1/reconcile/runs", s.op, nil)
	require.Equal(t, http.StatusInternalServerError, resp.status)
	require.Equal(t, int64(2), h.count(`SELECT count(*) FROM reconcile_runs`), "nothing half-stored")
}

// reads: the run last queued, the list newest first, and a bad id.
func (s *runsScenario) reads(t *testing.T, h *harness) {
	resp := h.request(http.MethodGet, "/v1/reconcile/runs/"+strconv.FormatInt(s.run.ID, 10), s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var view struct {
		ID              int64 `json:"id"`
		DiscrepancyList []any `json:"discrepancy_list"`
	}
	resp.decode(t, &view)
	require.Equal(t, s.run.ID, view.ID)
	require.NotNil(t, view.DiscrepancyList)
	require.Empty(t, view.DiscrepancyList)

	resp = h.request(http.MethodGet, "/v1/reconcile/runs", s.fin, nil)
	var list struct {
		Runs []struct {
			ID int64 `json:"id"`
		} `json:"runs"`
	}
	resp.decode(t, &list)
	require.Len(t, list.Runs, 2)
	require.Equal(t, s.run.ID, list.Runs[0].ID, "newest first")

	resp = h.request(http.MethodGet, "/v1/reconcile/runs/x", s.fin, nil)
	require.Equal(t, http.StatusBadRequest, resp.status)
	require.Equal(t, "invalid_id", resp.errorCode(t))
}

// recoverScenario is what the steps of TestRecoverAPI share besides the
// database.
type recoverScenario struct {
	op, fin string
	itemID  int64  // the item whose attempt ended uncertain
	path    string // its page
}

// POST /v1/outbox/items/{id}/recover is T8 with the expected-state check:
// the wrong expectation answers expected_state_mismatch with the current
// state; every recovery, and every mapping change, is in the audit log and
// on the item's page.
func TestRecoverAPI(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	s := &recoverScenario{op: h.as(h.token("olga", auth.RoleOperator)), fin: h.as(h.token("fin", auth.RoleFinance))}
	// In order, on one database: each step reads the state and the audit
	// log the steps before it left.
	runSteps(t, h,
		step{"an uncertain item", s.uncertainItem},
		step{"refused recoveries", s.refuses},
		step{"recovered", s.recovers},
		step{"expected state mismatch", s.mismatch},
		step{"on the item page", s.onItemPage},
		step{"in the audit log", s.inAuditLog},
	)
}

// uncertainItem maps a feature and a tenant, ingests one event and claims
// its item.
func (s *recoverScenario) uncertainItem(t *testing.T, h *harness) {
	ingest := h.as(h.token("svc", auth.RoleIngest))
	require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/features/logins", s.op,
		map[string]any{"event_name": "logins", "aggregation": "count"}).status)
	require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/tenants/t1", s.op,
		map[string]any{"stripe_customer_id": "cus_1"}).status)
	require.Equal(t, http.StatusAccepted, h.request(http.MethodPost, "/v1/usage", ingest,
		batch(event{"id": "e1", "tenant": "t1", "feature": "logins", "value": 1})).status)

	// The item's only attempt ends uncertain (as a 5xx with
	// Stripe-Should-Retry: false does).
	leases, err := h.parts.Outbox.Claim(h.ctx, h.pool, outbox.ClaimOptions{Owner: "test", Limit: 10})
	require.NoError(t, err)
	require.Len(t, leases, 1)
	_, err = h.parts.Outbox.Record(h.ctx, h.pool, []outbox.Outcome{{Lease: leases[0], Kind: outbox.Uncertain,
		Error: outbox.ErrorInfo{Code: "stripe_5xx", Status: 500}}})
	require.NoError(t, err)
	s.path = "/v1/outbox/items/" + strconv.FormatInt(leases[0].ID, 10)
	s.itemID = leases[0].ID
}

// refuses: a recovery without an expectation or a target, to a state
// recovery does not move to, from a state the item is not in, or to
// rejected without a reason is refused (422); finance may not recover (403).
func (s *recoverScenario) refuses(t *testing.T, h *harness) {
	for _, body := range []any{
		map[string]any{"to": "pending"},
		map[string]any{"expect": "uncertain"},
		map[string]any{"expect": "uncertain", "to": "confirmed"},
		map[string]any{"expect": "pending", "to": "accepted"},
		map[string]any{"expect": "uncertain", "to": "rejected"}, // no reason
	} {
		resp := h.request(http.MethodPost, s.path+"/recover", s.op, body)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%v: %s", body, resp)
	}
	require.Equal(t, http.StatusForbidden, h.request(http.MethodPost, s.path+"/recover", s.fin,
		map[string]any{"expect": "uncertain", "to": "pending"}).status)
}

func (s *recoverScenario) recovers(t *testing.T, h *harness) {
	resp := h.request(http.MethodPost, s.path+"/recover", s.op,
		map[string]any{"expect": "uncertain", "to": "pending", "reason": "Stripe support confirmed it never arrived"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var item struct {
		State string `json:"state"`
	}
	resp.decode(t, &item)
	require.Equal(t, "pending", item.State)
}

// mismatch: the wrong expectation answers expected_state_mismatch with the
// current state.
func (s *recoverScenario) mismatch(t *testing.T, h *harness) {
	resp := h.request(http.MethodPost, s.path+"/recover", s.op, map[string]any{"expect": "uncertain", "to": "accepted"})
	require.Equal(t, http.StatusConflict, resp.status, "%s", resp)
	var e struct {
		Error struct {
			Code         string `json:"code"`
			Message      string `json:"message"`
			CurrentState string `json:"current_state"`
		} `json:"error"`
	}
	resp.decode(t, &e)
	require.Equal(t, "expected_state_mismatch", e.Error.Code)
	require.Equal(t, "pending", e.Error.CurrentState)
	require.Contains(t, e.Error.Message, "is pending, not uncertain")
}

func (s *recoverScenario) onItemPage(t *testing.T, h *harness) {
	resp := h.request(http.MethodGet, s.path, s.fin, nil)
	var view struct {
		Audit []struct {
			Actor, Action, From, To, Reason string
		} `json:"audit"`
	}
	resp.decode(t, &view)
	require.Len(t, view.Audit, 1)
	require.Equal(t, "token:olga", view.Audit[0].Actor)
	require.Equal(t, "recover", view.Audit[0].Action)
	require.Equal(t, "uncertain", view.Audit[0].From)
	require.Equal(t, "pending", view.Audit[0].To)
	require.Equal(t, "Stripe support confirmed it never arrived", view.Audit[0].Reason)
}

// inAuditLog: the recovery and both mapping changes, newest first.
func (s *recoverScenario) inAuditLog(t *testing.T, h *harness) {
	resp := h.request(http.MethodGet, "/v1/audit", s.fin, nil)
	var log struct {
		Entries []struct {
			Actor, Action, Subject string
		} `json:"entries"`
	}
	resp.decode(t, &log)
	var actions []string
	for _, en := range log.Entries {
		require.Equal(t, "token:olga", en.Actor)
		actions = append(actions, en.Action+" "+en.Subject)
	}
	require.Equal(t, []string{"recover item:" + strconv.FormatInt(s.itemID, 10), "mapping.tenant tenant:t1", "mapping.feature feature:logins"}, actions)
}
