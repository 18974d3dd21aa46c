package api_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/csv"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// ---------------------------------------------------------------------------
// Harness: the /v1 handler built as `tally serve` builds it, on a fresh
// database, served over real HTTP.

// syncBuffer collects the server's log lines; they are shown when a test
// fails.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

type harness struct {
	t       *testing.T
	ctx     context.Context
	pool    *pgxpool.Pool
	parts   *app.Parts
	handler http.Handler
	url     string
	client  *http.Client
}

// testTarget is the destination a node with a Stripe test key would stage
// for.
func testTarget(context.Context) (meter.Target, bool) {
	return meter.Target{Exporter: "stripe_meter_events", Account: "acct_1", Mode: outbox.ModeTest,
		AcceptPast: 35 * 24 * time.Hour, AcceptFuture: 5 * time.Minute}, true
}

// newHarness builds the parts from a configuration read the way the binary
// reads it (no STRIPE_API_KEY: export stalled) and serves the API. With
// staging, the stager addresses items to testTarget instead.
func newHarness(t *testing.T, staging bool) *harness {
	t.Helper()
	return newHarnessWith(t, staging, nil)
}

// newHarnessWith is newHarness with more dependencies: with, when set,
// completes the API's before it is served.
func newHarnessWith(t *testing.T, staging bool, with func(*api.Deps)) *harness {
	t.Helper()
	pool := testdb.New(t)
	env := map[string]string{
		"TALLY_DATABASE_URL": testdb.URLOf(t, pool),
		"TALLY_LOG_LEVEL":    "error",
	}
	fs := flag.NewFlagSet("tally-test", flag.ContinueOnError)
	load := config.Flags(fs, func(k string) string { return env[k] })
	require.NoError(t, fs.Parse(nil))
	cfg, err := load()
	require.NoError(t, err)
	parts, err := app.Build(cfg)
	require.NoError(t, err)
	if staging {
		parts.Stager.Target = testTarget
	}
	logs := &syncBuffer{}
	deps := &api.Deps{Pool: pool, Outbox: parts.Outbox, Mappings: parts.Mappings, Ingester: parts.Ingester,
		Requeuer: parts.Requeuer, Metrics: parts.API}
	if with != nil {
		with(deps)
	}
	handler := api.New(api.Options{Logger: slog.New(slog.NewTextHandler(logs, nil)), V1: deps})
	srv := httptest.NewServer(handler)
	t.Cleanup(func() {
		srv.Close()
		if t.Failed() {
			t.Logf("server log:\n%s", logs.String())
		}
	})
	return &harness{t: t, ctx: context.Background(), pool: pool, parts: parts, handler: handler,
		url: srv.URL, client: srv.Client()}
}

// token creates a live token directly in the database and returns its
// secret.
func (h *harness) token(name string, role auth.Role, tenants ...string) string {
	h.t.Helper()
	tok, err := auth.CreateToken(h.ctx, h.pool, name, role, tenants)
	require.NoError(h.t, err)
	return tok.Secret
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func (r response) String() string { return fmt.Sprintf("%d %s", r.status, r.body) }

// errorShape is the error shape, decoded strictly: {"error":{"code","message"}}
// and, for 422, "problems".
type errorShape struct {
	Error struct {
		Code     string            `json:"code"`
		Message  string            `json:"message"`
		Problems []json.RawMessage `json:"problems"`
	} `json:"error"`
}

func (r response) errorCode(t *testing.T) string {
	t.Helper()
	var top map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(r.body, &top), "%s", r)
	require.Len(t, top, 1, "the error shape has one key, error: %s", r)
	var e errorShape
	dec := json.NewDecoder(bytes.NewReader(r.body))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&e), "%s", r)
	require.NotEmpty(t, e.Error.Code, "%s", r)
	require.NotEmpty(t, e.Error.Message, "%s", r)
	require.Equal(t, "application/json", r.header.Get("Content-Type"))
	return e.Error.Code
}

type problem struct {
	Index  *int   `json:"index"`
	Field  string `json:"field"`
	Reason string `json:"reason"`
}

func (r response) problems(t *testing.T) []problem {
	t.Helper()
	var e struct {
		Error struct {
			Problems []problem `json:"problems"`
		} `json:"error"`
	}
	require.NoError(t, json.Unmarshal(r.body, &e), "%s", r)
	return e.Error.Problems
}

func (r response) decode(t *testing.T, v any) {
	t.Helper()
	require.NoError(t, json.Unmarshal(r.body, v), "%s", r)
}

// request sends one request and fails the test on a 500. body is sent as is
// when it is a string or []byte, as JSON otherwise; nil sends none.
func (h *harness) request(method, path, authorization string, body any) response {
	h.t.Helper()
	resp := h.try(method, path, authorization, body)
	require.NotEqual(h.t, http.StatusInternalServerError, resp.status, "%s %s: %s", method, path, resp.body)
	return resp
}

// try is request without the check for a 500.
func (h *harness) try(method, path, authorization string, body any) response {
	h.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	case []byte:
		rd = bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		require.NoError(h.t, err)
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequestWithContext(h.ctx, method, h.url+path, rd)
	require.NoError(h.t, err)
	if rd != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if authorization != "" {
		req.Header.Set("Authorization", authorization)
	}
	return h.do(req)
}

func (h *harness) send(req *http.Request) response {
	h.t.Helper()
	resp := h.do(req)
	require.NotEqual(h.t, http.StatusInternalServerError, resp.status, "%s %s: %s", req.Method, req.URL.Path, resp.body)
	return resp
}

