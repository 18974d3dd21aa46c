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

// Quarantine: the report of what was not billed (JSON and CSV), and the
// requeue that bills it once its mapping is fixed.

// requeueResult is the answer of POST /v1/outbox/items/{id}/requeue.
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
	t.Run("an unmapped feature", testQuarantineUnmappedFeature)
	t.Run("a window of a feature now exported per event", testRequeueWindowNowPerEvent)
	t.Run("stalled export", testRequeueStalledExport)
}

// quarantineScenario is what the steps of testQuarantineUnmappedFeature
// share besides the database.
type quarantineScenario struct {
	op, fin, ing string
	tenant       tenantView // acme's mapping
	at           time.Time  // when the usage occurred
	period       string     // the start of its billing period, RFC 3339
	old          ItemView   // the quarantined item
	current      int        // the mapping version once the feature is mapped
	successor    int64      // the item the requeue re-addressed old to
}

// requeue asks, as the operator, to requeue the item id.
func (s *quarantineScenario) requeue(h *harness, id any, body any) response {
	return h.request(http.MethodPost, fmt.Sprintf("/v1/outbox/items/%v/requeue", id), s.op, body)
}

// testQuarantineUnmappedFeature follows one usage event of a feature without
// a mapping: quarantined at staging, reported, refused a requeue until the
// feature is mapped, then re-addressed and counted once.
func testQuarantineUnmappedFeature(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	s := &quarantineScenario{op: h.as(h.token("operator", auth.RoleOperator)),
		fin: h.as(h.token("finance", auth.RoleFinance)), ing: h.as(h.token("ingest", auth.RoleIngest))}
	// In order, on one database: each step reads the items, mappings and
	// versions the steps before it left.
	runSteps(t, h,
		step{"quarantined at staging", s.stage},
		step{"the item", s.showsItem},
		step{"the report as JSON", s.reportsJSON},
		step{"the report as CSV", s.reportsCSV},
		step{"no CSV cell starts a formula", s.neutralisesFormulas},
		step{"requeue while the feature is unmapped", s.requeueStillIneligible},
		step{"the feature mapped", s.mapFeature},
		step{"requeue refused", s.requeueRefused},
		step{"requeue re-addresses", s.requeueReaddresses},
		step{"requeue twice", s.requeueTwice},
		step{"counted once", s.countedOnce},
	)
}

func (s *quarantineScenario) stage(t *testing.T, h *harness) {
	resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", s.op, map[string]any{"stripe_customer_id": "cus_acme"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	resp.decode(t, &s.tenant)

	s.at = time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Second)
	resp = h.request(http.MethodPost, "/v1/usage", s.ing, batch(event{"id": "u1", "tenant": "acme", "feature": "gpu", "value": 7, "timestamp": rfc(s.at)}))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	res := h.pass()
	require.Equal(t, meter.PassResult{Items: 1, Quarantined: 1, Events: 1}, res)
	s.period = meter.PeriodStart(s.at, meter.CalendarAnchor).Format(time.RFC3339)
}

