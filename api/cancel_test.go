package api_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/outbox"
)

// TestCancellationsThroughTheAPI: POST /v1/usage/cancellations cancels
// earlier events whole or not at all — an unstaged one and a staged one
// never sent are withdrawn, a repeat answers the first outcome — and
// refuses, storing nothing, a token without the corrections permission, a
// tenant outside a scoped token, an unknown event and an event whose item
// is being sent (409 with Retry-After). Every exchange is checked against
// the OpenAPI document.
func TestCancellationsThroughTheAPI(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	op := h.as(h.token("op", auth.RoleOperator))
	ing, plain := h.as(h.correctingToken("ing", auth.RoleIngest)), h.as(h.token("plain", auth.RoleIngest))
	scoped := h.as(h.correctingToken("scoped", auth.RoleIngest, "other"))
	resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, map[string]any{"stripe_customer_id": "cus_acme"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	resp = h.request(http.MethodPut, "/v1/mappings/features/calls", op, map[string]any{"event_name": "api_calls", "aggregation": "count"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	at := rfc(time.Now().UTC().Add(-2 * time.Hour))
	resp = h.request(http.MethodPost, "/v1/usage", ing, batch(
		event{"id": "c1", "tenant": "acme", "feature": "calls", "value": 1, "timestamp": at},
		event{"id": "c2", "tenant": "acme", "feature": "calls", "value": 1, "timestamp": at},
		event{"id": "c3", "tenant": "acme", "feature": "calls", "value": 1, "timestamp": at}))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)

	cancel := func(auth string, ids ...string) response {
		cs := make([]map[string]string, len(ids))
		for i, id := range ids {
			cs[i] = map[string]string{"tenant": "acme", "id": id}
		}
		return h.request(http.MethodPost, "/v1/usage/cancellations", auth, map[string]any{"cancellations": cs})
	}
	resp = cancel(plain, "c1")
	require.Equal(t, http.StatusForbidden, resp.status, "%s", resp)
	require.Equal(t, "corrections_not_allowed", resp.errorCode(t))
	resp = cancel(scoped, "c1")
	require.Equal(t, http.StatusForbidden, resp.status, "%s", resp)
	require.Equal(t, "forbidden_tenant", resp.errorCode(t))
	resp = cancel(ing, "c1", "nope")
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
	require.Equal(t, "invalid_cancellations", resp.errorCode(t))
	require.Zero(t, h.count(`SELECT count(*) FROM usage_cancellations`), "nothing of a refused request is stored")

	// c1 per-event items are staged at ingest (count); lease c3's.
	var c3 int64
	require.NoError(t, h.pool.QueryRow(h.ctx, `SELECT item_id FROM usage_events WHERE event_id = 'c3'`).Scan(&c3))
	leases, err := h.parts.Outbox.Claim(h.ctx, h.pool, outbox.ClaimOptions{Owner: "w", Limit: 10, Policy: outbox.BestEffort})
	require.NoError(t, err)
	for _, l := range leases {
		if l.ID != c3 {
			_, err := h.parts.Outbox.Retry(h.ctx, h.pool, l, outbox.ErrorInfo{Code: "limiter"}, true)
			require.NoError(t, err)
		}
	}
	resp = cancel(ing, "c1", "c3")
	require.Equal(t, http.StatusConflict, resp.status, "%s", resp)
	require.Equal(t, "item_in_flight", resp.errorCode(t))
	require.NotEmpty(t, resp.header.Get("Retry-After"))

	resp = cancel(ing, "c1", "c2", "c1")
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var out struct {
		Cancellations []struct {
			Outcome   string `json:"outcome"`
			Item      *int64 `json:"item"`
			Duplicate bool   `json:"duplicate"`
		} `json:"cancellations"`
	}
	resp.decode(t, &out)
	require.Len(t, out.Cancellations, 3)
	for _, c := range out.Cancellations[:2] {
		require.Equal(t, "withdrawn", c.Outcome)
		require.False(t, c.Duplicate)
	}
	require.True(t, out.Cancellations[2].Duplicate, "the same event twice in one request")
	require.Equal(t, int64(2), h.count(`SELECT count(*) FROM outbox_items WHERE state = 'withdrawn'`))
	resp = cancel(ing, "c2")
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	resp.decode(t, &out)
	require.True(t, out.Cancellations[0].Duplicate)
	require.Equal(t, "withdrawn", out.Cancellations[0].Outcome)
}