func (h *harness) do(req *http.Request) response {
	h.t.Helper()
	resp, err := h.client.Do(req)
	require.NoError(h.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(h.t, err)
	return response{status: resp.StatusCode, header: resp.Header, body: b}
}

func (h *harness) as(secret string) string { return "Bearer " + secret }

func (h *harness) count(sql string, args ...any) int64 {
	h.t.Helper()
	var n int64
	require.NoError(h.t, h.pool.QueryRow(h.ctx, sql, args...).Scan(&n))
	return n
}

func (h *harness) pass() meter.PassResult {
	h.t.Helper()
	res, err := h.parts.Stager.Pass(h.ctx, h.pool)
	require.NoError(h.t, err)
	return res
}

// event is one usage event as posted.
type event map[string]any

func batch(events ...event) map[string]any { return map[string]any{"events": events} }

func rfc(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// ---------------------------------------------------------------------------
// 1. Authorization

// v1Route is one /v1 route and the least role it needs. v1Routes is checked
// against the router: a route added to the router and not here fails
// TestAuthorizationTable.
type v1Route struct {
	method, pattern string
	// path makes a concrete path; tag is unique per caller so that parallel
	// writes do not meet.
	path func(tag string) string
	body func(tag string) any
	min  auth.Role
	// ok is the status an allowed caller gets for this request.
	ok int
}

func fixed(p string) func(string) string { return func(string) string { return p } }

var v1Routes = []v1Route{
	{http.MethodPost, "/v1/usage", fixed("/v1/usage"),
		func(tag string) any {
			return batch(event{"id": "auth-" + tag, "tenant": "t1", "feature": "api", "value": 1})
		}, auth.RoleIngest, http.StatusAccepted},
	{http.MethodGet, "/v1/mappings/features", fixed("/v1/mappings/features"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/mappings/features/{feature}", fixed("/v1/mappings/features/nosuch"), nil, auth.RoleFinance, http.StatusNotFound},
	{http.MethodGet, "/v1/mappings/tenants", fixed("/v1/mappings/tenants"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/mappings/tenants/{tenant}", fixed("/v1/mappings/tenants/nosuch"), nil, auth.RoleFinance, http.StatusNotFound},
	{http.MethodPut, "/v1/mappings/features/{feature}", func(tag string) string { return "/v1/mappings/features/f-" + tag },
		func(string) any { return map[string]any{"event_name": "api_calls", "aggregation": "sum"} }, auth.RoleOperator, http.StatusOK},
	{http.MethodPut, "/v1/mappings/tenants/{tenant}", func(tag string) string { return "/v1/mappings/tenants/t-" + tag },
		func(string) any { return map[string]any{"stripe_customer_id": "cus_123"} }, auth.RoleOperator, http.StatusOK},
	{http.MethodGet, "/v1/quarantine", fixed("/v1/quarantine"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/reports/completeness", fixed("/v1/reports/completeness?period=2026-11"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/outbox/summary", fixed("/v1/outbox/summary"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/outbox/items", fixed("/v1/outbox/items"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/outbox/items/{id}", fixed("/v1/outbox/items/424242"), nil, auth.RoleFinance, http.StatusNotFound},
	{http.MethodPost, "/v1/outbox/items/{id}/requeue", fixed("/v1/outbox/items/424242/requeue"),
		func(string) any { return map[string]any{"mapping_version": 1} }, auth.RoleOperator, http.StatusNotFound},
	// Without a Stripe key there is nothing to reconcile against: 409.
	{http.MethodPost, "/v1/reconcile/runs", fixed("/v1/reconcile/runs"), nil, auth.RoleOperator, http.StatusConflict},
	{http.MethodGet, "/v1/reconcile/runs", fixed("/v1/reconcile/runs"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/reconcile/runs/{id}", fixed("/v1/reconcile/runs/424242"), nil, auth.RoleFinance, http.StatusNotFound},
	{http.MethodGet, "/v1/reconcile/runs/{id}/plan", fixed("/v1/reconcile/runs/424242/plan"), nil, auth.RoleFinance, http.StatusNotFound},
	{http.MethodPost, "/v1/outbox/items/{id}/recover", fixed("/v1/outbox/items/424242/recover"),
		func(string) any { return map[string]any{"expect": "uncertain", "to": "pending"} }, auth.RoleOperator, http.StatusNotFound},
	{http.MethodGet, "/v1/audit", fixed("/v1/audit"), nil, auth.RoleFinance, http.StatusOK},
}

var roleRank = map[auth.Role]int{auth.RoleIngest: 1, auth.RoleFinance: 2, auth.RoleOperator: 3, auth.RoleAdmin: 4}

func TestAuthorizationTable(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)

	// Every /v1 route of the router is in the table, and nothing else.
	routes, ok := h.handler.(chi.Routes)
	require.True(t, ok, "api.New no longer returns a chi router; keep v1Routes in step with the router by hand")
	var got []string
	require.NoError(t, chi.Walk(routes, func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		// Stripe's event destination is authenticated by its signature, not
		// a token: TestStripeEventsWebhook covers it.
		if strings.HasPrefix(route, "/v1/") && route != "/v1/stripe/events" {
			got = append(got, method+" "+route)
		}
		return nil
	}))
	var want []string
	for _, r := range v1Routes {
		want = append(want, r.method+" "+r.pattern)
	}
	require.ElementsMatch(t, want, got, "v1Routes must list every /v1 route of the router with its role")

	revoked := h.token("revoked", auth.RoleAdmin)
	require.NoError(t, auth.Revoke(h.ctx, h.pool, "revoked"))
	type caller struct {
		name          string
		authorization string // "" sends no header
		role          auth.Role
	}
	callers := []caller{
		{"no token", "", ""},
		{"basic scheme", "Basic x", ""},
		{"empty bearer", "Bearer ", ""},
		{"bearer without a token", "Bearer", ""},
		{"unknown token", "Bearer " + auth.TokenPrefix + "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", ""},
		{"revoked token", "Bearer " + revoked, ""},
	}
	for _, role := range []auth.Role{auth.RoleIngest, auth.RoleFinance, auth.RoleOperator, auth.RoleAdmin} {
		callers = append(callers, caller{string(role), "Bearer " + h.token("tok-"+string(role), role), role})
	}
	// The scheme is case-insensitive (RFC 9110 §11.1).
	callers = append(callers, caller{"lower-case scheme", "bearer " + h.token("tok-lower", auth.RoleAdmin), auth.RoleAdmin})

	for _, r := range v1Routes {
		for ci, c := range callers {
			t.Run(r.method+" "+r.pattern+"/"+c.name, func(t *testing.T) {
				t.Parallel()
				tag := strconv.Itoa(ci)
				var body any
				if r.body != nil {
					body = r.body(tag)
				}
				resp := h.request(r.method, r.path(tag), c.authorization, body)
				switch {
				case c.role == "":
					require.Equal(t, http.StatusUnauthorized, resp.status, "%s", resp)
					require.True(t, strings.HasPrefix(resp.header.Get("WWW-Authenticate"), "Bearer realm="), resp.header)
					require.Equal(t, "unauthorized", resp.errorCode(t))
				case roleRank[c.role] < roleRank[r.min]:
					require.Equal(t, http.StatusForbidden, resp.status, "%s", resp)
					require.Equal(t, "forbidden", resp.errorCode(t))
				default:
					require.Equal(t, r.ok, resp.status, "%s", resp)
				}
			})
		}
	}

	// Unknown /v1 routes answer 401 before anything else, and then the JSON
	// 404 and 405.
	resp := h.request(http.MethodGet, "/v1/nosuch", "", nil)
	require.Equal(t, http.StatusUnauthorized, resp.status, "%s", resp)
	admin := h.as(h.token("tok-admin-2", auth.RoleAdmin))
	resp = h.request(http.MethodGet, "/v1/nosuch", admin, nil)
	require.Equal(t, http.StatusNotFound, resp.status, "%s", resp)
	require.Equal(t, "not_found", resp.errorCode(t))
	resp = h.request(http.MethodDelete, "/v1/usage", admin, nil)
	require.Equal(t, http.StatusMethodNotAllowed, resp.status, "%s", resp)
	require.Equal(t, "method_not_allowed", resp.errorCode(t))
}

// ---------------------------------------------------------------------------
// 2. Ingest

func TestUsageIngest(t *testing.T) {
	t.Parallel()

	t.Run("validation", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, false)
		tok := h.as(h.token("ingest", auth.RoleIngest))
		valid := func() event {
			return event{"id": "ok-1", "tenant": "acme", "feature": "api", "value": 1, "timestamp": "2026-01-30T12:00:00Z"}
		}
		with := func(k string, v any) event {
			e := valid()
			e["id"] = "bad-1"
			e[k] = v
			return e
		}
		without := func(k string) event {
			e := valid()
			e["id"] = "bad-1"
			delete(e, k)
			return e
		}
		one := 1
		cases := []struct {
			name  string
			bad   any // the second event of the batch
			field string
		}{
			{"missing id", without("id"), "id"},
			{"missing tenant", without("tenant"), "tenant"},
			{"missing feature", without("feature"), "feature"},
			{"missing value", without("value"), "value"},
			{"unknown field", with("extra", 1), "extra"},
			{"empty id", with("id", ""), "id"},
			{"id of 129 characters", with("id", strings.Repeat("x", 129)), "id"},
			{"non-ASCII id", with("id", "événement"), "id"},
			{"control character in id", with("id", "a\tb"), "id"},
			{"id not a string", with("id", 5), "id"},
			{"tenant starting with a dash", with("tenant", "-acme"), "tenant"},
			{"tenant with a space", with("tenant", "ac me"), "tenant"},
			{"tenant of 65 characters", with("tenant", strings.Repeat("a", 65)), "tenant"},
			{"tenant not a string", with("tenant", 7), "tenant"},
			{"feature with a slash", with("feature", "api/v2"), "feature"},
			{"feature with a pipe", with("feature", "a|b"), "feature"},
			{"value as a string", with("value", "5"), "value"},
			{"value with a fraction", with("value", json.Number("1.5")), "value"},
			{"value with an exponent", with("value", json.Number("1e3")), "value"},
			{"value over int64", with("value", json.Number("9223372036854775808")), "value"},
			{"value under int64", with("value", json.Number("-9223372036854775809")), "value"},
			{"value null", with("value", nil), "value"},
			{"value a boolean", with("value", true), "value"},
			{"timestamp not RFC 3339", with("timestamp", "2026-11-30 12:00:00"), "timestamp"},
			{"timestamp a date", with("timestamp", "2026-11-30"), "timestamp"},
			{"timestamp a number", with("timestamp", 1764504000), "timestamp"},
			{"timestamp over 24h ahead", with("timestamp", rfc(time.Now().Add(25*time.Hour))), "timestamp"},
			{"timestamp before 2000", with("timestamp", "1999-12-31T23:59:59Z"), "timestamp"},
			{"event not an object", 5, ""},
			{"event an array", []any{}, ""},
		}
		for _, tc := range cases {
			resp := h.request(http.MethodPost, "/v1/usage", tok, map[string]any{"events": []any{valid(), tc.bad}})
			require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", tc.name, resp)
			require.Equal(t, "invalid_batch", resp.errorCode(t), tc.name)
			ps := resp.problems(t)
			require.Len(t, ps, 1, "%s: %s", tc.name, resp)
			require.Equal(t, &one, ps[0].Index, tc.name)
			require.Equal(t, tc.field, ps[0].Field, tc.name)
			require.NotEmpty(t, ps[0].Reason, tc.name)
		}

		// Every problem of every event at once, in index order.
		resp := h.request(http.MethodPost, "/v1/usage", tok, batch(with("value", "x"), valid(), event{"id": "", "tenant": "-", "feature": "f", "value": 1.5}))
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
		var where []string
		for _, p := range resp.problems(t) {
			require.NotNil(t, p.Index)
			where = append(where, fmt.Sprintf("%d:%s", *p.Index, p.Field))
		}
		require.Equal(t, []string{"0:value", "2:id", "2:tenant", "2:value"}, where)

		// Problems of the batch as a whole: index null.
		for name, body := range map[string]string{
			"empty events":               `{"events":[]}`,
			"events an object":           `{"events":{}}`,
			"events a string":            `{"events":"x"}`,
			"events null":                `{"events":null}`,
			"no events":                  `{}`,
			"unknown top-level field":    `{"events":[{"id":"a","tenant":"acme","feature":"api","value":1}],"extra":1}`,
			"unknown field, empty batch": `{"batch":[]}`,
		} {
			resp := h.request(http.MethodPost, "/v1/usage", tok, body)
			require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
			require.Equal(t, "invalid_batch", resp.errorCode(t), name)
			ps := resp.problems(t)
			require.NotEmpty(t, ps, name)
			require.Nil(t, ps[0].Index, "%s: %s", name, resp)
		}

		// Bodies that are not a JSON object: 400.
		for name, body := range map[string]string{
			"truncated":     `{"events":[`,
			"not JSON":      `events=1`,
			"empty body":    ``,
			"an array":      `[]`,
			"null":          `null`,
			"trailing data": `{"events":[{"id":"a","tenant":"acme","feature":"api","value":1}]} {}`,
		} {
			resp := h.request(http.MethodPost, "/v1/usage", tok, body)
			require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", name, resp)
			require.Equal(t, "invalid_json", resp.errorCode(t), name)
		}

		require.Zero(t, h.count("SELECT count(*) FROM usage_events"), "an invalid batch stores nothing")

		// The edges that are valid.
		resp = h.request(http.MethodPost, "/v1/usage", tok, batch(
			event{"id": strings.Repeat("x", 128), "tenant": strings.Repeat("a", 64), "feature": "A0_.:-z", "value": json.Number("9223372036854775807")},
			event{"id": " !~|%", "tenant": "acme", "feature": "api", "value": json.Number("-9223372036854775808")},
			event{"id": "ts-null", "tenant": "acme", "feature": "api", "value": 0, "timestamp": nil},
			event{"id": "ts-ahead", "tenant": "acme", "feature": "api", "value": -3, "timestamp": rfc(time.Now().Add(23 * time.Hour))},
			event{"id": "ts-offset", "tenant": "acme", "feature": "api", "value": 2, "timestamp": "2026-01-30T13:00:00.123456789+01:00"},
		))
		require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
		require.JSONEq(t, `{"accepted":5,"duplicates":0}`, string(resp.body))
		var at time.Time
		require.NoError(t, h.pool.QueryRow(h.ctx, "SELECT occurred_at FROM usage_events WHERE event_id = 'ts-offset'").Scan(&at))
		require.True(t, at.Equal(time.Date(2026, 1, 30, 12, 0, 0, 123456000, time.UTC)), at)
	})

	t.Run("duplicates and changed content", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, false)
		tok := h.as(h.token("ingest", auth.RoleIngest))
		ts := "2026-01-30T12:00:00Z"
		first := batch(
			event{"id": "e1", "tenant": "acme", "feature": "api", "value": 5, "timestamp": ts},
			event{"id": "e2", "tenant": "acme", "feature": "api", "value": 6},
			event{"id": "e1", "tenant": "beta", "feature": "api", "value": 7, "timestamp": ts},
		)
		resp := h.request(http.MethodPost, "/v1/usage", tok, first)
		require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
		require.JSONEq(t, `{"accepted":3,"duplicates":0}`, string(resp.body))
		require.Equal(t, "application/json", resp.header.Get("Content-Type"))

		resp = h.request(http.MethodPost, "/v1/usage", tok, first)
		require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
		require.JSONEq(t, `{"accepted":0,"duplicates":3}`, string(resp.body))

		// The same instant in another offset is the same content.
		resp = h.request(http.MethodPost, "/v1/usage", tok, batch(
			event{"id": "e1", "tenant": "acme", "feature": "api", "value": 5, "timestamp": "2026-01-30T13:00:00+01:00"},
			event{"id": "e3", "tenant": "acme", "feature": "api", "value": 1},
			event{"id": "e3", "tenant": "acme", "feature": "api", "value": 1},
		))
		require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
		require.JSONEq(t, `{"accepted":1,"duplicates":2}`, string(resp.body))
		require.EqualValues(t, 4, h.count("SELECT count(*) FROM usage_events"))

		// Same id, different content: the event is invalid and nothing of
		// the batch is stored.
		for name, changed := range map[string]event{
			"value":             {"id": "e1", "tenant": "acme", "feature": "api", "value": 50, "timestamp": ts},
			"feature":           {"id": "e1", "tenant": "acme", "feature": "web", "value": 5, "timestamp": ts},
			"timestamp":         {"id": "e1", "tenant": "acme", "feature": "api", "value": 5, "timestamp": "2026-01-30T12:00:01Z"},
			"timestamp dropped": {"id": "e1", "tenant": "acme", "feature": "api", "value": 5},
			"timestamp added":   {"id": "e2", "tenant": "acme", "feature": "api", "value": 6, "timestamp": ts},
		} {
			resp := h.request(http.MethodPost, "/v1/usage", tok, batch(
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
		resp = h.request(http.MethodPost, "/v1/usage", tok, batch(
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

		// The API's metrics count what was stored and what was a duplicate.
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
	})

	t.Run("size limits", func(t *testing.T) {
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
		resp = h.request(http.MethodPost, "/v1/usage", tok, events(meter.MaxEvents, "max"))
		require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
		require.JSONEq(t, fmt.Sprintf(`{"accepted":%d,"duplicates":0}`, meter.MaxEvents), string(resp.body))
	})

	t.Run("tenant scope", func(t *testing.T) {
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
	})
}

// ---------------------------------------------------------------------------
// 3. Tokens at rest

func TestTokensHashedAtRest(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	secrets := map[string]string{}
	for _, role := range []auth.Role{auth.RoleIngest, auth.RoleFinance, auth.RoleOperator, auth.RoleAdmin} {
		secrets[string(role)] = h.token("tok-"+string(role), role)
	}
	secrets["scoped"] = h.token("tok-scoped", auth.RoleIngest, "acme")
	adminSecret := "an-admin-token-of-enough-length-0123456789"
	require.NoError(t, auth.EnsureAdminToken(h.ctx, h.pool, adminSecret))
	secrets["env admin"] = adminSecret

	// Every column of every row, as text.
	rows, err := h.pool.Query(h.ctx, `SELECT name, t::text, encode(token_hash, 'hex'), encode(token_hash, 'base64') FROM api_tokens t`)
	require.NoError(t, err)
	type row struct{ name, text, hex, b64 string }
	stored, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		return x, r.Scan(&x.name, &x.text, &x.hex, &x.b64)
	})
	require.NoError(t, err)
	require.Len(t, stored, len(secrets))
	var cols []string
	rows, err = h.pool.Query(h.ctx, `SELECT column_name FROM information_schema.columns WHERE table_name = 'api_tokens' ORDER BY ordinal_position`)
	require.NoError(t, err)
	cols, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.NotEmpty(t, cols)
	for _, col := range cols {
		rows, err := h.pool.Query(h.ctx, "SELECT coalesce("+pgx.Identifier{col}.Sanitize()+"::text, '') FROM api_tokens")
		require.NoError(t, err)
		values, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		for _, v := range values {
			for name, s := range secrets {
				require.NotContains(t, v, s, "column %s holds the %s secret", col, name)
				require.NotContains(t, v, strings.TrimPrefix(s, auth.TokenPrefix), "column %s holds the %s secret", col, name)
			}
		}
	}
	for _, r := range stored {
		for name, s := range secrets {
			require.NotContains(t, r.text, s, "the row %s holds the %s secret", r.name, name)
			require.NotContains(t, r.text, strings.TrimPrefix(s, auth.TokenPrefix), "the row %s holds the %s secret", r.name, name)
		}
	}
	byName := map[string]string{}
	for _, r := range stored {
		byName[r.name] = r.hex
	}
	for name, s := range secrets {
		tokenName := "tok-" + name
		switch name {
		case "scoped":
			tokenName = "tok-scoped"
		case "env admin":
			tokenName = auth.AdminTokenName
		}
		sum := sha256.Sum256([]byte(s))
		require.Equal(t, fmt.Sprintf("%x", sum), byName[tokenName], "token_hash of %s is sha256(secret)", name)
		// And the secret works.
		resp := h.request(http.MethodPost, "/v1/usage", "Bearer "+s,
			batch(event{"id": "hash-" + strings.ReplaceAll(name, " ", "-"), "tenant": "acme", "feature": "api", "value": 1}))
		require.Equal(t, http.StatusAccepted, resp.status, "%s: %s", name, resp)
	}
	require.True(t, strings.HasPrefix(secrets["admin"], auth.TokenPrefix))
	// The hash itself is not a token.
	resp := h.request(http.MethodGet, "/v1/outbox/summary", "Bearer "+byName["tok-admin"], nil)
	require.Equal(t, http.StatusUnauthorized, resp.status, "%s", resp)
}

// ---------------------------------------------------------------------------
// 4. Mappings

type featureView struct {
	Feature            string        `json:"feature"`
	EventName          string        `json:"event_name"`
	Aggregation        string        `json:"aggregation"`
	Window             string        `json:"window"`
	Exporter           *string       `json:"exporter"`
	CustomerPayloadKey *string       `json:"customer_payload_key"`
	ValuePayloadKey    *string       `json:"value_payload_key"`
	MappingVersion     int           `json:"mapping_version"`
	UpdatedBy          string        `json:"updated_by"`
	Changed            *bool         `json:"changed"`
	History            []featureView `json:"history"`
}

type tenantView struct {
	Tenant           string       `json:"tenant"`
	StripeCustomerID string       `json:"stripe_customer_id"`
	PeriodAnchor     *time.Time   `json:"period_anchor"`
	MappingVersion   int          `json:"mapping_version"`
	Changed          *bool        `json:"changed"`
	History          []tenantView `json:"history"`
}

func TestMappingsAPI(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	op := h.as(h.token("operator", auth.RoleOperator))
	fin := h.as(h.token("finance", auth.RoleFinance))

	put := func(path string, body any) (response, featureView, tenantView) {
		resp := h.request(http.MethodPut, path, op, body)
		var f featureView
		var tn tenantView
		if resp.status == http.StatusOK {
			resp.decode(t, &f)
			resp.decode(t, &tn)
		}
		return resp, f, tn
	}

	t.Run("features", func(t *testing.T) {
		resp := h.request(http.MethodGet, "/v1/mappings/features", fin, nil)
		require.Equal(t, http.StatusOK, resp.status)
		require.JSONEq(t, `{"features":[]}`, string(resp.body))

		resp, v1, _ := put("/v1/mappings/features/api", map[string]any{"event_name": "api_calls", "aggregation": "sum"})
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		require.NotNil(t, v1.Changed)
		require.True(t, *v1.Changed)
		require.Positive(t, v1.MappingVersion)
		require.Equal(t, "api_calls", v1.EventName)
		require.Equal(t, "sum", v1.Aggregation)
		require.Equal(t, "1h0m0s", v1.Window, "the default window")
		require.NotNil(t, v1.Exporter, "the exporter is always shown")
		require.Empty(t, *v1.Exporter, "empty: the node's default")
		require.NotNil(t, v1.CustomerPayloadKey, "the payload keys are always shown")
		require.NotNil(t, v1.ValuePayloadKey)
		require.Equal(t, "stripe_customer_id", *v1.CustomerPayloadKey, "no Stripe key: Stripe's default keys")
		require.Equal(t, "value", *v1.ValuePayloadKey)
		require.Equal(t, "token:operator", v1.UpdatedBy)

		// Identical (the default window spelled out): no change.
		resp, same, _ := put("/v1/mappings/features/api", map[string]any{"event_name": "api_calls", "aggregation": "sum", "window": "1h"})
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		require.NotNil(t, same.Changed)
		require.False(t, *same.Changed)
		require.Equal(t, v1.MappingVersion, same.MappingVersion)

		resp, v2, _ := put("/v1/mappings/features/api", map[string]any{"event_name": "api_calls", "aggregation": "sum", "window": "15m"})
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		require.True(t, *v2.Changed)
		require.Greater(t, v2.MappingVersion, v1.MappingVersion)
		require.Equal(t, "15m0s", v2.Window)

		resp = h.request(http.MethodGet, "/v1/mappings/features/api", fin, nil)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		var got featureView
		resp.decode(t, &got)
		require.Equal(t, v2.MappingVersion, got.MappingVersion)
		require.Nil(t, got.Changed, "a GET says nothing of a change")
		require.Len(t, got.History, 2)
		require.Equal(t, v1.MappingVersion, got.History[0].MappingVersion)
		require.Equal(t, "1h0m0s", got.History[0].Window)
		require.Equal(t, v2.MappingVersion, got.History[1].MappingVersion)
		require.Equal(t, "15m0s", got.History[1].Window)
		require.NotNil(t, got.CustomerPayloadKey)
		require.Equal(t, "stripe_customer_id", *got.CustomerPayloadKey)
		require.NotNil(t, got.History[0].ValuePayloadKey, "the history shows each version's keys")
		require.Equal(t, "value", *got.History[0].ValuePayloadKey)

		resp = h.request(http.MethodGet, "/v1/mappings/features", fin, nil)
		var list struct {
			Features []featureView `json:"features"`
		}
		resp.decode(t, &list)
		require.Len(t, list.Features, 1)
		require.Equal(t, v2.MappingVersion, list.Features[0].MappingVersion)

		for name, tc := range map[string]struct {
			path   string
			body   any
			fields []string
		}{
			"bad aggregation":      {"/v1/mappings/features/api", map[string]any{"event_name": "api_calls", "aggregation": "max"}, []string{"aggregation"}},
			"no aggregation":       {"/v1/mappings/features/api", map[string]any{"event_name": "api_calls"}, []string{"aggregation"}},
			"bad event name":       {"/v1/mappings/features/api", map[string]any{"event_name": "api calls", "aggregation": "sum"}, []string{"event_name"}},
			"empty event name":     {"/v1/mappings/features/api", map[string]any{"event_name": "", "aggregation": "sum"}, []string{"event_name"}},
			"window not dividing":  {"/v1/mappings/features/api", map[string]any{"event_name": "a", "aggregation": "sum", "window": "7m"}, []string{"window"}},
			"window too short":     {"/v1/mappings/features/api", map[string]any{"event_name": "a", "aggregation": "sum", "window": "30s"}, []string{"window"}},
			"window too long":      {"/v1/mappings/features/api", map[string]any{"event_name": "a", "aggregation": "sum", "window": "48h"}, []string{"window"}},
			"unknown exporter":     {"/v1/mappings/features/api", map[string]any{"event_name": "a", "aggregation": "sum", "exporter": "stripe_v3"}, []string{"exporter"}},
			"bad feature name":     {"/v1/mappings/features/-api", map[string]any{"event_name": "a", "aggregation": "sum"}, []string{"feature"}},
			"everything bad":       {"/v1/mappings/features/-api", map[string]any{"event_name": "", "aggregation": "", "window": "-1h", "exporter": "v2"}, []string{"feature", "event_name", "aggregation", "window", "exporter"}},
			"feature name too big": {"/v1/mappings/features/" + strings.Repeat("f", 65), map[string]any{"event_name": "a", "aggregation": "sum"}, []string{"feature"}},
		} {
			resp := h.request(http.MethodPut, tc.path, op, tc.body)
			require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
			require.Equal(t, "invalid_mapping", resp.errorCode(t), name)
			var fields []string
			for _, p := range resp.problems(t) {
				fields = append(fields, p.Field)
				require.NotEmpty(t, p.Reason)
			}
			require.ElementsMatch(t, tc.fields, fields, "%s: %s", name, resp)
		}
		resp = h.request(http.MethodPut, "/v1/mappings/features/api", op, `{"event_name":"a","aggregation":"sum","window":"soon"}`)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "a window that is not a duration is a field problem: %s", resp)
		require.Equal(t, "invalid_mapping", resp.errorCode(t))
		require.Equal(t, "window", resp.problems(t)[0].Field)
		for name, body := range map[string]string{
			"unknown field":       `{"event_name":"a","aggregation":"sum","meter":"x"}`,
			"payload key":         `{"event_name":"a","aggregation":"sum","customer_payload_key":"x"}`,
			"not JSON":            `{"event_name":`,
			"window not a string": `{"event_name":"a","aggregation":"sum","window":60}`,
			"two values":          `{"event_name":"a","aggregation":"sum"}{}`,
		} {
			resp := h.request(http.MethodPut, "/v1/mappings/features/api", op, body)
			require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", name, resp)
			require.Equal(t, "invalid_json", resp.errorCode(t), name)
		}
		resp = h.request(http.MethodGet, "/v1/mappings/features/api", fin, nil)
		resp.decode(t, &got)
		require.Equal(t, v2.MappingVersion, got.MappingVersion, "a refused PUT changes nothing")
		require.Len(t, got.History, 2)

		resp = h.request(http.MethodGet, "/v1/mappings/features/nosuch", fin, nil)
		require.Equal(t, http.StatusNotFound, resp.status)
		require.Equal(t, "not_found", resp.errorCode(t))
	})

	t.Run("tenants", func(t *testing.T) {
		resp, _, tv1 := put("/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_A1"})
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		require.NotNil(t, tv1.Changed)
		require.True(t, *tv1.Changed)
		require.Positive(t, tv1.MappingVersion)
		require.Equal(t, "cus_A1", tv1.StripeCustomerID)
		require.Nil(t, tv1.PeriodAnchor)
		resp, _, same := put("/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_A1"})
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		require.NotNil(t, same.Changed)
		require.False(t, *same.Changed, "an identical PUT is no change")
		require.Equal(t, tv1.MappingVersion, same.MappingVersion)

		anchor := "2026-01-15T10:00:00+02:00"
		resp, _, tv2 := put("/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_A1", "period_anchor": anchor})
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		require.True(t, *tv2.Changed)
		require.Greater(t, tv2.MappingVersion, tv1.MappingVersion)
		require.NotNil(t, tv2.PeriodAnchor)
		require.True(t, tv2.PeriodAnchor.Equal(time.Date(2026, 1, 15, 8, 0, 0, 0, time.UTC)), tv2.PeriodAnchor)
		_, _, tv3 := put("/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_A1", "period_anchor": "2026-01-15T08:00:00Z"})
		require.False(t, *tv3.Changed, "the same instant in another offset is no change")
		require.Equal(t, tv2.MappingVersion, tv3.MappingVersion)
		_, _, tv4 := put("/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_B2"})
		require.True(t, *tv4.Changed)
		require.Nil(t, tv4.PeriodAnchor, "no anchor: back to calendar months")

		resp = h.request(http.MethodGet, "/v1/mappings/tenants/acme", fin, nil)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		var got tenantView
		resp.decode(t, &got)
		require.Equal(t, tv4.MappingVersion, got.MappingVersion)
		require.Equal(t, "cus_B2", got.StripeCustomerID)
		var versions []int
		for _, v := range got.History {
			versions = append(versions, v.MappingVersion)
		}
		require.Equal(t, []int{tv1.MappingVersion, tv2.MappingVersion, tv4.MappingVersion}, versions)

		resp = h.request(http.MethodGet, "/v1/mappings/tenants", fin, nil)
		var list struct {
			Tenants []tenantView `json:"tenants"`
		}
		resp.decode(t, &list)
		require.Len(t, list.Tenants, 1)

		for name, tc := range map[string]struct {
			path   string
			body   any
			fields []string
		}{
			"no customer":          {"/v1/mappings/tenants/acme", map[string]any{}, []string{"stripe_customer_id"}},
			"not a customer id":    {"/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "acct_1"}, []string{"stripe_customer_id"}},
			"customer id with a -": {"/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_a-b"}, []string{"stripe_customer_id"}},
			"bare prefix":          {"/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_"}, []string{"stripe_customer_id"}},
			"bad tenant name":      {"/v1/mappings/tenants/a%20b", map[string]any{"stripe_customer_id": "cus_1"}, []string{"tenant"}},
		} {
			resp := h.request(http.MethodPut, tc.path, op, tc.body)
			require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
			require.Equal(t, "invalid_mapping", resp.errorCode(t), name)
			var fields []string
			for _, p := range resp.problems(t) {
				fields = append(fields, p.Field)
			}
			require.ElementsMatch(t, tc.fields, fields, "%s: %s", name, resp)
		}
		resp = h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, `{"stripe_customer_id":"cus_1","customer":"x"}`)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s", resp)
		require.Equal(t, "invalid_json", resp.errorCode(t))
		resp = h.request(http.MethodGet, "/v1/mappings/tenants/acme", fin, nil)
		resp.decode(t, &got)
		require.Equal(t, tv4.MappingVersion, got.MappingVersion, "a refused PUT changes nothing")
	})

	t.Run("tenant period_anchor not RFC 3339", func(t *testing.T) {
		resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, map[string]any{"stripe_customer_id": "cus_1", "period_anchor": "2026-01-15"})
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
		require.Equal(t, "invalid_mapping", resp.errorCode(t))
		require.Equal(t, "period_anchor", resp.problems(t)[0].Field)
	})
}

