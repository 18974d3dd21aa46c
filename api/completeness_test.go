package api_test

import (
	"bytes"
	"encoding/csv"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// Completeness: every ingested unit in exactly one state, per tenant,
// feature and billing period; and the outbox reads over the same items.

// completenessScenario is what the steps of TestCompletenessEndpoint share
// besides the database.
type completenessScenario struct {
	op, fin, ing string
	base         time.Time // the hour the usage falls in
	period       time.Time // the calendar period of base
	month        string    // period as a month, as the report takes it
	gammaPeriod  time.Time // gamma's period of base (it bills from the 15th)
	gammaMonth   string
}

// ts is the timestamp m minutes into the base hour.
func (s *completenessScenario) ts(m int) string {
	return rfc(s.base.Add(time.Duration(m) * time.Minute))
}

func TestCompletenessEndpoint(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	s := &completenessScenario{op: h.as(h.token("operator", auth.RoleOperator)),
		fin: h.as(h.token("finance", auth.RoleFinance)), ing: h.as(h.correctingToken("ingest", auth.RoleIngest))}
	// In order, on one database: each step reads the usage, items and
	// periods the steps before it left.
	runSteps(t, h,
		step{"invalid period", s.invalidPeriod},
		step{"usage ingested", s.ingest},
		step{"before the pass", s.beforePass},
		step{"after the pass", s.afterPass},
		step{"late usage", s.lateUsage},
		step{"one tenant, and a month without usage", s.filters},
		step{"as CSV", s.asCSV},
		step{"the latest audit", s.audit},
		step{"outbox summary", s.outboxSummary},
		step{"outbox items", s.outboxItems},
	)
}

func (s *completenessScenario) invalidPeriod(t *testing.T, h *harness) {
	for _, q := range []string{"", "?period=", "?period=2026-13", "?period=2026-00", "?period=2026-1", "?period=26-11", "?period=2026-11-01", "?tenant=acme"} {
		resp := h.request(http.MethodGet, "/v1/reports/completeness"+q, s.fin, nil)
		require.Equal(t, http.StatusBadRequest, resp.status, "%q: %s", q, resp)
		require.Equal(t, "invalid_period", resp.errorCode(t), q)
	}
}

// ingest maps acme, gamma and three features, and posts usage of mapped
// and unmapped tenants and features.
func (s *completenessScenario) ingest(t *testing.T, h *harness) {
	for path, body := range map[string]map[string]any{
		"/v1/mappings/tenants/acme":    {"stripe_customer_id": "cus_acme"},
		"/v1/mappings/tenants/gamma":   {"stripe_customer_id": "cus_gamma", "period_anchor": "2026-01-15T10:30:00Z"},
		"/v1/mappings/features/api":    {"event_name": "api_calls", "aggregation": "sum"},
		"/v1/mappings/features/seats":  {"event_name": "seats", "aggregation": "last"},
		"/v1/mappings/features/logins": {"event_name": "logins", "aggregation": "count"},
	} {
		resp := h.request(http.MethodPut, path, s.op, body)
		require.Equal(t, http.StatusOK, resp.status, "%s: %s", path, resp)
	}
	s.base = time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour)
	resp := h.request(http.MethodPost, "/v1/usage", s.ing, batch(
		event{"id": "a1", "tenant": "acme", "feature": "api", "value": 5, "timestamp": s.ts(1)},
		event{"id": "a2", "tenant": "acme", "feature": "api", "value": 10, "timestamp": s.ts(20)},
		event{"id": "a3", "tenant": "acme", "feature": "api", "value": -3, "timestamp": s.ts(40)},
		event{"id": "s1", "tenant": "acme", "feature": "seats", "value": 4, "timestamp": s.ts(5)},
		event{"id": "s2", "tenant": "acme", "feature": "seats", "value": 9, "timestamp": s.ts(50)},
		event{"id": "l1", "tenant": "acme", "feature": "logins", "value": 1, "timestamp": s.ts(2)},
		event{"id": "l2", "tenant": "acme", "feature": "logins", "value": 1, "timestamp": s.ts(3)},
		event{"id": "g1", "tenant": "acme", "feature": "gpu", "value": 2, "timestamp": s.ts(4)},
		event{"id": "b1", "tenant": "beta", "feature": "api", "value": 8, "timestamp": s.ts(6)},
		event{"id": "c1", "tenant": "gamma", "feature": "api", "value": 11, "timestamp": s.ts(7)},
	))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.EqualValues(t, 2, h.count("SELECT count(*) FROM usage_events WHERE item_id IS NOT NULL"),
		"per-event usage is staged in the ingest transaction")
	s.period = meter.PeriodStart(s.base, meter.CalendarAnchor)
	s.month = s.period.Format("2006-01")
	// gamma bills from the 15th, 10:30 UTC: its period may start in another
	// month than the calendar one.
	s.gammaPeriod = meter.PeriodStart(s.base, time.Date(2026, 1, 15, 10, 30, 0, 0, time.UTC))
	s.gammaMonth = s.gammaPeriod.Format("2006-01")
}

