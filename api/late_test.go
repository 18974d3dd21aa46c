package api_test

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/meter"
)

// TestLateUsageThroughTheAPI: under the quarantine policy, usage posted for
// a billing period whose invoice has closed (a tenant anchored hours ago,
// the default grace of an hour) is quarantined period_closed; the single
// requeue refuses it (409 period_closed) until accept_period_closed, the
// bulk requeue likewise, and the completeness report counts it in its
// period_closed bucket throughout. Every exchange is checked against the
// OpenAPI document.
func TestLateUsageThroughTheAPI(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	h.parts.Stager.Target = func(ctx context.Context) (meter.Target, bool) {
		target, ok := testTarget(ctx)
		target.LateUsage, target.InvoiceGrace = meter.LateQuarantine, time.Hour
		return target, ok
	}
	op, fin, ing := h.as(h.token("op", auth.RoleOperator)), h.as(h.token("fin", auth.RoleFinance)), h.as(h.token("ing", auth.RoleIngest))
	anchor := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour).Add(30 * time.Minute)
	resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", op,
		map[string]any{"stripe_customer_id": "cus_acme", "period_anchor": rfc(anchor), "invoice_grace": "1h"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	resp = h.request(http.MethodPut, "/v1/mappings/features/calls", op, map[string]any{"event_name": "api_calls", "aggregation": "count"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var version struct {
		MappingVersion int `json:"mapping_version"`
	}
	resp.decode(t, &version)

	resp = h.request(http.MethodPost, "/v1/usage", ing, batch(
		event{"id": "late-1", "tenant": "acme", "feature": "calls", "value": 1, "timestamp": rfc(anchor.Add(-20 * time.Minute))},
		event{"id": "late-2", "tenant": "acme", "feature": "calls", "value": 1, "timestamp": rfc(anchor.Add(-10 * time.Minute))},
		event{"id": "open", "tenant": "acme", "feature": "calls", "value": 1, "timestamp": rfc(anchor.Add(5 * time.Minute))}))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)

	resp = h.request(http.MethodGet, "/v1/quarantine/items?reason=period_closed", fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var list struct {
		Items []ItemView `json:"items"`
	}
	resp.decode(t, &list)
	require.Len(t, list.Items, 2, "the closed period's two events, not the open one's")
	require.Contains(t, string(resp.body), `"destination_account":"acct_`, "each item names the account it was staged for")

	closedMonth := meter.PeriodStart(anchor.Add(-time.Minute), anchor).Format("2006-01")
	c := completeness(t, h, fin, closedMonth+"&tenant=acme")
	require.True(t, c.Holds, "%+v", c)
	require.Len(t, c.Lines, 1)
	require.Equal(t, bucket{2, 2}, c.Lines[0].PeriodClosed)
	require.Equal(t, bucket{2, 2}, c.Lines[0].Quarantined)

	path := fmt.Sprintf("/v1/outbox/items/%d/requeue", list.Items[0].ID)
	resp = h.request(http.MethodPost, path, op, map[string]any{"mapping_version": version.MappingVersion})
	require.Equal(t, http.StatusConflict, resp.status, "%s", resp)
	require.Equal(t, "period_closed", resp.errorCode(t))
	resp = h.request(http.MethodPost, path, op, map[string]any{"mapping_version": version.MappingVersion, "accept_period_closed": true})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)

	resp = h.request(http.MethodPost, "/v1/quarantine/requeue", op, map[string]any{"reason": "period_closed"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.Contains(t, string(resp.body), `"refused_by":{"period_closed":1}`)
	resp = h.request(http.MethodPost, "/v1/quarantine/requeue", op, map[string]any{"reason": "period_closed", "accept_period_closed": true})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.Contains(t, string(resp.body), `"requeued":1`)

	c = completeness(t, h, fin, closedMonth+"&tenant=acme&refresh=true")
	require.True(t, c.Holds, "%+v", c)
	require.Equal(t, bucket{2, 2}, c.Lines[0].PeriodClosed, "still late once sent")
	require.Equal(t, bucket{2, 2}, c.Lines[0].Pending)
}
