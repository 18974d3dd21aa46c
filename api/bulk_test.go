package api_test

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/quarantine"
)

// Bulk operations: every quarantined item a filter matches requeued in one
// call, the item-level CSV, and filters that are refused when unknown.

// bulkAnswer is the answer of POST /v1/quarantine/requeue, decoded strictly.
type bulkAnswer struct {
	DryRun bool `json:"dry_run"`
	Items  []struct {
		ItemID         int64  `json:"item_id"`
		Action         string `json:"action"`
		Refusal        string `json:"refusal"`
		Successor      *int64 `json:"successor"`
		MappingVersion int    `json:"mapping_version"`
	} `json:"items"`
	Totals    quarantine.BulkTotals `json:"totals"`
	NextAfter *int64                `json:"next_after"`
}

func decodeBulk(t *testing.T, resp response) bulkAnswer {
	t.Helper()
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var a bulkAnswer
	dec := json.NewDecoder(bytes.NewReader(resp.body))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&a), "%s", resp)
	return a
}

// quarantineCounts posts n count events of tenant acme, which has no
// customer yet, and stages them: n items quarantined no_customer.
func quarantineCounts(t *testing.T, h *harness, op string, n int) {
	t.Helper()
	resp := h.request(http.MethodPut, "/v1/mappings/features/logins", op, map[string]any{"event_name": "logins", "aggregation": "count"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	ing := h.as(h.token("ingest", auth.RoleIngest))
	at := rfc(time.Now().Add(-3 * time.Hour))
	for start := 0; start < n; start += 500 {
		events := make([]event, 0, 500)
		for i := start; i < min(n, start+500); i++ {
			events = append(events, event{"id": fmt.Sprintf("e%d", i), "tenant": "acme", "feature": "logins", "value": 1, "timestamp": at})
		}
		resp = h.request(http.MethodPost, "/v1/usage", ing, batch(events...))
		require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	}
	h.pass()
	require.EqualValues(t, n, h.count(`SELECT count(*) FROM outbox_items WHERE state = 'quarantined'`))
}

// Issue 16's acceptance: 1,000 quarantined items requeued in one call,
// after a dry run that changed nothing; refusals of a bad request first.
func TestBulkRequeueOfAThousandItemsInOneCall(t *testing.T) {
	if testing.Short() {
		t.Skip("requeues a thousand items: a load test")
	}
	t.Parallel()
	h := newHarness(t, true)
	op := h.as(h.token("operator", auth.RoleOperator))
	fin := h.as(h.token("finance", auth.RoleFinance))
	quarantineCounts(t, h, op, 1000)
	const path = "/v1/quarantine/requeue"
	state := func() string {
		var s string
		require.NoError(t, h.pool.QueryRow(h.ctx, `SELECT (SELECT string_agg(state || ' ' || updated_at, ',' ORDER BY id) FROM outbox_items)
			|| (SELECT count(*) FROM audit_log WHERE subject LIKE 'item:%')`).Scan(&s))
		return s
	}
	before := state()

	for name, c := range map[string]struct {
		token, path string
		body        any
		status      int
		code        string
	}{
		"finance may not":       {fin, path, map[string]any{}, http.StatusForbidden, "forbidden"},
		"an unknown filter":     {op, path, map[string]any{"state": "quarantined"}, http.StatusBadRequest, "invalid_json"},
		"a query parameter":     {op, path + "?dry_run=true", map[string]any{}, http.StatusBadRequest, "unknown_parameter"},
		"no body":               {op, path, nil, http.StatusBadRequest, "invalid_json"},
		"a reason of no one":    {op, path, map[string]any{"reason": "no_customers"}, http.StatusBadRequest, "invalid_reason"},
		"a malformed period":    {op, path, map[string]any{"period": "2026-13"}, http.StatusBadRequest, "invalid_period"},
		"a limit of zero":       {op, path, map[string]any{"limit": 0}, http.StatusBadRequest, "invalid_limit"},
		"a limit over the most": {op, path, map[string]any{"limit": quarantine.MaxBulkLimit + 1}, http.StatusBadRequest, "invalid_limit"},
		"a negative after":      {op, path, map[string]any{"after": -1}, http.StatusBadRequest, "invalid_after"},
	} {
		resp := h.request(http.MethodPost, c.path, c.token, c.body)
		require.Equal(t, c.status, resp.status, "%s: %s", name, resp)
		require.Equal(t, c.code, resp.errorCode(t), name)
	}
	require.Equal(t, before, state(), "refused requests changed nothing")

	dry := decodeBulk(t, h.request(http.MethodPost, path, op, map[string]any{"tenant": "acme", "dry_run": true}))
	require.True(t, dry.DryRun)
	require.Equal(t, quarantine.BulkTotals{Refused: 1000, RefusedBy: map[string]int{"still_ineligible": 1000}}, dry.Totals,
		"acme has no customer yet")
	resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, map[string]any{"stripe_customer_id": "cus_acme"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var tn tenantView
	resp.decode(t, &tn)
	before = state()

	dry = decodeBulk(t, h.request(http.MethodPost, path, op, map[string]any{"reason": "no_customer", "dry_run": true}))
	require.Equal(t, quarantine.BulkTotals{Readdressed: 1000, RefusedBy: map[string]int{}}, dry.Totals)
	require.Len(t, dry.Items, 1000)
	require.Equal(t, before, state(), "the dry run changed no item and wrote no audit entry")

	run := decodeBulk(t, h.request(http.MethodPost, path, op, map[string]any{"reason": "no_customer"}))
	require.False(t, run.DryRun)
	require.Equal(t, dry.Totals, run.Totals)
	for i, it := range run.Items {
		require.Equal(t, dry.Items[i].ItemID, it.ItemID)
		require.Equal(t, "readdressed", it.Action)
		require.NotNil(t, it.Successor)
		require.Equal(t, tn.MappingVersion, it.MappingVersion)
	}
	require.NotNil(t, run.NextAfter, "a full page: more may match")
	require.Zero(t, h.count(`SELECT count(*) FROM outbox_items WHERE state = 'quarantined'`))
	require.EqualValues(t, 1000, h.count(`SELECT count(*) FROM outbox_items WHERE state = 'pending' AND payload ->> 'customer' = 'cus_acme'`))
	require.EqualValues(t, 1000, h.count(`SELECT count(*) FROM audit_log WHERE action = 'readdress' AND actor = 'token:operator'`),
		"one audit entry per item")

	rest := decodeBulk(t, h.request(http.MethodPost, path, op, map[string]any{"reason": "no_customer", "after": *run.NextAfter}))
	require.Empty(t, rest.Items)
	require.Nil(t, rest.NextAfter)
}

// A filter a route does not take is refused, not ignored.
func TestUnknownFiltersAreRefused(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	fin := h.as(h.token("finance", auth.RoleFinance))
	for _, path := range []string{
		"/v1/outbox/items?reason=no_customer",
		"/v1/outbox/items?state=quarantined&tenants=acme",
		"/v1/quarantine?state=quarantined",
		"/v1/quarantine?reason=no_customer&limit=5",
		"/v1/quarantine/items?state=quarantined",
		"/v1/quarantine/items?" + strings.Repeat("x", 300) + "=1",
	} {
		resp := h.request(http.MethodGet, path, fin, nil)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", path, resp)
		require.Equal(t, "unknown_parameter", resp.errorCode(t), path)
		require.Less(t, len(resp.body), 400, "the name is not echoed at length")
	}
	for path, code := range map[string]string{
		"/v1/quarantine?reason=no_customers":           "invalid_reason",
		"/v1/quarantine/items?period=11-2026":          "invalid_period",
		"/v1/quarantine/items?format=xml":              "invalid_format",
		"/v1/quarantine/items?format=csv&limit=5":      "invalid_parameter",
		"/v1/quarantine/items?limit=1001":              "invalid_limit",
		"/v1/quarantine/items?after=x":                 "invalid_after",
		"/v1/outbox/items?state=quarantined&limit=abc": "invalid_limit",
	} {
		resp := h.request(http.MethodGet, path, fin, nil)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", path, resp)
		require.Equal(t, code, resp.errorCode(t), path)
	}
	for _, path := range []string{"/v1/outbox/items?state=quarantined&tenant=acme&feature=x&limit=5&after=0",
		"/v1/quarantine?reason=no_customer&tenant=acme&feature=x&period=2026-11&format=json",
		"/v1/quarantine/items?reason=no_customer&tenant=acme&feature=x&period=2026-11&format=json&limit=5&after=0"} {
		resp := h.request(http.MethodGet, path, fin, nil)
		require.Equal(t, http.StatusOK, resp.status, "%s: %s", path, resp)
	}
}

// GET /v1/quarantine/items: a page of items as JSON, every item as CSV.
func TestQuarantineItemsAsJSONAndCSV(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	op := h.as(h.token("operator", auth.RoleOperator))
	fin := h.as(h.token("finance", auth.RoleFinance))
	quarantineCounts(t, h, op, 3)

	resp := h.request(http.MethodGet, "/v1/quarantine/items?tenant=acme&limit=2", fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var page struct {
		Items []struct {
			ID       int64  `json:"id"`
			Reason   string `json:"reason"`
			Tenant   string `json:"tenant"`
			Feature  string `json:"feature"`
			Customer string `json:"customer"`
			Value    string `json:"value"`
		} `json:"items"`
		NextAfter *int64 `json:"next_after"`
	}
	resp.decode(t, &page)
	require.Len(t, page.Items, 2)
	require.Equal(t, "no_customer", page.Items[0].Reason)
	require.Equal(t, "logins", page.Items[0].Feature)
	require.Equal(t, "1", page.Items[0].Value)
	require.NotNil(t, page.NextAfter)
	resp = h.request(http.MethodGet, fmt.Sprintf("/v1/quarantine/items?tenant=acme&limit=2&after=%d", *page.NextAfter), fin, nil)
	page.Items, page.NextAfter = nil, nil
	resp.decode(t, &page)
	require.Len(t, page.Items, 1)
	require.Nil(t, page.NextAfter)

	resp = h.request(http.MethodGet, "/v1/quarantine/items?format=csv&reason=no_customer", fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.Equal(t, "text/csv; charset=utf-8", resp.header.Get("Content-Type"))
	require.Contains(t, resp.header.Get("Content-Disposition"), "tally-quarantine-items.csv")
	records, err := csv.NewReader(bytes.NewReader(resp.body)).ReadAll()
	require.NoError(t, err)
	require.Len(t, records, 4)
	require.Equal(t, []string{"id", "tenant", "feature", "customer", "destination_account", "reason"}, records[0][:6])
	require.Equal(t, []string{"acme", "logins", "", "acct_1", "no_customer"}, records[1][1:6])
}