func (s *completenessScenario) beforePass(t *testing.T, h *harness) {
	before := completeness(t, h, s.fin, s.month)
	require.True(t, before.Holds, "%+v", before)
	for _, l := range before.Lines {
		if l.Feature != "logins" {
			require.Equal(t, l.Ingested, l.Unstaged, "%+v", l)
			require.Equal(t, l.Ingested, l.Pending, "%+v", l)
		}
	}
}

func (s *completenessScenario) afterPass(t *testing.T, h *harness) {
	h.pass()
	require.Zero(t, h.count("SELECT count(*) FROM usage_events WHERE item_id IS NULL"))
	c := completeness(t, h, s.fin, s.month)
	require.Equal(t, s.month, c.Period)
	require.True(t, c.Holds, "%+v", c)
	type key struct{ tenant, feature string }
	lines := map[key]completenessLine{}
	for _, l := range c.Lines {
		require.True(t, l.Holds, "%+v", l)
		if l.Tenant == "gamma" {
			continue // read below, by its own period
		}
		require.Equal(t, s.period.Format(time.RFC3339), l.Period)
		sum := bucket{}
		for _, b := range []bucket{l.Confirmed, l.Accepted, l.Pending, l.Quarantined, l.Uncertain, l.Rejected} {
			sum.Events += b.Events
			sum.Value += b.Value
		}
		require.Equal(t, l.Ingested, sum, "%+v", l)
		require.Zero(t, l.InconsistentItems)
		require.Equal(t, bucket{}, l.Unstaged)
		lines[key{l.Tenant, l.Feature}] = l
	}
	require.Len(t, lines, 5)
	g := completeness(t, h, s.fin, s.gammaMonth+"&tenant=gamma")
	require.True(t, g.Holds, "%+v", g)
	require.Len(t, g.Lines, 1, "%+v", g)
	require.Equal(t, s.gammaPeriod.Format(time.RFC3339), g.Lines[0].Period)
	require.Equal(t, bucket{1, 11}, g.Lines[0].Pending)
	require.Equal(t, bucket{1, 11}, g.Lines[0].Ingested)
	require.EqualValues(t, 1, h.count("SELECT count(*) FROM outbox_items WHERE tenant_key = 'gamma' AND payload->>'period' = $1",
		s.gammaPeriod.Format(time.RFC3339)))
	require.Equal(t, bucket{3, 12}, lines[key{"acme", "api"}].Pending)
	require.Equal(t, bucket{2, 13}, lines[key{"acme", "seats"}].Pending)
	require.Equal(t, bucket{2, 2}, lines[key{"acme", "logins"}].Pending)
	require.Equal(t, bucket{1, 2}, lines[key{"acme", "gpu"}].Quarantined)
	require.Equal(t, bucket{1, 8}, lines[key{"beta", "api"}].Quarantined)
}

