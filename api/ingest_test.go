package api_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/meter"
)

// Ingest: POST /v1/usage validates a batch whole, stores it once, and keeps
// to its size limits and the token's tenants.

// TestUsageIngest runs each concern of POST /v1/usage on its own database.
func TestUsageIngest(t *testing.T) {
	t.Parallel()
	t.Run("validation", testIngestValidation)
	t.Run("duplicates and changed content", testIngestDuplicates)
	t.Run("size limits", testIngestSizeLimits)
	t.Run("tenant scope", testIngestTenantScope)
	t.Run("corrections permission", testIngestCorrectionsPermission)
}

// eventTime is the timestamp of validEvent and of the first events the
// duplicate checks post.
const eventTime = "2026-01-30T12:00:00Z"

// validEvent is an event every check accepts.
func validEvent() event {
	return event{"id": "ok-1", "tenant": "acme", "feature": "api", "value": 1, "timestamp": eventTime}
}

// eventWith is validEvent with another id and k set to v.
func eventWith(k string, v any) event {
	e := validEvent()
	e["id"] = "bad-1"
	e[k] = v
	return e
}

// eventWithout is validEvent with another id and without k.
func eventWithout(k string) event {
	e := validEvent()
	e["id"] = "bad-1"
	delete(e, k)
	return e
}

// ingestScenario holds what the steps of an ingest scenario share besides
// the database: the Authorization header of an ingest token.
type ingestScenario struct{ tok string }

func testIngestValidation(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	// It may post corrections: the valid edges include negative values.
	s := ingestScenario{tok: h.as(h.correctingToken("ingest", auth.RoleIngest))}
	// In order, on one database: after the refusals, nothing is stored.
	runSteps(t, h,
		step{"one problem of one event", s.refusesEachEventProblem},
		step{"every problem of every event at once", s.reportsEveryProblemInOrder},
		step{"problems of the batch as a whole", s.refusesBatchProblems},
		step{"bodies that are not a JSON object", s.refusesNonObjectBodies},
		step{"an invalid batch stores nothing", func(t *testing.T, h *harness) {
			require.Zero(t, h.count("SELECT count(*) FROM usage_events"), "an invalid batch stores nothing")
		}},
		step{"the valid edges", s.acceptsValidEdges},
	)
}

func (s ingestScenario) refusesEachEventProblem(t *testing.T, h *harness) {
	one := 1
	cases := []struct {
		name  string
		bad   any // the second event of the batch
		field string
	}{
		{"missing id", eventWithout("id"), "id"},
		{"missing tenant", eventWithout("tenant"), "tenant"},
		{"missing feature", eventWithout("feature"), "feature"},
		{"missing value", eventWithout("value"), "value"},
		{"unknown field", eventWith("extra", 1), "extra"},
		{"empty id", eventWith("id", ""), "id"},
		{"id of 129 characters", eventWith("id", strings.Repeat("x", 129)), "id"},
		{"non-ASCII id", eventWith("id", "événement"), "id"},
		{"control character in id", eventWith("id", "a\tb"), "id"},
		{"id not a string", eventWith("id", 5), "id"},
		{"tenant starting with a dash", eventWith("tenant", "-acme"), "tenant"},
		{"tenant with a space", eventWith("tenant", "ac me"), "tenant"},
		{"tenant of 65 characters", eventWith("tenant", strings.Repeat("a", 65)), "tenant"},
		{"tenant not a string", eventWith("tenant", 7), "tenant"},
		{"feature with a slash", eventWith("feature", "api/v2"), "feature"},
		{"feature with a pipe", eventWith("feature", "a|b"), "feature"},
		{"value as a string", eventWith("value", "5"), "value"},
		{"value with a fraction", eventWith("value", json.Number("1.5")), "value"},
		{"value with an exponent", eventWith("value", json.Number("1e3")), "value"},
		{"value over int64", eventWith("value", json.Number("9223372036854775808")), "value"},
		{"value under int64", eventWith("value", json.Number("-9223372036854775809")), "value"},
		{"value null", eventWith("value", nil), "value"},
		{"value a boolean", eventWith("value", true), "value"},
		{"timestamp not RFC 3339", eventWith("timestamp", "2026-11-30 12:00:00"), "timestamp"},
		{"timestamp a date", eventWith("timestamp", "2026-11-30"), "timestamp"},
		{"timestamp a number", eventWith("timestamp", 1764504000), "timestamp"},
		{"timestamp over 24h ahead", eventWith("timestamp", rfc(time.Now().Add(25*time.Hour))), "timestamp"},
		{"timestamp before 2000", eventWith("timestamp", "1999-12-31T23:59:59Z"), "timestamp"},
		{"event not an object", 5, ""},
		{"event an array", []any{}, ""},
	}
	for _, tc := range cases {
		resp := h.request(http.MethodPost, "/v1/usage", s.tok, map[string]any{"events": []any{validEvent(), tc.bad}})
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", tc.name, resp)
		require.Equal(t, "invalid_batch", resp.errorCode(t), tc.name)
		require.Contains(t, string(resp.body), `"message":"1 problem; nothing was stored"`, tc.name)
		ps := resp.problems(t)
		require.Len(t, ps, 1, "%s: %s", tc.name, resp)
		require.Equal(t, &one, ps[0].Index, tc.name)
		require.Equal(t, tc.field, ps[0].Field, tc.name)
		require.NotEmpty(t, ps[0].Reason, tc.name)
	}
}