// A feature mapping's exporter over the API: set, shown (empty when it is
// the node's default), versioned like every other field, validated, and
// carried by the items staged for the feature.
func TestFeatureMappingExporterAPI(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	op := h.as(h.token("operator", auth.RoleOperator))
	fin := h.as(h.token("finance", auth.RoleFinance))
	put := func(body any) featureView {
		t.Helper()
		resp := h.request(http.MethodPut, "/v1/mappings/features/api", op, body)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		var f featureView
		resp.decode(t, &f)
		return f
	}
	get := func() (featureView, map[string]any) {
		t.Helper()
		resp := h.request(http.MethodGet, "/v1/mappings/features/api", fin, nil)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		var f featureView
		resp.decode(t, &f)
		var raw map[string]any
		resp.decode(t, &raw)
		return f, raw
	}

	v1 := put(map[string]any{"event_name": "api_calls", "aggregation": "sum", "exporter": "stripe_meter_event_stream"})
	require.True(t, *v1.Changed)
	require.Equal(t, "stripe_meter_event_stream", *v1.Exporter)
	same := put(map[string]any{"event_name": "api_calls", "aggregation": "sum", "window": "1h", "exporter": "stripe_meter_event_stream"})
	require.False(t, *same.Changed, "an identical PUT is no change")
	require.Equal(t, v1.MappingVersion, same.MappingVersion)
	got, raw := get()
	require.Equal(t, "stripe_meter_event_stream", raw["exporter"])
	require.Equal(t, v1.MappingVersion, got.MappingVersion)
	require.Len(t, got.History, 1)
	require.Equal(t, "stripe_meter_event_stream", *got.History[0].Exporter)

	// Left out: the node's default again, a change and a new version.
	v2 := put(map[string]any{"event_name": "api_calls", "aggregation": "sum"})
	require.True(t, *v2.Changed)
	require.Greater(t, v2.MappingVersion, v1.MappingVersion)
	require.Empty(t, *v2.Exporter)
	got, raw = get()
	require.Contains(t, raw, "exporter")
	require.Equal(t, "", raw["exporter"], "shown as the empty string")
	require.Len(t, got.History, 2)
	require.Empty(t, *got.History[1].Exporter)
	v3 := put(map[string]any{"event_name": "api_calls", "aggregation": "sum", "exporter": "stripe_meter_events"})
	require.True(t, *v3.Changed, "naming the default exporter is a choice of its own")
	require.Equal(t, "stripe_meter_events", *v3.Exporter)

	for name, body := range map[string]any{
		"unknown":       map[string]any{"event_name": "api_calls", "aggregation": "sum", "exporter": "stripe"},
		"other case":    map[string]any{"event_name": "api_calls", "aggregation": "sum", "exporter": "STRIPE_METER_EVENTS"},
		"padded":        map[string]any{"event_name": "api_calls", "aggregation": "sum", "exporter": "stripe_meter_events "},
		"new feature":   map[string]any{"event_name": "gpu", "aggregation": "sum", "exporter": "kafka"},
		"other problem": map[string]any{"event_name": "api calls", "aggregation": "sum", "exporter": "kafka"},
	} {
		path := "/v1/mappings/features/api"
		if name == "new feature" {
			path = "/v1/mappings/features/gpu"
		}
		resp := h.request(http.MethodPut, path, op, body)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_mapping", resp.errorCode(t), name)
		var fields []string
		for _, p := range resp.problems(t) {
			fields = append(fields, p.Field)
		}
		require.Contains(t, fields, "exporter", "%s: %s", name, resp)
	}
	resp := h.request(http.MethodPut, "/v1/mappings/features/api", op, `{"event_name":"api_calls","aggregation":"sum","exporter":2}`)
	require.Equal(t, http.StatusBadRequest, resp.status, "%s", resp)
	require.Equal(t, "invalid_json", resp.errorCode(t))
	got, _ = get()
	require.Equal(t, v3.MappingVersion, got.MappingVersion, "a refused PUT changes nothing")
	require.Len(t, got.History, 3)
	resp = h.request(http.MethodGet, "/v1/mappings/features/gpu", fin, nil)
	require.Equal(t, http.StatusNotFound, resp.status, "a refused new mapping is not stored")

	// Staged items take the feature's exporter, or the node's default
	// (testTarget: stripe_meter_events) when it names none.
	put(map[string]any{"event_name": "api_calls", "aggregation": "sum", "exporter": "stripe_meter_event_stream"})
	resp = h.request(http.MethodPut, "/v1/mappings/features/logins", op, map[string]any{"event_name": "logins", "aggregation": "count"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	resp = h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, map[string]any{"stripe_customer_id": "cus_acme"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	hour := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour)
	resp = h.request(http.MethodPost, "/v1/usage", h.as(h.token("ing", auth.RoleIngest)), batch(
		event{"id": "a1", "tenant": "acme", "feature": "api", "value": 2, "timestamp": rfc(hour.Add(time.Minute))},
		event{"id": "l1", "tenant": "acme", "feature": "logins", "value": 1},
	))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.Equal(t, meter.PassResult{Items: 1, Events: 1}, h.pass())
	for feature, want := range map[string]string{"api": "stripe_meter_event_stream", "logins": "stripe_meter_events"} {
		resp = h.request(http.MethodGet, "/v1/outbox/items?feature="+feature, fin, nil)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		var list struct {
			Items []itemView `json:"items"`
		}
		resp.decode(t, &list)
		require.Len(t, list.Items, 1, feature)
		require.Equal(t, want, list.Items[0].Exporter, feature)
		require.Equal(t, outbox.Identity{TenantKey: "acme", SubjectKind: list.Items[0].SubjectKind, SubjectRef: list.Items[0].SubjectRef,
			Exporter: want, DestinationAccount: "acct_1", Mode: outbox.ModeTest, MappingVersion: list.Items[0].MappingVersion}.Identifier(),
			list.Items[0].Identifier, feature)
	}
}

// ---------------------------------------------------------------------------
// 5. Quarantine, CSV and requeue

type itemView struct {
	ID             int64          `json:"id"`
	Tenant         string         `json:"tenant"`
	SubjectKind    string         `json:"subject_kind"`
	SubjectRef     string         `json:"subject_ref"`
	Exporter       string         `json:"exporter"`
	MappingVersion int            `json:"mapping_version"`
	Identifier     string         `json:"identifier"`
	Payload        outbox.Payload `json:"payload"`
	State          string         `json:"state"`
	Reason         string         `json:"quarantine_reason"`
	SupersededBy   *int64         `json:"superseded_by"`
}

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

// ---------------------------------------------------------------------------
// 6. Completeness and the outbox reads

type bucket struct {
	Events int64 `json:"events"`
	Value  int64 `json:"value"`
}

type completenessLine struct {
	Tenant            string `json:"tenant"`
	Feature           string `json:"feature"`
	Period            string `json:"period"`
	Ingested          bucket `json:"ingested"`
	Confirmed         bucket `json:"confirmed"`
	Accepted          bucket `json:"accepted"`
	Pending           bucket `json:"pending"`
	Quarantined       bucket `json:"quarantined"`
	Uncertain         bucket `json:"uncertain"`
	Rejected          bucket `json:"rejected"`
	Unstaged          bucket `json:"unstaged"`
	InconsistentItems int64  `json:"inconsistent_items"`
	Discrepancies     int64  `json:"discrepancies"`
	Holds             bool   `json:"holds"`
}

type completenessReport struct {
	Period       string             `json:"period"`
	Lines        []completenessLine `json:"lines"`
	ReconcileRun *int64             `json:"reconcile_run"`
	Holds        bool               `json:"holds"`
}

func completeness(t *testing.T, h *harness, token, query string) completenessReport {
	t.Helper()
	resp := h.request(http.MethodGet, "/v1/reports/completeness?period="+query, token, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var c completenessReport
	dec := json.NewDecoder(bytes.NewReader(resp.body))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&c), "%s", resp)
	return c
}

func TestCompletenessEndpoint(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	op := h.as(h.token("operator", auth.RoleOperator))
	fin := h.as(h.token("finance", auth.RoleFinance))
	ing := h.as(h.token("ingest", auth.RoleIngest))

	for _, q := range []string{"", "?period=", "?period=2026-13", "?period=2026-00", "?period=2026-1", "?period=26-11", "?period=2026-11-01", "?tenant=acme"} {
		resp := h.request(http.MethodGet, "/v1/reports/completeness"+q, fin, nil)
		require.Equal(t, http.StatusBadRequest, resp.status, "%q: %s", q, resp)
		require.Equal(t, "invalid_period", resp.errorCode(t), q)
	}

	for path, body := range map[string]map[string]any{
		"/v1/mappings/tenants/acme":    {"stripe_customer_id": "cus_acme"},
		"/v1/mappings/tenants/gamma":   {"stripe_customer_id": "cus_gamma", "period_anchor": "2026-01-15T10:30:00Z"},
		"/v1/mappings/features/api":    {"event_name": "api_calls", "aggregation": "sum"},
		"/v1/mappings/features/seats":  {"event_name": "seats", "aggregation": "last"},
		"/v1/mappings/features/logins": {"event_name": "logins", "aggregation": "count"},
	} {
		resp := h.request(http.MethodPut, path, op, body)
		require.Equal(t, http.StatusOK, resp.status, "%s: %s", path, resp)
	}
	base := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour)
	ts := func(m int) string { return rfc(base.Add(time.Duration(m) * time.Minute)) }
	resp := h.request(http.MethodPost, "/v1/usage", ing, batch(
		event{"id": "a1", "tenant": "acme", "feature": "api", "value": 5, "timestamp": ts(1)},
		event{"id": "a2", "tenant": "acme", "feature": "api", "value": 10, "timestamp": ts(20)},
		event{"id": "a3", "tenant": "acme", "feature": "api", "value": -3, "timestamp": ts(40)},
		event{"id": "s1", "tenant": "acme", "feature": "seats", "value": 4, "timestamp": ts(5)},
		event{"id": "s2", "tenant": "acme", "feature": "seats", "value": 9, "timestamp": ts(50)},
		event{"id": "l1", "tenant": "acme", "feature": "logins", "value": 1, "timestamp": ts(2)},
		event{"id": "l2", "tenant": "acme", "feature": "logins", "value": 1, "timestamp": ts(3)},
		event{"id": "g1", "tenant": "acme", "feature": "gpu", "value": 2, "timestamp": ts(4)},
		event{"id": "b1", "tenant": "beta", "feature": "api", "value": 8, "timestamp": ts(6)},
		event{"id": "c1", "tenant": "gamma", "feature": "api", "value": 11, "timestamp": ts(7)},
	))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.EqualValues(t, 2, h.count("SELECT count(*) FROM usage_events WHERE item_id IS NOT NULL"),
		"per-event usage is staged in the ingest transaction")
	period := meter.PeriodStart(base, meter.CalendarAnchor)
	month := period.Format("2006-01")
	// gamma bills from the 15th, 10:30 UTC: its period may start in another
	// month than the calendar one.
	gammaPeriod := meter.PeriodStart(base, time.Date(2026, 1, 15, 10, 30, 0, 0, time.UTC))
	gammaMonth := gammaPeriod.Format("2006-01")

	before := completeness(t, h, fin, month)
	require.True(t, before.Holds, "%+v", before)
	for _, l := range before.Lines {
		if l.Feature != "logins" {
			require.Equal(t, l.Ingested, l.Unstaged, "%+v", l)
			require.Equal(t, l.Ingested, l.Pending, "%+v", l)
		}
	}

	h.pass()
	require.Zero(t, h.count("SELECT count(*) FROM usage_events WHERE item_id IS NULL"))
	c := completeness(t, h, fin, month)
	require.Equal(t, month, c.Period)
	require.True(t, c.Holds, "%+v", c)
	type key struct{ tenant, feature string }
	lines := map[key]completenessLine{}
	for _, l := range c.Lines {
		require.True(t, l.Holds, "%+v", l)
		if l.Tenant == "gamma" {
			continue // read below, by its own period
		}
		require.Equal(t, period.Format(time.RFC3339), l.Period)
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
	g := completeness(t, h, fin, gammaMonth+"&tenant=gamma")
	require.True(t, g.Holds, "%+v", g)
	require.Len(t, g.Lines, 1, "%+v", g)
	require.Equal(t, gammaPeriod.Format(time.RFC3339), g.Lines[0].Period)
	require.Equal(t, bucket{1, 11}, g.Lines[0].Pending)
	require.Equal(t, bucket{1, 11}, g.Lines[0].Ingested)
	require.EqualValues(t, 1, h.count("SELECT count(*) FROM outbox_items WHERE tenant_key = 'gamma' AND payload->>'period' = $1",
		gammaPeriod.Format(time.RFC3339)))
	require.Equal(t, bucket{3, 12}, lines[key{"acme", "api"}].Pending)
	require.Equal(t, bucket{2, 13}, lines[key{"acme", "seats"}].Pending)
	require.Equal(t, bucket{2, 2}, lines[key{"acme", "logins"}].Pending)
	require.Equal(t, bucket{1, 2}, lines[key{"acme", "gpu"}].Quarantined)
	require.Equal(t, bucket{1, 8}, lines[key{"beta", "api"}].Quarantined)

	// Late usage for a staged window becomes its supplement; the identity
	// still holds.
	resp = h.request(http.MethodPost, "/v1/usage", ing, batch(event{"id": "a4", "tenant": "acme", "feature": "api", "value": 100, "timestamp": ts(59)}))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.Equal(t, meter.PassResult{Items: 1, Events: 1}, h.pass())
	require.EqualValues(t, 1, h.count("SELECT count(*) FROM outbox_items WHERE subject_ref LIKE 'usage:api:%#1'"))
	c = completeness(t, h, fin, month+"&tenant=acme")
	require.True(t, c.Holds, "%+v", c)
	for _, l := range c.Lines {
		if l.Feature == "api" {
			require.Equal(t, bucket{4, 112}, l.Pending)
			require.Equal(t, bucket{4, 112}, l.Ingested)
		}
	}

	only := completeness(t, h, fin, month+"&tenant=beta")
	require.Len(t, only.Lines, 1)
	require.Equal(t, "beta", only.Lines[0].Tenant)
	empty := completeness(t, h, fin, "2001-01")
	require.Equal(t, completenessReport{Period: "2001-01", Lines: []completenessLine{}, Holds: true}, empty)

	t.Run("outbox reads", func(t *testing.T) {
		resp := h.request(http.MethodGet, "/v1/outbox/summary", fin, nil)
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

		var ids []int64
		after := int64(0)
		for page := 0; page < 10; page++ {
			resp := h.request(http.MethodGet, fmt.Sprintf("/v1/outbox/items?state=pending&tenant=acme&limit=3&after=%d", after), fin, nil)
			require.Equal(t, http.StatusOK, resp.status, "%s", resp)
			var l struct {
				Items     []itemView `json:"items"`
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

		resp = h.request(http.MethodGet, "/v1/outbox/items?feature=logins", fin, nil)
		var l struct {
			Items []itemView `json:"items"`
		}
		resp.decode(t, &l)
		require.Len(t, l.Items, 2)
		for _, it := range l.Items {
			require.Equal(t, "usage_event", it.SubjectKind)
			require.Equal(t, "logins", it.Payload.Feature)
		}
		for _, q := range []string{"state=nosuch", "limit=0", "limit=1001", "limit=x", "after=-1", "after=x"} {
			resp := h.request(http.MethodGet, "/v1/outbox/items?"+q, fin, nil)
			require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", q, resp)
		}
		resp = h.request(http.MethodGet, "/v1/outbox/items/"+url.PathEscape(strconv.FormatInt(ids[0], 10)), fin, nil)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		var it itemView
		resp.decode(t, &it)
		require.Equal(t, ids[0], it.ID)
		require.Len(t, it.Identifier, 68)
	})
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
		return h, h.as(h.token("ing", auth.RoleIngest)), h.as(h.token("fin", auth.RoleFinance)),
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
