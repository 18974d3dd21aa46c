package api_test

import (
	"crypto/sha256"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
)

// Who may call what: the role each /v1 route needs, and tokens kept only as
// their hashes.

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
	// An empty list: refused alike for every role (a cancellation needs the
	// corrections permission too, which ingest and finance tokens lack by
	// default: TestCancellationsThroughTheAPI).
	{http.MethodPost, "/v1/usage/cancellations", fixed("/v1/usage/cancellations"),
		func(string) any { return map[string]any{"cancellations": []any{}} }, auth.RoleIngest, http.StatusUnprocessableEntity},
	{http.MethodGet, "/v1/mappings/features", fixed("/v1/mappings/features"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/mappings/features/{feature}", fixed("/v1/mappings/features/nosuch"), nil, auth.RoleFinance, http.StatusNotFound},
	{http.MethodGet, "/v1/mappings/tenants", fixed("/v1/mappings/tenants"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/mappings/tenants/{tenant}", fixed("/v1/mappings/tenants/nosuch"), nil, auth.RoleFinance, http.StatusNotFound},
	{http.MethodPut, "/v1/mappings/features/{feature}", func(tag string) string { return "/v1/mappings/features/f-" + tag },
		func(string) any { return map[string]any{"event_name": "api_calls", "aggregation": "sum"} }, auth.RoleOperator, http.StatusOK},
	{http.MethodPut, "/v1/mappings/tenants/{tenant}", func(tag string) string { return "/v1/mappings/tenants/t-" + tag },
		func(string) any { return map[string]any{"stripe_customer_id": "cus_123"} }, auth.RoleOperator, http.StatusOK},
	{http.MethodGet, "/v1/quarantine", fixed("/v1/quarantine"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/quarantine/items", fixed("/v1/quarantine/items?format=csv"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodPost, "/v1/quarantine/requeue", fixed("/v1/quarantine/requeue"),
		func(string) any { return map[string]any{"dry_run": true} }, auth.RoleOperator, http.StatusOK},
	{http.MethodGet, "/v1/reports/completeness", fixed("/v1/reports/completeness?period=2026-11"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/reports/completeness/audit", fixed("/v1/reports/completeness/audit?period=2026-11"), nil, auth.RoleFinance, http.StatusNotFound},
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
	{http.MethodGet, "/v1/reconcile/discrepancies", fixed("/v1/reconcile/discrepancies"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/reconcile/discrepancies/{id}", fixed("/v1/reconcile/discrepancies/424242"), nil, auth.RoleFinance, http.StatusNotFound},
	{http.MethodPost, "/v1/reconcile/discrepancies/{id}/resolve", fixed("/v1/reconcile/discrepancies/424242/resolve"),
		func(string) any { return map[string]any{"reason": "accept_tally", "note": "n"} }, auth.RoleFinance, http.StatusNotFound},
	{http.MethodGet, "/v1/invoices/checks", fixed("/v1/invoices/checks"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/invoices/gates", fixed("/v1/invoices/gates"), nil, auth.RoleFinance, http.StatusOK},
	{http.MethodGet, "/v1/invoices/checks/{id}", fixed("/v1/invoices/checks/424242"), nil, auth.RoleFinance, http.StatusNotFound},
	{http.MethodPost, "/v1/invoices/checks/{id}/resolve", fixed("/v1/invoices/checks/424242/resolve"),
		func(string) any { return map[string]any{"reason": "accept_tally", "note": "n"} }, auth.RoleFinance, http.StatusNotFound},
	{http.MethodPost, "/v1/outbox/items/{id}/recover", fixed("/v1/outbox/items/424242/recover"),
		func(string) any { return map[string]any{"expect": "uncertain", "to": "pending"} }, auth.RoleOperator, http.StatusNotFound},
	{http.MethodGet, "/v1/audit", fixed("/v1/audit"), nil, auth.RoleFinance, http.StatusOK},
}

var roleRank = map[auth.Role]int{auth.RoleIngest: 1, auth.RoleFinance: 2, auth.RoleOperator: 3, auth.RoleAdmin: 4}

// requireRoutesListed checks that every /v1 route of the router is in
// v1Routes, and nothing else.
func requireRoutesListed(t *testing.T, h *harness) {
	t.Helper()
	routes, ok := h.handler.(chi.Routes)
	require.True(t, ok, "api.New no longer returns a chi router; keep v1Routes in step with the router by hand")
	var got []string
	require.NoError(t, chi.Walk(routes, func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		// Stripe's event destination is authenticated by its signature, not
		// a token: TestStripeEventsWebhook covers it. The OpenAPI document
		// needs no token: TestOpenAPIServedWithoutAToken covers it.
		if strings.HasPrefix(route, "/v1/") && route != "/v1/stripe/events" && route != "/v1/openapi.json" {
			got = append(got, method+" "+route)
		}
		return nil
	}))
	var want []string
	for _, r := range v1Routes {
		want = append(want, r.method+" "+r.pattern)
	}
	require.ElementsMatch(t, want, got, "v1Routes must list every /v1 route of the router with its role")
}

func TestAuthorizationTable(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	requireRoutesListed(t, h)

	revoked := h.token("revoked", auth.RoleAdmin)
	require.NoError(t, auth.Revoke(h.ctx, h.pool, "revoked"))
	expired, err := auth.Create(h.ctx, h.pool, auth.TokenSpec{Name: "expired", Role: auth.RoleAdmin, ExpiresIn: time.Millisecond})
	require.NoError(t, err)
	time.Sleep(10 * time.Millisecond)
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
		{"expired token", "Bearer " + expired.Secret, ""},
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
				resp := h.in(t).request(r.method, r.path(tag), c.authorization, body)
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

func TestTokensHashedAtRest(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	secrets := map[string]string{}
	for _, role := range []auth.Role{auth.RoleIngest, auth.RoleFinance, auth.RoleOperator, auth.RoleAdmin} {
		secrets[string(role)] = h.token("tok-"+string(role), role)
	}
	secrets["scoped"] = h.token("tok-scoped", auth.RoleIngest, "acme")
	adminSecret := "an-admin-token-of-enough-length-0123456789"
	seeded, err := auth.SeedAdminToken(h.ctx, h.pool, adminSecret)
	require.NoError(t, err)
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
			tokenName = seeded.Name
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