// reportsEveryProblemInOrder: every problem of every event at once, in
// index order.
func (s ingestScenario) reportsEveryProblemInOrder(t *testing.T, h *harness) {
	resp := h.request(http.MethodPost, "/v1/usage", s.tok, batch(eventWith("value", "x"), validEvent(), event{"id": "", "tenant": "-", "feature": "f", "value": 1.5}))
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
	var where []string
	for _, p := range resp.problems(t) {
		require.NotNil(t, p.Index)
		where = append(where, fmt.Sprintf("%d:%s", *p.Index, p.Field))
	}
	require.Equal(t, []string{"0:value", "2:id", "2:tenant", "2:value"}, where)
}

// refusesBatchProblems: problems of the batch as a whole have index null.
func (s ingestScenario) refusesBatchProblems(t *testing.T, h *harness) {
	for name, body := range map[string]string{
		"empty events":               `{"events":[]}`,
		"events an object":           `{"events":{}}`,
		"events a string":            `{"events":"x"}`,
		"events null":                `{"events":null}`,
		"no events":                  `{}`,
		"unknown top-level field":    `{"events":[{"id":"a","tenant":"acme","feature":"api","value":1}],"extra":1}`,
		"unknown field, empty batch": `{"batch":[]}`,
	} {
		resp := h.request(http.MethodPost, "/v1/usage", s.tok, body)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_batch", resp.errorCode(t), name)
		ps := resp.problems(t)
		require.NotEmpty(t, ps, name)
		require.Nil(t, ps[0].Index, "%s: %s", name, resp)
	}
}

// refusesNonObjectBodies: bodies that are not a JSON object answer 400.
func (s ingestScenario) refusesNonObjectBodies(t *testing.T, h *harness) {
	for name, body := range map[string]string{
		"truncated":     `{"events":[`,
		"not JSON":      `events=1`,
		"empty body":    ``,
		"an array":      `[]`,
		"null":          `null`,
		"trailing data": `{"events":[{"id":"a","tenant":"acme","feature":"api","value":1}]} {}`,
	} {
		resp := h.request(http.MethodPost, "/v1/usage", s.tok, body)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_json", resp.errorCode(t), name)
	}
}

// acceptsValidEdges: the edges that are valid.
func (s ingestScenario) acceptsValidEdges(t *testing.T, h *harness) {
	resp := h.request(http.MethodPost, "/v1/usage", s.tok, batch(
		event{"id": strings.Repeat("x", 128), "tenant": strings.Repeat("a", 64), "feature": "A0_.:-z", "value": json.Number("9223372036854775807")},
		event{"id": " !~|%", "tenant": "acme", "feature": "api", "value": json.Number("-9223372036854775808")},
		event{"id": "ts-null", "tenant": "acme", "feature": "api", "value": 0, "timestamp": nil},
		event{"id": "ts-ahead", "tenant": "acme", "feature": "api", "value": -3, "timestamp": rfc(time.Now().Add(23 * time.Hour))},
		event{"id": "ts-offset", "tenant": "acme", "feature": "api", "value": 2, "timestamp": "2026-01-30T13:00:00.123456789+01:00"},
	))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.JSONEq(t, `{"accepted":5,"duplicates":0,"unmapped":5}`, string(resp.body), "nothing is mapped: every event is counted unmapped")
	var at time.Time
	require.NoError(t, h.pool.QueryRow(h.ctx, "SELECT occurred_at FROM usage_events WHERE event_id = 'ts-offset'").Scan(&at))
	require.True(t, at.Equal(time.Date(2026, 1, 30, 12, 0, 0, 123456000, time.UTC)), at)
}

