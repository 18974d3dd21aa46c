package api_test

import (
	"bytes"
	"encoding/csv"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// ---------------------------------------------------------------------------
// 5. Quarantine, CSV and requeue

type requeueResult struct {
	ItemID         int64  `json:"item_id"`
	Action         string `json:"action"`
	Successor      *int64 `json:"successor"`
	MappingVersion int    `json:"mapping_version"`
}

func TestSafeCell(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"=1+1":               "'=1+1",
		"+1":                 "'+1",
		"-1":                 "'-1",
		"@SUM(A1)":           "'@SUM(A1)",
		"\tx":                "'\tx",
		"\rx":                "'\rx",
		"=HYPERLINK(\"x\")":  "'=HYPERLINK(\"x\")",
		"":                   "",
		"acme":               "acme",
		"a=b":                "a=b",
		"feature_unmapped":   "feature_unmapped",
		"2026-11-01T00:00Z":  "2026-11-01T00:00Z",
		" =1":                " =1",
		"'=1":                "'=1",
		"\u00e9=1":           "\u00e9=1",
		"\n=1":               "\n=1",
		"x\r\n=1":            "x\r\n=1",
		"-":                  "'-",
		"@":                  "'@",
		"==":                 "'==",
		"+-":                 "'+-",
		"\t":                 "'\t",
		"\r":                 "'\r",
		"=\u00e9":            "'=\u00e9",
		"\u2212=1 (a minus)": "\u2212=1 (a minus)",
	} {
		require.Equal(t, want, quarantine.SafeCell(in), "%q", in)
	}
}