// showsItem: the item, as the API shows it.
func (s *quarantineScenario) showsItem(t *testing.T, h *harness) {
	resp := h.request(http.MethodGet, "/v1/outbox/items?state=quarantined", s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var list struct {
		Items     []ItemView `json:"items"`
		NextAfter int64      `json:"next_after"`
	}
	resp.decode(t, &list)
	require.Len(t, list.Items, 1)
	s.old = list.Items[0]
	require.Equal(t, "feature_unmapped", s.old.Reason)
	require.Equal(t, s.tenant.MappingVersion, s.old.MappingVersion)
	require.Equal(t, "event:gpu:u1", s.old.SubjectRef)
}

func (s *quarantineScenario) reportsJSON(t *testing.T, h *harness) {
	resp := h.request(http.MethodGet, "/v1/quarantine", s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.JSONEq(t, fmt.Sprintf(`{"groups":[{"reason":"feature_unmapped","tenant":"acme","feature":"gpu","period":%q,"items":1,"events":1,"value":7}],
		"totals":[{"reason":"feature_unmapped","items":1,"events":1,"value":7}]}`, s.period), string(resp.body))
	resp = h.request(http.MethodGet, "/v1/quarantine?reason=no_customer", s.fin, nil)
	require.JSONEq(t, `{"groups":[],"totals":[]}`, string(resp.body))
	resp = h.request(http.MethodGet, "/v1/quarantine?format=json&tenant=acme&period="+s.period[:7], s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.Contains(t, string(resp.body), `"value":7`)
	for _, q := range []string{"format=xml", "period=2026-13", "period=2026-1"} {
		resp = h.request(http.MethodGet, "/v1/quarantine?"+q, s.fin, nil)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", q, resp)
	}
}

func (s *quarantineScenario) reportsCSV(t *testing.T, h *harness) {
	resp := h.request(http.MethodGet, "/v1/quarantine?format=csv", s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.True(t, strings.HasPrefix(resp.header.Get("Content-Type"), "text/csv"), resp.header.Get("Content-Type"))
	records, err := csv.NewReader(bytes.NewReader(resp.body)).ReadAll()
	require.NoError(t, err)
	require.Equal(t, [][]string{
		{"reason", "tenant", "feature", "period", "items", "events", "value"},
		{"feature_unmapped", "acme", "gpu", s.period, "1", "1", "7"},
	}, records)
}

// neutralisesFormulas: no API input can start a cell with a formula
// character (tenants and features are tokens), so such items are enqueued
// through the outbox itself to prove the CSV neutralises them.
func (s *quarantineScenario) neutralisesFormulas(t *testing.T, h *harness) {
	hostile := []string{"=HYPERLINK(\"http://x\")", "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"}
	err := pgx.BeginFunc(h.ctx, h.pool, func(tx pgx.Tx) error {
		for i, bad := range hostile {
			_, err := h.parts.Outbox.Enqueue(h.ctx, tx, outbox.NewItem{
				Identity: outbox.Identity{TenantKey: bad, SubjectKind: outbox.SubjectUsageEvent, SubjectRef: fmt.Sprintf("event:x:%d", i),
					Exporter: "stripe_meter_events", DestinationAccount: "acct_1", Mode: outbox.ModeTest},
				Payload:    outbox.Payload{Value: -int64(i), Timestamp: s.at.Unix(), Feature: bad, Period: s.period},
				Quarantine: outbox.ReasonFeatureUnmapped,
			})
			if err != nil {
				return err
			}
		}
		return nil
	})
	require.NoError(t, err)
	resp := h.request(http.MethodGet, "/v1/quarantine?format=csv", s.fin, nil)
	records, err := csv.NewReader(bytes.NewReader(resp.body)).ReadAll()
	require.NoError(t, err)
	require.Len(t, records, 2+len(hostile))
	for _, bad := range hostile {
		found := false
		for _, rec := range records[1:] {
			if rec[1] == "'"+bad {
				found = true
				require.Equal(t, "'"+bad, rec[2], "the feature cell")
			}
			for _, cell := range rec[:4] {
				require.False(t, cell != "" && strings.ContainsRune("=+-@\t\r", rune(cell[0])), "an unescaped text cell: %q", cell)
			}
		}
		require.True(t, found, "no escaped row for %q in %q", bad, records)
	}
}

// requeueStillIneligible: a requeue while the feature is still unmapped is
// refused.
func (s *quarantineScenario) requeueStillIneligible(t *testing.T, h *harness) {
	resp := s.requeue(h, s.old.ID, map[string]any{"mapping_version": s.tenant.MappingVersion})
	require.Equal(t, http.StatusConflict, resp.status, "%s", resp)
	require.Equal(t, "still_ineligible", resp.errorCode(t))
}

func (s *quarantineScenario) mapFeature(t *testing.T, h *harness) {
	resp := h.request(http.MethodPut, "/v1/mappings/features/gpu", s.op, map[string]any{"event_name": "gpu_seconds", "aggregation": "sum"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var feature featureView
	resp.decode(t, &feature)
	s.current = max(feature.MappingVersion, s.tenant.MappingVersion)
}

// requeueRefused: a wrong version, a bad request or an unknown item is
// refused and changes nothing.
func (s *quarantineScenario) requeueRefused(t *testing.T, h *harness) {
	var resp response
	for name, v := range map[string]int{"the version staged with": s.tenant.MappingVersion, "zero": 0, "ahead": s.current + 1} {
		resp = s.requeue(h, s.old.ID, map[string]any{"mapping_version": v})
		require.Equal(t, http.StatusConflict, resp.status, "%s: %s", name, resp)
		require.Equal(t, "mapping_changed", resp.errorCode(t), name)
	}
	resp = s.requeue(h, s.old.ID, map[string]any{})
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
	require.Equal(t, "invalid_request", resp.errorCode(t))
	require.Equal(t, "mapping_version", resp.problems(t)[0].Field)
	for name, body := range map[string]string{
		"not a number":  `{"mapping_version":"3"}`,
		"unknown field": fmt.Sprintf(`{"mapping_version":%d,"force":true}`, s.current),
		"no body":       ``,
	} {
		resp = s.requeue(h, s.old.ID, body)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_json", resp.errorCode(t), name)
	}
	for _, id := range []string{"999999", "0", "-1", "abc"} {
		resp = s.requeue(h, id, map[string]any{"mapping_version": s.current})
		require.Equal(t, http.StatusNotFound, resp.status, "%s: %s", id, resp)
		require.Equal(t, "not_found", resp.errorCode(t))
	}
	resp = h.request(http.MethodGet, fmt.Sprintf("/v1/outbox/items/%d", s.old.ID), s.fin, nil)
	var still ItemView
	resp.decode(t, &still)
	require.Equal(t, "quarantined", still.State, "a refused requeue changes nothing")
}

func (s *quarantineScenario) requeueReaddresses(t *testing.T, h *harness) {
	resp := s.requeue(h, s.old.ID, map[string]any{"mapping_version": s.current})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var rq requeueResult
	resp.decode(t, &rq)
	require.Equal(t, s.old.ID, rq.ItemID)
	require.Equal(t, quarantine.ActionReaddressed, rq.Action)
	require.NotNil(t, rq.Successor)
	require.NotEqual(t, s.old.ID, *rq.Successor)
	require.Equal(t, s.current, rq.MappingVersion)

	resp = h.request(http.MethodGet, fmt.Sprintf("/v1/outbox/items/%d", s.old.ID), s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var closed ItemView
	resp.decode(t, &closed)
	require.Equal(t, "superseded", closed.State)
	require.NotNil(t, closed.SupersededBy)
	require.Equal(t, *rq.Successor, *closed.SupersededBy)
	require.Equal(t, s.old.Identifier, closed.Identifier, "the predecessor keeps its identity")

	resp = h.request(http.MethodGet, fmt.Sprintf("/v1/outbox/items/%d", *rq.Successor), s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var succ ItemView
	resp.decode(t, &succ)
	require.Equal(t, "pending", succ.State)
	require.Equal(t, s.current, succ.MappingVersion)
	require.Equal(t, s.old.SubjectRef, succ.SubjectRef)
	require.NotEqual(t, s.old.Identifier, succ.Identifier)
	require.Equal(t, outbox.Payload{Customer: "cus_acme", EventName: "gpu_seconds", Value: 7, Timestamp: s.at.Unix(),
		Identifier: succ.Identifier, Feature: "gpu", Period: s.period}, succ.Payload)
	s.successor = *rq.Successor
}

// requeueTwice: neither the item nor its successor is quarantined any more.
func (s *quarantineScenario) requeueTwice(t *testing.T, h *harness) {
	resp := s.requeue(h, s.old.ID, map[string]any{"mapping_version": s.current})
	require.Equal(t, http.StatusConflict, resp.status, "%s", resp)
	require.Equal(t, "not_quarantined", resp.errorCode(t))
	resp = s.requeue(h, s.successor, map[string]any{"mapping_version": s.current})
	require.Equal(t, http.StatusConflict, resp.status, "%s", resp)
}

// countedOnce: the usage is counted once, under the successor.
func (s *quarantineScenario) countedOnce(t *testing.T, h *harness) {
	resp := h.request(http.MethodGet, "/v1/quarantine?tenant=acme", s.fin, nil)
	require.JSONEq(t, `{"groups":[],"totals":[]}`, string(resp.body))
	c := completeness(t, h, s.fin, s.period[:7]+"&tenant=acme")
	require.True(t, c.Holds, "%+v", c)
	require.Len(t, c.Lines, 1)
	require.Equal(t, bucket{1, 7}, c.Lines[0].Pending)
	require.Equal(t, bucket{1, 7}, c.Lines[0].Ingested)
}

// testRequeueWindowNowPerEvent: a window staged under one aggregation is not
// requeued under another (aggregation_changed) unless it can be rebuilt
// from its events (last).
func testRequeueWindowNowPerEvent(t *testing.T) {
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
	var succ ItemView
	resp.decode(t, &succ)
	require.EqualValues(t, 3, succ.Payload.Value, "rebuilt as the window's last value")
	require.Equal(t, "cus_beta", succ.Payload.Customer)
}

// testRequeueStalledExport: without a Stripe key export is stalled, and a
// requeue says so.
func testRequeueStalledExport(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	at := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Second)
	period := meter.PeriodStart(at, meter.CalendarAnchor).Format(time.RFC3339)
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
}