func testIngestDuplicates(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	s := ingestScenario{tok: h.as(h.token("ingest", auth.RoleIngest))}
	// In order, on one database: each step counts the rows the ones before
	// it stored.
	runSteps(t, h,
		step{"stored once", s.storesOnce},
		step{"changed content", s.refusesChangedContent},
		step{"metrics", s.countsInMetrics},
	)
}

// storesOnce: a replayed batch, and the same instant in another offset, are
// duplicates.
func (s ingestScenario) storesOnce(t *testing.T, h *harness) {
	first := batch(
		event{"id": "e1", "tenant": "acme", "feature": "api", "value": 5, "timestamp": eventTime},
		event{"id": "e2", "tenant": "acme", "feature": "api", "value": 6},
		event{"id": "e1", "tenant": "beta", "feature": "api", "value": 7, "timestamp": eventTime},
	)
	resp := h.request(http.MethodPost, "/v1/usage", s.tok, first)
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.JSONEq(t, `{"accepted":3,"duplicates":0,"unmapped":3}`, string(resp.body))
	require.Equal(t, "application/json", resp.header.Get("Content-Type"))

	resp = h.request(http.MethodPost, "/v1/usage", s.tok, first)
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.JSONEq(t, `{"accepted":0,"duplicates":3,"unmapped":0}`, string(resp.body), "duplicates are not counted unmapped again")

	// The same instant in another offset is the same content.
	resp = h.request(http.MethodPost, "/v1/usage", s.tok, batch(
		event{"id": "e1", "tenant": "acme", "feature": "api", "value": 5, "timestamp": "2026-01-30T13:00:00+01:00"},
		event{"id": "e3", "tenant": "acme", "feature": "api", "value": 1},
		event{"id": "e3", "tenant": "acme", "feature": "api", "value": 1},
	))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.JSONEq(t, `{"accepted":1,"duplicates":2,"unmapped":1}`, string(resp.body))
	require.EqualValues(t, 4, h.count("SELECT count(*) FROM usage_events"))
}

// refusesChangedContent: same id, different content: the event is invalid
// and nothing of the batch is stored.
func (s ingestScenario) refusesChangedContent(t *testing.T, h *harness) {
	for name, changed := range map[string]event{
		"value":             {"id": "e1", "tenant": "acme", "feature": "api", "value": 50, "timestamp": eventTime},
		"feature":           {"id": "e1", "tenant": "acme", "feature": "web", "value": 5, "timestamp": eventTime},
		"timestamp":         {"id": "e1", "tenant": "acme", "feature": "api", "value": 5, "timestamp": "2026-01-30T12:00:01Z"},
		"timestamp dropped": {"id": "e1", "tenant": "acme", "feature": "api", "value": 5},
		"timestamp added":   {"id": "e2", "tenant": "acme", "feature": "api", "value": 6, "timestamp": eventTime},
	} {
		resp := h.request(http.MethodPost, "/v1/usage", s.tok, batch(
			event{"id": "new-" + name, "tenant": "acme", "feature": "api", "value": 1},
			changed,
		))
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_batch", resp.errorCode(t))
		ps := resp.problems(t)
		require.Len(t, ps, 1, "%s: %s", name, resp)
		require.NotNil(t, ps[0].Index)
		require.Equal(t, 1, *ps[0].Index, name)
		require.Equal(t, "id", ps[0].Field, name)
		require.NotEmpty(t, ps[0].Reason, name)
	}
	// Within one batch too.
	resp := h.request(http.MethodPost, "/v1/usage", s.tok, batch(
		event{"id": "w1", "tenant": "acme", "feature": "api", "value": 1},
		event{"id": "w2", "tenant": "acme", "feature": "api", "value": 1},
		event{"id": "w1", "tenant": "acme", "feature": "api", "value": 2},
	))
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
	ps := resp.problems(t)
	require.Len(t, ps, 1, "%s", resp)
	require.Equal(t, 2, *ps[0].Index)
	require.Equal(t, "id", ps[0].Field)

	require.EqualValues(t, 4, h.count("SELECT count(*) FROM usage_events"), "a batch with a changed event stores nothing")
	require.EqualValues(t, 5, h.count("SELECT value FROM usage_events WHERE tenant = 'acme' AND event_id = 'e1'"))
}