func TestQuarantineCSVAndRequeue(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	op := h.as(h.token("operator", auth.RoleOperator))
	fin := h.as(h.token("finance", auth.RoleFinance))
	ing := h.as(h.token("ingest", auth.RoleIngest))

	resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, map[string]any{"stripe_customer_id": "cus_acme"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var tenant tenantView
	resp.decode(t, &tenant)

	at := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Second)
	resp = h.request(http.MethodPost, "/v1/usage", ing, batch(event{"id": "u1", "tenant": "acme", "feature": "gpu", "value": 7, "timestamp": rfc(at)}))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	res := h.pass()
	require.Equal(t, meter.PassResult{Items: 1, Quarantined: 1, Events: 1}, res)
	period := meter.PeriodStart(at, meter.CalendarAnchor).Format(time.RFC3339)

	// The item, as the API shows it.
	resp = h.request(http.MethodGet, "/v1/outbox/items?state=quarantined", fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var list struct {
		Items     []itemView `json:"items"`
		NextAfter int64      `json:"next_after"`
	}
	resp.decode(t, &list)
	require.Len(t, list.Items, 1)
	old := list.Items[0]
	require.Equal(t, "feature_unmapped", old.Reason)
	require.Equal(t, tenant.MappingVersion, old.MappingVersion)
	require.Equal(t, "event:gpu:u1", old.SubjectRef)

	// The report, as JSON and CSV.
	resp = h.request(http.MethodGet, "/v1/quarantine", fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.JSONEq(t, fmt.Sprintf(`{"groups":[{"reason":"feature_unmapped","tenant":"acme","feature":"gpu","period":%q,"items":1,"events":1,"value":7}],
		"totals":[{"reason":"feature_unmapped","items":1,"events":1,"value":7}]}`, period), string(resp.body))
	resp = h.request(http.MethodGet, "/v1/quarantine?reason=no_customer", fin, nil)
	require.JSONEq(t, `{"groups":[],"totals":[]}`, string(resp.body))
	resp = h.request(http.MethodGet, "/v1/quarantine?format=json&tenant=acme&period="+period[:7], fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.Contains(t, string(resp.body), `"value":7`)
	for _, q := range []string{"format=xml", "period=2026-13", "period=2026-1"} {
		resp = h.request(http.MethodGet, "/v1/quarantine?"+q, fin, nil)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", q, resp)
	}

	resp = h.request(http.MethodGet, "/v1/quarantine?format=csv", fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.True(t, strings.HasPrefix(resp.header.Get("Content-Type"), "text/csv"), resp.header.Get("Content-Type"))
	records, err := csv.NewReader(bytes.NewReader(resp.body)).ReadAll()
	require.NoError(t, err)
	require.Equal(t, [][]string{
		{"reason", "tenant", "feature", "period", "items", "events", "value"},
		{"feature_unmapped", "acme", "gpu", period, "1", "1", "7"},
	}, records)

	// No API input can start a cell with a formula character (tenants and
	// features are tokens), so such items are enqueued through the outbox
	// itself to prove the CSV neutralises them.
	hostile := []string{"=HYPERLINK(\"http://x\")", "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"}
	err = pgx.BeginFunc(h.ctx, h.pool, func(tx pgx.Tx) error {
		for i, s := range hostile {
			_, err := h.parts.Outbox.Enqueue(h.ctx, tx, outbox.NewItem{
				Identity: outbox.Identity{TenantKey: s, SubjectKind: outbox.SubjectUsageEvent, SubjectRef: fmt.Sprintf("event:x:%d", i),
					Exporter: "stripe_meter_events", DestinationAccount: "acct_1", Mode: outbox.ModeTest},
				Payload:    outbox.Payload{Value: -int64(i), Timestamp: at.Unix(), Feature: s, Period: period},
				Quarantine: outbox.ReasonFeatureUnmapped,
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
	require.NoError(t, err)
	resp = h.request(http.MethodGet, "/v1/quarantine?format=csv", fin, nil)
	records, err = csv.NewReader(bytes.NewReader(resp.body)).ReadAll()
	require.NoError(t, err)
	require.Len(t, records, 2+len(hostile))
	for _, s := range hostile {
		found := false
		for _, rec := range records[1:] {
			if rec[1] == "'"+s {
				found = true
				require.Equal(t, "'"+s, rec[2], "the feature cell")
			}
			for _, cell := range rec[:4] {
				require.False(t, cell != "" && strings.ContainsRune("=+-@\t\r", rune(cell[0])), "an unescaped text cell: %q", cell)
			}
		}
		require.True(t, found, "no escaped row for %q in %q", s, records)
	}

	// Requeue while the feature is still unmapped: refused.
	requeue := func(id any, body any) response {
		return h.request(http.MethodPost, fmt.Sprintf("/v1/outbox/items/%v/requeue", id), op, body)
	}
	resp = requeue(old.ID, map[string]any{"mapping_version": tenant.MappingVersion})
	require.Equal(t, http.StatusConflict, resp.status, "%s", resp)
	require.Equal(t, "still_ineligible", resp.errorCode(t))

	resp = h.request(http.MethodPut, "/v1/mappings/features/gpu", op, map[string]any{"event_name": "gpu_seconds", "aggregation": "sum"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var feature featureView
	resp.decode(t, &feature)
	current := max(feature.MappingVersion, tenant.MappingVersion)

	for name, v := range map[string]int{"the version staged with": tenant.MappingVersion, "zero": 0, "ahead": current + 1} {
		resp = requeue(old.ID, map[string]any{"mapping_version": v})
		require.Equal(t, http.StatusConflict, resp.status, "%s: %s", name, resp)
		require.Equal(t, "mapping_changed", resp.errorCode(t), name)
	}
	resp = requeue(old.ID, map[string]any{})
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
	require.Equal(t, "invalid_request", resp.errorCode(t))
	require.Equal(t, "mapping_version", resp.problems(t)[0].Field)
	for name, body := range map[string]string{
		"not a number":  `{"mapping_version":"3"}`,
		"unknown field": fmt.Sprintf(`{"mapping_version":%d,"force":true}`, current),
		"no body":       ``,
	} {
		resp = requeue(old.ID, body)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_json", resp.errorCode(t), name)
	}
	for _, id := range []string{"999999", "0", "-1", "abc"} {
		resp = requeue(id, map[string]any{"mapping_version": current})
		require.Equal(t, http.StatusNotFound, resp.status, "%s: %s", id, resp)
		require.Equal(t, "not_found", resp.errorCode(t))
	}
	resp = h.request(http.MethodGet, fmt.Sprintf("/v1/outbox/items/%d", old.ID), fin, nil)
	var still itemView
	resp.decode(t, &still)
	require.Equal(t, "quarantined", still.State, "a refused requeue changes nothing")

	resp = requeue(old.ID, map[string]any{"mapping_version": current})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var rq requeueResult
	resp.decode(t, &rq)
	require.Equal(t, old.ID, rq.ItemID)
	require.Equal(t, quarantine.ActionReaddressed, rq.Action)
	require.NotNil(t, rq.Successor)
	require.NotEqual(t, old.ID, *rq.Successor)
	require.Equal(t, current, rq.MappingVersion)

	resp = h.request(http.MethodGet, fmt.Sprintf("/v1/outbox/items/%d", old.ID), fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var closed itemView
	resp.decode(t, &closed)
	require.Equal(t, "superseded", closed.State)
	require.NotNil(t, closed.SupersededBy)
	require.Equal(t, *rq.Successor, *closed.SupersededBy)
	require.Equal(t, old.Identifier, closed.Identifier, "the predecessor keeps its identity")

	resp = h.request(http.MethodGet, fmt.Sprintf("/v1/outbox/items/%d", *rq.Successor), fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var succ itemView
	resp.decode(t, &succ)
	require.Equal(t, "pending", succ.State)
	require.Equal(t, current, succ.MappingVersion)
	require.Equal(t, old.SubjectRef, succ.SubjectRef)
	require.NotEqual(t, old.Identifier, succ.Identifier)
	require.Equal(t, outbox.Payload{Customer: "cus_acme", EventName: "gpu_seconds", Value: 7, Timestamp: at.Unix(),
		Identifier: succ.Identifier, Feature: "gpu", Period: period}, succ.Payload)

	resp = requeue(old.ID, map[string]any{"mapping_version": current})
	require.Equal(t, http.StatusConflict, resp.status, "%s", resp)
	require.Equal(t, "not_quarantined", resp.errorCode(t))
	resp = requeue(*rq.Successor, map[string]any{"mapping_version": current})
	require.Equal(t, http.StatusConflict, resp.status, "%s", resp)

	// The usage is counted once, under the successor.
	resp = h.request(http.MethodGet, "/v1/quarantine?tenant=acme", fin, nil)
	require.JSONEq(t, `{"groups":[],"totals":[]}`, string(resp.body))
	c := completeness(t, h, fin, period[:7]+"&tenant=acme")
	require.True(t, c.Holds, "%+v", c)
	require.Len(t, c.Lines, 1)
	require.Equal(t, bucket{1, 7}, c.Lines[0].Pending)
	require.Equal(t, bucket{1, 7}, c.Lines[0].Ingested)

	t.Run("a window of a feature now exported per event", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, true)
		op := h.as(h.token("op", auth.RoleOperator))
		put := func(path string, body any) int {
			resp := h.request(http.MethodPut, path, op, body)
			require.Equal(t, http.StatusOK, resp.status, "%s", resp)
			var v struct {
				MappingVersion int `json:"mapping_version"`
			}
			resp.decode(t, &v)
			return v.MappingVersion
		}
		put("/v1/mappings/features/api", map[string]any{"event_name": "api_calls", "aggregation": "sum"})
		hour := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour)
		resp := h.request(http.MethodPost, "/v1/usage", h.as(h.token("ing", auth.RoleIngest)), batch(
			event{"id": "w1", "tenant": "beta", "feature": "api", "value": 2, "timestamp": rfc(hour.Add(time.Minute))},
			event{"id": "w2", "tenant": "beta", "feature": "api", "value": 3, "timestamp": rfc(hour.Add(2 * time.Minute))},
		))
		require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
		require.Equal(t, meter.PassResult{Items: 1, Quarantined: 1, Events: 2}, h.pass())
		var id int64
		require.NoError(t, h.pool.QueryRow(h.ctx, "SELECT id FROM outbox_items WHERE quarantine_reason = 'no_customer'").Scan(&id))

		tv := put("/v1/mappings/tenants/beta", map[string]any{"stripe_customer_id": "cus_beta"})
		fv := put("/v1/mappings/features/api", map[string]any{"event_name": "api_calls", "aggregation": "count"})
		resp = h.request(http.MethodPost, fmt.Sprintf("/v1/outbox/items/%d/requeue", id), op, map[string]any{"mapping_version": max(tv, fv)})
		require.Equal(t, http.StatusConflict, resp.status, "%s", resp)
		require.Equal(t, "aggregation_changed", resp.errorCode(t))

		fv = put("/v1/mappings/features/api", map[string]any{"event_name": "api_calls", "aggregation": "last"})
		resp = h.request(http.MethodPost, fmt.Sprintf("/v1/outbox/items/%d/requeue", id), op, map[string]any{"mapping_version": max(tv, fv)})
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		var rq requeueResult
		resp.decode(t, &rq)
		require.Equal(t, quarantine.ActionReaddressed, rq.Action)
		resp = h.request(http.MethodGet, fmt.Sprintf("/v1/outbox/items/%d", *rq.Successor), h.as(h.token("fin", auth.RoleFinance)), nil)
		var succ itemView
		resp.decode(t, &succ)
		require.EqualValues(t, 3, succ.Payload.Value, "rebuilt as the window's last value")
		require.Equal(t, "cus_beta", succ.Payload.Customer)
	})

	t.Run("stalled export", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, false)
		var id int64
		require.NoError(t, pgx.BeginFunc(h.ctx, h.pool, func(tx pgx.Tx) error {
			enq, err := h.parts.Outbox.Enqueue(h.ctx, tx, outbox.NewItem{
				Identity: outbox.Identity{TenantKey: "acme", SubjectKind: outbox.SubjectUsageEvent, SubjectRef: "event:gpu:u1",
					Exporter: "stripe_meter_events", DestinationAccount: "acct_1", Mode: outbox.ModeTest},
				Payload:    outbox.Payload{Value: 1, Timestamp: at.Unix(), Feature: "gpu", Period: period},
				Quarantine: outbox.ReasonFeatureUnmapped,
			})
			id = enq.ID
			return err
		}))
		resp := h.request(http.MethodPost, fmt.Sprintf("/v1/outbox/items/%d/requeue", id),
			h.as(h.token("op", auth.RoleOperator)), map[string]any{"mapping_version": 0})
		require.Equal(t, http.StatusConflict, resp.status, "%s", resp)
		require.Equal(t, "export_stalled", resp.errorCode(t))
	})
}