// lateUsage: late usage for a staged window becomes its supplement; the
// identity still holds.
func (s *completenessScenario) lateUsage(t *testing.T, h *harness) {
	resp := h.request(http.MethodPost, "/v1/usage", s.ing, batch(event{"id": "a4", "tenant": "acme", "feature": "api", "value": 100, "timestamp": s.ts(59)}))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.Equal(t, meter.PassResult{Items: 1, Events: 1}, h.pass())
	require.EqualValues(t, 1, h.count("SELECT count(*) FROM outbox_items WHERE subject_ref LIKE 'usage:api:%#1'"))
	c := completeness(t, h, s.fin, s.month+"&tenant=acme")
	require.True(t, c.Holds, "%+v", c)
	for _, l := range c.Lines {
		if l.Feature == "api" {
			require.Equal(t, bucket{4, 112}, l.Pending)
			require.Equal(t, bucket{4, 112}, l.Ingested)
		}
	}
}

func (s *completenessScenario) filters(t *testing.T, h *harness) {
	only := completeness(t, h, s.fin, s.month+"&tenant=beta")
	require.Len(t, only.Lines, 1)
	require.Equal(t, "beta", only.Lines[0].Tenant)
	empty := completeness(t, h, s.fin, "2001-01")
	require.Equal(t, completenessReport{Period: "2001-01", Lines: []completenessLine{}, Holds: true, AsOf: empty.AsOf}, empty)
	resp := h.request(http.MethodGet, "/v1/reports/completeness?period="+s.month+"&refresh=maybe", s.fin, nil)
	require.Equal(t, http.StatusBadRequest, resp.status, "%s", resp)
	require.Contains(t, string(resp.body), "invalid_refresh")
}