// countsInMetrics: the API's metrics count what was stored and what was a
// duplicate.
func (s ingestScenario) countsInMetrics(t *testing.T, h *harness) {
	mfs, err := h.parts.Registry.Gather()
	require.NoError(t, err)
	counts := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" {
					counts[mf.GetName()+"/"+l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	require.Equal(t, 4.0, counts["tally_ingest_events_total/accepted"])
	require.Equal(t, 5.0, counts["tally_ingest_events_total/duplicate"])
	require.Equal(t, 3.0, counts["tally_ingest_requests_total/accepted"])
	require.Equal(t, 6.0, counts["tally_ingest_requests_total/invalid"])
}

func testIngestSizeLimits(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	tok := h.as(h.token("ingest", auth.RoleIngest))

	// A valid batch padded with spaces to exactly n bytes.
	padded := func(n int) []byte {
		head := []byte(`{"events":[{"id":"big","tenant":"acme","feature":"api","value":1}]`)
		b := append(head, bytes.Repeat([]byte(" "), n-len(head)-1)...)
		return append(b, '}')
	}
	post := func(body []byte, chunked bool) response {
		var rd io.Reader = bytes.NewReader(body)
		if chunked {
			rd = io.MultiReader(rd) // hides the length: sent chunked
		}
		req, err := http.NewRequestWithContext(h.ctx, http.MethodPost, h.url+"/v1/usage", rd)
		require.NoError(t, err)
		if chunked {
			req.ContentLength = -1
		}
		req.Header.Set("Authorization", tok)
		return h.send(req)
	}
	for _, chunked := range []bool{false, true} {
		resp := post(padded(meter.MaxBodyBytes+1), chunked)
		require.Equal(t, http.StatusRequestEntityTooLarge, resp.status, "chunked %v: %s", chunked, resp)
		require.Equal(t, "batch_too_large", resp.errorCode(t))
		resp = post(padded(meter.MaxBodyBytes+512<<10), chunked)
		require.Equal(t, http.StatusRequestEntityTooLarge, resp.status, "chunked %v: %s", chunked, resp)
	}
	require.Zero(t, h.count("SELECT count(*) FROM usage_events"))
	for _, chunked := range []bool{false, true} {
		resp := post(padded(meter.MaxBodyBytes), chunked)
		require.Equal(t, http.StatusAccepted, resp.status, "exactly 5 MiB is allowed (chunked %v): %s", chunked, resp)
	}
	require.EqualValues(t, 1, h.count("SELECT count(*) FROM usage_events"))

	events := func(n int, prefix string) map[string]any {
		evs := make([]event, n)
		for i := range evs {
			evs[i] = event{"id": fmt.Sprintf("%s-%d", prefix, i), "tenant": "acme", "feature": "api", "value": 1}
		}
		return batch(evs...)
	}
	resp := h.request(http.MethodPost, "/v1/usage", tok, events(meter.MaxEvents+1, "over"))
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.status, "%s", resp)
	require.Equal(t, "batch_too_large", resp.errorCode(t))
	require.EqualValues(t, 1, h.count("SELECT count(*) FROM usage_events"))
	// Mapped, so that the full batch makes no quarantined items (the cap,
	// TALLY_INGEST_MAX_QUARANTINED, is tested with the quotas).
	op := h.as(h.token("op", auth.RoleOperator))
	resp = h.request(http.MethodPut, "/v1/mappings/features/api", op, map[string]any{"event_name": "api_calls", "aggregation": "sum"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	resp = h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, map[string]any{"stripe_customer_id": "cus_acme"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	resp = h.request(http.MethodPost, "/v1/usage", tok, events(meter.MaxEvents, "max"))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.JSONEq(t, fmt.Sprintf(`{"accepted":%d,"duplicates":0,"unmapped":0}`, meter.MaxEvents), string(resp.body), "mapped: none unmapped")
}

func testIngestTenantScope(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	scoped := h.as(h.token("ingest-a", auth.RoleIngest, "tenant-a", "tenant-c"))
	for name, b := range map[string]map[string]any{
		"other tenant": batch(event{"id": "b1", "tenant": "tenant-b", "feature": "api", "value": 1}),
		"mixed": batch(
			event{"id": "a1", "tenant": "tenant-a", "feature": "api", "value": 1},
			event{"id": "b1", "tenant": "tenant-b", "feature": "api", "value": 1},
			event{"id": "c1", "tenant": "tenant-c", "feature": "api", "value": 1},
		),
	} {
		resp := h.request(http.MethodPost, "/v1/usage", scoped, b)
		require.Equal(t, http.StatusForbidden, resp.status, "%s: %s", name, resp)
		require.Equal(t, "forbidden_tenant", resp.errorCode(t), name)
		require.Zero(t, h.count("SELECT count(*) FROM usage_events"), name)
	}
	resp := h.request(http.MethodPost, "/v1/usage", scoped, batch(
		event{"id": "a1", "tenant": "tenant-a", "feature": "api", "value": 1},
		event{"id": "c1", "tenant": "tenant-c", "feature": "api", "value": 1},
	))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.Zero(t, h.count("SELECT count(*) FROM usage_events WHERE tenant = 'tenant-b'"))

	// An unscoped ingest token posts for anyone.
	resp = h.request(http.MethodPost, "/v1/usage", h.as(h.token("ingest-all", auth.RoleIngest)),
		batch(event{"id": "b1", "tenant": "tenant-b", "feature": "api", "value": 1}))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
}

// A correction (a negative value) lowers a bill: a token without the
// permission has a batch holding one refused whole, nothing of it stored;
// its positive usage still goes in, and a token with the permission, or an
// operator's, posts corrections.
func testIngestCorrectionsPermission(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	for name, tok := range map[string]string{
		"ingest": h.token("plain-ingest", auth.RoleIngest),
		"scoped": h.token("plain-scoped", auth.RoleIngest, "acme"),
		// Finance may post usage (roles nest), and corrections only so too.
		"finance": h.token("plain-finance", auth.RoleFinance),
	} {
		resp := h.request(http.MethodPost, "/v1/usage", h.as(tok), batch(
			event{"id": "p1", "tenant": "acme", "feature": "api", "value": 5},
			event{"id": "n1", "tenant": "acme", "feature": "api", "value": -2},
			event{"id": "p2", "tenant": "acme", "feature": "api", "value": 0},
			event{"id": "n2", "tenant": "acme", "feature": "api", "value": json.Number("-9223372036854775808")},
		))
		require.Equal(t, http.StatusForbidden, resp.status, "%s: %s", name, resp)
		require.Equal(t, "corrections_not_allowed", resp.errorCode(t), name)
		require.Contains(t, string(resp.body), "2 of the batch's events", name)
		require.Zero(t, h.count("SELECT count(*) FROM usage_events"), "%s: nothing of the batch is stored", name)
		require.Zero(t, h.count("SELECT count(*) FROM outbox_items"), name)
	}
	// The refusals are counted with the other forbidden requests.
	counts := map[string]float64{}
	gathered, err := h.parts.Registry.Gather()
	require.NoError(t, err)
	for _, mf := range gathered {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" {
					counts[mf.GetName()+"/"+l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	require.Equal(t, 3.0, counts["tally_ingest_requests_total/forbidden"])

	resp := h.request(http.MethodPost, "/v1/usage", h.as(h.token("plain", auth.RoleIngest)), batch(
		event{"id": "p1", "tenant": "acme", "feature": "api", "value": 5},
		event{"id": "p2", "tenant": "acme", "feature": "api", "value": 0},
	))
	require.Equal(t, http.StatusAccepted, resp.status, "positive values need no permission: %s", resp)
	require.EqualValues(t, 2, h.count("SELECT count(*) FROM usage_events"))

	for name, tok := range map[string]string{
		"ingest with the permission":  h.correctingToken("fixer", auth.RoleIngest, "acme"),
		"finance with the permission": h.correctingToken("fin-fixer", auth.RoleFinance),
		"operator":                    h.token("op", auth.RoleOperator),
		"admin":                       h.token("admin", auth.RoleAdmin),
	} {
		id := "n-" + strings.ReplaceAll(name, " ", "-")
		resp := h.request(http.MethodPost, "/v1/usage", h.as(tok), batch(event{"id": id, "tenant": "acme", "feature": "api", "value": -3}))
		require.Equal(t, http.StatusAccepted, resp.status, "%s: %s", name, resp)
		require.EqualValues(t, 1, h.count("SELECT count(*) FROM usage_events WHERE event_id = $1 AND value = -3", id), name)
	}
}

// ---------------------------------------------------------------------------
// Values at the edges of int64: every event is valid on its own (the contract
// says "an integer in int64"), so each must end staged or quarantined, and
// the reports must still answer.

func TestValueExtremes(t *testing.T) {
	t.Parallel()
	const (
		maxInt = "9223372036854775807"
		minInt = "-9223372036854775808"
	)
	setup := func(t *testing.T, tenantMapped bool) (*harness, string, string, time.Time) {
		h := newHarness(t, true)
		op := h.as(h.token("op", auth.RoleOperator))
		if tenantMapped {
			resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, map[string]any{"stripe_customer_id": "cus_acme"})
			require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		}
		resp := h.request(http.MethodPut, "/v1/mappings/features/api", op, map[string]any{"event_name": "api_calls", "aggregation": "sum"})
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		return h, h.as(h.correctingToken("ing", auth.RoleIngest)), h.as(h.token("fin", auth.RoleFinance)),
			time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour)
	}

	t.Run("a window whose sum is the least int64", func(t *testing.T) {
		t.Parallel()
		h, ing, _, base := setup(t, true)
		resp := h.request(http.MethodPost, "/v1/usage", ing, batch(
			event{"id": "m1", "tenant": "acme", "feature": "api", "value": json.Number(minInt), "timestamp": rfc(base)},
			event{"id": "m2", "tenant": "acme", "feature": "api", "value": 5, "timestamp": rfc(base.Add(time.Hour))},
		))
		require.Equal(t, http.StatusAccepted, resp.status, "the decoder accepts the least int64: %s", resp)
		_, err := h.parts.Stager.Pass(h.ctx, h.pool)
		require.NoError(t, err)
		require.Zero(t, h.count("SELECT count(*) FROM usage_events WHERE item_id IS NULL"))
	})

	t.Run("a window whose sum overflows int64", func(t *testing.T) {
		t.Parallel()
		h, ing, fin, base := setup(t, true)
		resp := h.request(http.MethodPost, "/v1/usage", ing, batch(
			event{"id": "o1", "tenant": "acme", "feature": "api", "value": json.Number(maxInt), "timestamp": rfc(base)},
			event{"id": "o2", "tenant": "acme", "feature": "api", "value": json.Number(maxInt), "timestamp": rfc(base.Add(time.Minute))},
		))
		require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
		res, err := h.parts.Stager.Pass(h.ctx, h.pool)
		require.NoError(t, err)
		require.Zero(t, h.count("SELECT count(*) FROM usage_events WHERE item_id IS NULL"))
		require.Equal(t, 2, res.Items, "split into two items whose values fit int64")
		comp := h.request(http.MethodGet, "/v1/reports/completeness?period="+base.Format("2006-01"), fin, nil)
		require.Equal(t, http.StatusOK, comp.status, "%s", comp)
		require.Contains(t, comp.String(), `"holds":true`)
	})

	t.Run("reports whose totals overflow int64", func(t *testing.T) {
		t.Parallel()
		h, ing, fin, base := setup(t, false)
		resp := h.request(http.MethodPut, "/v1/mappings/features/api", h.as(h.token("op2", auth.RoleOperator)),
			map[string]any{"event_name": "api_calls", "aggregation": "sum", "window": "15m"})
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		// Two windows, each within int64, of a tenant without a customer:
		// two quarantined items in one group of the report.
		resp = h.request(http.MethodPost, "/v1/usage", ing, batch(
			event{"id": "q1", "tenant": "acme", "feature": "api", "value": json.Number(maxInt), "timestamp": rfc(base)},
			event{"id": "q2", "tenant": "acme", "feature": "api", "value": json.Number(maxInt), "timestamp": rfc(base.Add(20 * time.Minute))},
		))
		require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
		require.Equal(t, meter.PassResult{Items: 2, Quarantined: 2, Events: 2}, h.pass())
		quar := h.request(http.MethodGet, "/v1/quarantine", fin, nil)
		require.Equal(t, http.StatusOK, quar.status, "%s", quar)
		require.Contains(t, quar.String(), `"value":18446744073709551614`, "the exact total, beyond int64")
		comp := h.request(http.MethodGet, "/v1/reports/completeness?period="+base.Format("2006-01"), fin, nil)
		require.Equal(t, http.StatusOK, comp.status, "%s", comp)
		require.Contains(t, comp.String(), `"holds":true`)
	})
}

// ---------------------------------------------------------------------------
// Quotas: a token over its rate gets 429 with Retry-After and nothing of the
// request is stored; other tokens are unaffected; a batch that would make
// too many quarantined items is refused whole.

func TestIngestQuotas(t *testing.T) {
	t.Parallel()
	t.Run("requests a second", testQuotaRequests)
	t.Run("events a second", testQuotaEvents)
	t.Run("quarantine cap", testQuotaQuarantineCap)
}

// withQuota builds the API with quota q.
func withQuota(q api.IngestQuota) func(*api.Deps) {
	return func(d *api.Deps) { d.Quota = q }
}

// usage is a batch of n events of tenant acme, feature api, ids prefix-i.
func usage(n int, prefix string) map[string]any {
	evs := make([]event, n)
	for i := range evs {
		evs[i] = event{"id": fmt.Sprintf("%s-%d", prefix, i), "tenant": "acme", "feature": "api", "value": 1}
	}
	return batch(evs...)
}

// requireThrottled checks a 429: the error shape, code rate_limited, and a
// Retry-After of whole seconds from 1 to most.
func requireThrottled(t *testing.T, resp response, most int) {
	t.Helper()
	require.Equal(t, http.StatusTooManyRequests, resp.status, "%s", resp)
	require.Equal(t, "rate_limited", resp.errorCode(t))
	after, err := strconv.Atoi(resp.header.Get("Retry-After"))
	require.NoError(t, err, "Retry-After %q", resp.header.Get("Retry-After"))
	require.GreaterOrEqual(t, after, 1)
	require.LessOrEqual(t, after, most)
}

// throttled reads tally_ingest_throttled_total by reason.
func (h *harness) throttled(t *testing.T) map[string]float64 {
	t.Helper()
	mfs, err := h.parts.Registry.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "tally_ingest_throttled_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			require.Len(t, m.GetLabel(), 1, "no tenant label")
			out[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
		}
	}
	return out
}

func testQuotaRequests(t *testing.T) {
	t.Parallel()
	// One request, then one every 1,000 s.
	h := newHarnessWith(t, false, withQuota(api.IngestQuota{RequestsPerSecond: 0.001}))
	a, b := h.as(h.token("a", auth.RoleIngest)), h.as(h.token("b", auth.RoleIngest))

	resp := h.request(http.MethodPost, "/v1/usage", a, usage(3, "a1"))
	require.Equal(t, http.StatusAccepted, resp.status, "under the limit: %s", resp)
	resp = h.request(http.MethodPost, "/v1/usage", a, usage(3, "a2"))
	requireThrottled(t, resp, 1000)
	require.EqualValues(t, 3, h.count("SELECT count(*) FROM usage_events"), "nothing of a throttled request is stored")
	// Refused before its body is read: even an invalid one is a 429.
	resp = h.request(http.MethodPost, "/v1/usage", a, `{"not":"a batch"}`)
	requireThrottled(t, resp, 1000)

	resp = h.request(http.MethodPost, "/v1/usage", b, usage(3, "b1"))
	require.Equal(t, http.StatusAccepted, resp.status, "another token has a budget of its own: %s", resp)
	require.EqualValues(t, 6, h.count("SELECT count(*) FROM usage_events"))
	got := h.throttled(t)
	require.Equal(t, 2.0, got["requests"])
	require.Zero(t, got["events"])
}

func testQuotaEvents(t *testing.T) {
	t.Parallel()
	// A burst of 10 events, then one every 100 s; batches of at most 12.
	h := newHarnessWith(t, false, withQuota(api.IngestQuota{EventsPerSecond: 0.01, EventsBurst: 10, MaxEvents: 12}))
	a, b := h.as(h.token("a", auth.RoleIngest)), h.as(h.token("b", auth.RoleIngest))

	resp := h.request(http.MethodPost, "/v1/usage", a, usage(6, "a1"))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	resp = h.request(http.MethodPost, "/v1/usage", a, usage(5, "a2"))
	requireThrottled(t, resp, 100) // one event short: 100 s
	require.EqualValues(t, 6, h.count("SELECT count(*) FROM usage_events"), "nothing of a throttled request is stored")

	// The refused request took nothing: the 4 left still pass.
	resp = h.request(http.MethodPost, "/v1/usage", a, usage(4, "a3"))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	resp = h.request(http.MethodPost, "/v1/usage", a, usage(1, "a4"))
	requireThrottled(t, resp, 100)

	// Another token in the same window: its own full burst.
	resp = h.request(http.MethodPost, "/v1/usage", b, usage(10, "b1"))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.EqualValues(t, 20, h.count("SELECT count(*) FROM usage_events"))

	// A batch over the burst could never pass: 413, not a 429 to retry.
	resp = h.request(http.MethodPost, "/v1/usage", h.as(h.token("c", auth.RoleIngest)), usage(11, "c1"))
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.status, "%s", resp)
	require.Equal(t, "batch_too_large", resp.errorCode(t))
	// Over the most events a request may carry.
	resp = h.request(http.MethodPost, "/v1/usage", h.as(h.token("d", auth.RoleIngest)), usage(13, "d1"))
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.status, "%s", resp)
	require.Contains(t, resp.String(), "at most 12 events")
	require.EqualValues(t, 20, h.count("SELECT count(*) FROM usage_events"))

	got := h.throttled(t)
	require.Equal(t, 2.0, got["events"])
	require.Zero(t, got["requests"])
	require.Contains(t, got, "quarantine_cap", "every reason is a series from the start")
}

