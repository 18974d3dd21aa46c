package api_test

import (
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// discrepancyView is a discrepancy as the API answers it.
type discrepancyView struct {
	ID         int64    `json:"id"`
	Customer   string   `json:"customer"`
	Tenants    []string `json:"tenants"`
	Features   []string `json:"features"`
	Resolution *struct {
		Reason       string  `json:"reason"`
		Note         string  `json:"note"`
		By           string  `json:"by"`
		SettledItems []int64 `json:"settled_items"`
	} `json:"resolution"`
}

// acceptedDiscrepancy maps a feature and a tenant, delivers one event's
// item (accepted) and records a succeeded run with one discrepancy about
// it: Stripe has nothing of it.
func acceptedDiscrepancy(t *testing.T, h *harness, op string) (run, item, id int64) {
	ingest := h.as(h.token("svc", auth.RoleIngest))
	require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/features/logins", op,
		map[string]any{"event_name": "logins", "aggregation": "count"}).status)
	require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/tenants/acme", op,
		map[string]any{"stripe_customer_id": "cus_acme"}).status)
	require.Equal(t, http.StatusAccepted, h.request(http.MethodPost, "/v1/usage", ingest,
		batch(event{"id": "e1", "tenant": "acme", "feature": "logins", "value": 1})).status)
	leases, err := h.parts.Outbox.Claim(h.ctx, h.pool, outbox.ClaimOptions{Owner: "test", Limit: 10})
	require.NoError(t, err)
	require.Len(t, leases, 1)
	_, err = h.parts.Outbox.Record(h.ctx, h.pool, []outbox.Outcome{{Lease: leases[0], Kind: outbox.Accepted}})
	require.NoError(t, err)
	item = leases[0].ID

	run, err = reconcile.Queue(h.ctx, h.pool, reconcile.TriggerAPI, "test", reconcile.Options{})
	require.NoError(t, err)
	_, err = h.pool.Exec(h.ctx, `UPDATE reconcile_runs SET status = 'succeeded', started_at = clock_timestamp(),
		heartbeat_at = clock_timestamp(), finished_at = clock_timestamp() WHERE id = $1`, run)
	require.NoError(t, err)
	require.NoError(t, h.pool.QueryRow(h.ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name,
			meter, customer, hour, formula, expected, provider, difference, expected_items, uncertain_items, explained_by, explanation)
		VALUES ($1, 'acct_1', 'test', 'logins', 'mtr_1', 'cus_acme', $2, 'count', 1, 0, -1, ARRAY[$3::bigint], '{}', '{}', 'unexplained')
		RETURNING id`, run, time.Now().UTC().Truncate(time.Hour), item).Scan(&id))
	return run, item, id
}

// Finance lists the open discrepancies (with their tenants and features)
// and resolves one with a reason and a note: the item is confirmed, the
// resolution shown and audited; it is no longer open. Bad input, an
// unknown discrepancy and a second resolution change nothing.
func TestResolveDiscrepancyAPI(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	op, fin := h.as(h.token("olga", auth.RoleOperator)), h.as(h.token("fiona", auth.RoleFinance))
	run, item, id := acceptedDiscrepancy(t, h, op)
	path := "/v1/reconcile/discrepancies/" + strconv.FormatInt(id, 10)
	refusesBadRequests(t, h, fin, path)
	require.Equal(t, outbox.StateAccepted, h.itemState(t, item), "nothing changed")

	resp := h.request(http.MethodGet, "/v1/reconcile/discrepancies", fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var list struct {
		Run           int64             `json:"run"`
		Discrepancies []discrepancyView `json:"discrepancies"`
	}
	resp.decode(t, &list)
	require.Equal(t, run, list.Run, "the latest succeeded run")
	require.Len(t, list.Discrepancies, 1)
	require.Equal(t, []string{"acme"}, list.Discrepancies[0].Tenants)
	require.Equal(t, []string{"logins"}, list.Discrepancies[0].Features)
	require.Nil(t, list.Discrepancies[0].Resolution)

	resp = h.request(http.MethodPost, path+"/resolve", fin, map[string]any{"reason": "reposted", "note": "re-posted as tly_x2 on 12-01"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var d discrepancyView
	resp.decode(t, &d)
	require.NotNil(t, d.Resolution)
	require.Equal(t, "reposted", d.Resolution.Reason)
	require.Equal(t, "token:fiona", d.Resolution.By)
	require.Equal(t, []int64{item}, d.Resolution.SettledItems)
	require.Equal(t, outbox.StateConfirmed, h.itemState(t, item))

	resp = h.request(http.MethodPost, path+"/resolve", fin, map[string]any{"reason": "accept_tally", "note": "again"})
	require.Equal(t, http.StatusConflict, resp.status)
	require.Equal(t, "resolved", resp.errorCode(t))

	resp = h.request(http.MethodGet, "/v1/reconcile/discrepancies", fin, nil)
	resp.decode(t, &list)
	require.Empty(t, list.Discrepancies, "nothing open")
	resp = h.request(http.MethodGet, "/v1/reconcile/discrepancies?status=resolved&run="+strconv.FormatInt(run, 10), fin, nil)
	resp.decode(t, &list)
	require.Len(t, list.Discrepancies, 1)

	resp = h.request(http.MethodGet, "/v1/audit?subject=discrepancy:"+strconv.FormatInt(id, 10), fin, nil)
	var log struct {
		Entries []struct{ Actor, Action, To, Reason string } `json:"entries"`
	}
	resp.decode(t, &log)
	require.Len(t, log.Entries, 1)
	require.Equal(t, "token:fiona", log.Entries[0].Actor)
	require.Equal(t, "discrepancy.resolve", log.Entries[0].Action)
	require.Equal(t, "reposted", log.Entries[0].To)
	require.Equal(t, "re-posted as tly_x2 on 12-01", log.Entries[0].Reason)
}

// refusesBadRequests: unknown filters, bad values, an unknown discrepancy,
// a resolution without a known reason or a note, and an ingest token are
// refused.
func refusesBadRequests(t *testing.T, h *harness, fin, path string) {
	for _, c := range []struct {
		path   string
		status int
		code   string
	}{
		{"/v1/reconcile/discrepancies?reason=x", http.StatusBadRequest, "unknown_filter"},
		{"/v1/reconcile/discrepancies?status=closed", http.StatusBadRequest, "invalid_status"},
		{"/v1/reconcile/discrepancies?run=0", http.StatusBadRequest, "invalid_run"},
		{"/v1/reconcile/discrepancies?run=999", http.StatusNotFound, "not_found"},
		{"/v1/reconcile/discrepancies/999", http.StatusNotFound, "not_found"},
	} {
		resp := h.request(http.MethodGet, c.path, fin, nil)
		require.Equal(t, c.status, resp.status, "%s: %s", c.path, resp)
		require.Equal(t, c.code, resp.errorCode(t), c.path)
	}
	for _, body := range []any{
		map[string]any{"reason": "waived", "note": "n"},
		map[string]any{"reason": "accept_tally"},
		map[string]any{"reason": "accept_tally", "note": "  "},
	} {
		resp := h.request(http.MethodPost, path+"/resolve", fin, body)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%v: %s", body, resp)
		require.Equal(t, "invalid_resolution", resp.errorCode(t))
	}
	resp := h.request(http.MethodPost, "/v1/reconcile/discrepancies/999/resolve", fin, map[string]any{"reason": "accept_tally", "note": "n"})
	require.Equal(t, http.StatusNotFound, resp.status)
	ingest := h.as(h.token("svc2", auth.RoleIngest))
	require.Equal(t, http.StatusForbidden, h.request(http.MethodPost, path+"/resolve", ingest, map[string]any{"reason": "accept_tally", "note": "n"}).status)
}

// itemState reads an item's state through the API's owner, the outbox.
func (h *harness) itemState(t *testing.T, id int64) outbox.State {
	it, err := h.parts.Outbox.Get(h.ctx, h.pool, id)
	require.NoError(t, err)
	return it.State
}