func (s *completenessScenario) asCSV(t *testing.T, h *harness) {
	want := completeness(t, h, s.fin, s.month)
	resp := h.request(http.MethodGet, "/v1/reports/completeness?format=csv&period="+s.month, s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.Equal(t, "text/csv; charset=utf-8", resp.header.Get("Content-Type"))
	require.Contains(t, resp.header.Get("Content-Disposition"), "tally-completeness-"+s.month+".csv")
	rows, err := csv.NewReader(bytes.NewReader(resp.body)).ReadAll()
	require.NoError(t, err)
	require.Equal(t, []string{"tenant", "feature", "period", "destination_accounts", "ingested_events", "ingested_value"}, rows[0][:6])
	require.Len(t, rows, len(want.Lines)+1, "a row a line")
	for i, l := range want.Lines {
		row := rows[i+1]
		require.Equal(t, []string{l.Tenant, l.Feature, l.Period, strings.Join(l.Accounts, " "), strconv.FormatInt(l.Ingested.Events, 10), strconv.FormatInt(l.Ingested.Value, 10)}, row[:6])
		require.Equal(t, strconv.FormatBool(l.Holds), row[len(row)-2])
		// The harness computes anew for every request (no TALLY_REPORT_MAX_AGE).
		require.GreaterOrEqual(t, row[len(row)-1], want.AsOf, "the snapshot's as_of on every row")
	}
	resp = h.request(http.MethodGet, "/v1/reports/completeness?period="+s.month+"&tenat=acme", s.fin, nil)
	require.Equal(t, http.StatusBadRequest, resp.status, "an unknown parameter (a typo) is refused, not ignored: %s", resp)
	for _, bad := range []string{"xml", "CSV"} {
		resp := h.request(http.MethodGet, "/v1/reports/completeness?format="+bad+"&period="+s.month, s.fin, nil)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s", resp)
		require.Contains(t, string(resp.body), "invalid_format")
	}
}

func (s *completenessScenario) outboxSummary(t *testing.T, h *harness) {
	resp := h.request(http.MethodGet, "/v1/outbox/summary", s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var summary struct {
		Counts map[string]int64 `json:"counts"`
		Oldest float64          `json:"oldest_pending_age_seconds"`
	}
	resp.decode(t, &summary)
	want := map[string]int64{}
	for _, st := range outbox.States {
		want[string(st)] = 0
	}
	want["pending"], want["quarantined"] = 6, 2
	require.Equal(t, want, summary.Counts)
	require.GreaterOrEqual(t, summary.Oldest, 0.0)
}

// outboxItems: pages of items by state and tenant, by feature, refused
// queries, and one item.
func (s *completenessScenario) outboxItems(t *testing.T, h *harness) {
	var ids []int64
	after := int64(0)
	for page := 0; page < 10; page++ {
		resp := h.request(http.MethodGet, fmt.Sprintf("/v1/outbox/items?state=pending&tenant=acme&limit=3&after=%d", after), s.fin, nil)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		var l struct {
			Items     []ItemView `json:"items"`
			NextAfter int64      `json:"next_after"`
		}
		resp.decode(t, &l)
		if len(l.Items) == 0 {
			break
		}
		for _, it := range l.Items {
			require.Equal(t, "pending", it.State)
			require.Equal(t, "acme", it.Tenant)
			ids = append(ids, it.ID)
		}
		if l.NextAfter == 0 {
			break // a partial page is the last
		}
		after = l.NextAfter
	}
	require.Len(t, ids, 5)
	require.True(t, slices.IsSorted(ids))

	resp := h.request(http.MethodGet, "/v1/outbox/items?feature=logins", s.fin, nil)
	var l struct {
		Items []ItemView `json:"items"`
	}
	resp.decode(t, &l)
	require.Len(t, l.Items, 2)
	for _, it := range l.Items {
		require.Equal(t, "usage_event", it.SubjectKind)
		require.Equal(t, "logins", it.Payload.Feature)
	}
	for _, q := range []string{"state=nosuch", "limit=0", "limit=1001", "limit=x", "after=-1", "after=x"} {
		resp := h.request(http.MethodGet, "/v1/outbox/items?"+q, s.fin, nil)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", q, resp)
	}
	resp = h.request(http.MethodGet, "/v1/outbox/items/"+url.PathEscape(strconv.FormatInt(ids[0], 10)), s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var it ItemView
	resp.decode(t, &it)
	require.Equal(t, ids[0], it.ID)
	require.Len(t, it.Identifier, 68)
}

// audit: the latest audit of the month's counters, after none (404), a
// clean one, and one that found a counter changed by hand.
func (s *completenessScenario) audit(t *testing.T, h *harness) {
	for _, q := range []string{"", "?period=2026-13", "?tenant=acme"} {
		resp := h.request(http.MethodGet, "/v1/reports/completeness/audit"+q, s.fin, nil)
		require.Equal(t, http.StatusBadRequest, resp.status, "%q: %s", q, resp)
	}
	resp := h.request(http.MethodGet, "/v1/reports/completeness/audit?period="+s.month, s.fin, nil)
	require.Equal(t, http.StatusNotFound, resp.status, "%s", resp)
	require.Equal(t, "not_found", resp.errorCode(t))

	a, err := quarantine.AuditCompleteness(h.ctx, h.pool, s.month, quarantine.AuditVerify, 0)
	require.NoError(t, err)
	require.Zero(t, a.DriftKeys, "%v", a.Drift)
	require.NoError(t, quarantine.RecordAudit(h.ctx, h.pool, &a, "test"))
	_, err = h.pool.Exec(h.ctx, `UPDATE completeness_counters SET confirmed_events = confirmed_events + 2
		WHERE (period, tenant, feature, account, slot) = (SELECT period, tenant, feature, account, slot FROM completeness_counters
		                                                  WHERE period = $1 AND tenant = 'acme' AND feature = 'api' LIMIT 1)`, s.period)
	require.NoError(t, err)
	a, err = quarantine.AuditCompleteness(h.ctx, h.pool, s.month, quarantine.AuditNightly, 0)
	require.NoError(t, err)
	require.NoError(t, quarantine.RecordAudit(h.ctx, h.pool, &a, "nightly"))

	resp = h.request(http.MethodGet, "/v1/reports/completeness/audit?period="+s.month, s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var got quarantine.Audit
	resp.decode(t, &got)
	require.Equal(t, a.ID, got.ID)
	require.Equal(t, "nightly", got.Kind)
	require.Len(t, got.Drift, 1)
	require.Equal(t, "acme", got.Drift[0].Tenant)
	require.Equal(t, "api", got.Drift[0].Feature)
	require.Equal(t, "confirmed", got.Drift[0].Bucket)
	require.Equal(t, got.Drift[0].Ledger.Events+2, got.Drift[0].Counters.Events)
	_, err = quarantine.RepairCompleteness(h.ctx, h.pool, s.month, "test", 0)
	require.NoError(t, err)
}