func testQuotaQuarantineCap(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	require.Equal(t, meter.DefaultMaxQuarantined, h.parts.Ingester.MaxQuarantined, "serve's default")
	h.parts.Ingester.MaxQuarantined = 3
	tok := h.as(h.token("ingest", auth.RoleIngest))
	backdated := rfc(time.Now().Add(-3 * time.Hour))
	evs := func(n int, prefix string) map[string]any {
		out := make([]event, n)
		for i := range out {
			out[i] = event{"id": fmt.Sprintf("%s-%d", prefix, i), "tenant": "acme", "feature": "mystery", "value": 1, "timestamp": backdated}
		}
		return batch(out...)
	}

	resp := h.request(http.MethodPost, "/v1/usage", tok, evs(4, "over"))
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
	require.Equal(t, "too_many_quarantined", resp.errorCode(t))
	ps := resp.problems(t)
	require.Len(t, ps, 1, "%s", resp)
	require.Nil(t, ps[0].Index)
	require.Equal(t, "events", ps[0].Field)
	require.Equal(t, "4 would be quarantined as feature_unmapped", ps[0].Reason)
	require.Empty(t, resp.header.Get("Retry-After"), "the same batch would be refused again")
	require.Zero(t, h.count("SELECT count(*) FROM usage_events"), "nothing of a refused batch is stored")
	require.Zero(t, h.count("SELECT count(*) FROM outbox_items"))

	resp = h.request(http.MethodPost, "/v1/usage", tok, evs(3, "at"))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.Equal(t, 1.0, h.throttled(t)["quarantine_cap"])
}
