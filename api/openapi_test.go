package api_test

import (
	"encoding/json"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/api/openapitest"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// The OpenAPI document (api/openapi.json) against the server: every route
// documented and every documented operation served, with the role it
// states; the document valid OpenAPI 3.1 with every $ref resolved; its
// enums and limits those of the code; served without a token. Every
// exchange of the api tests is checked against it besides (harness.do).

func openAPI(t *testing.T) (*openapitest.Checker, map[string]any) {
	t.Helper()
	c, err := openapitest.Default()
	require.NoError(t, err)
	var raw map[string]any
	require.NoError(t, json.Unmarshal(api.OpenAPI(), &raw))
	return c, raw
}

// pointer resolves a local JSON pointer ("#/components/schemas/Error").
func pointer(doc any, ref string) (any, bool) {
	rest, ok := strings.CutPrefix(ref, "#")
	if !ok {
		return nil, false
	}
	cur := doc
	for _, tok := range strings.Split(rest, "/")[1:] {
		tok = strings.ReplaceAll(strings.ReplaceAll(tok, "~1", "/"), "~0", "~")
		switch x := cur.(type) {
		case map[string]any:
			if cur, ok = x[tok]; !ok {
				return nil, false
			}
		case []any:
			i, err := strconv.Atoi(tok)
			if err != nil || i < 0 || i >= len(x) {
				return nil, false
			}
			cur = x[i]
		default:
			return nil, false
		}
	}
	return cur, true
}

// refs lists every $ref of v with where it is.
func refs(v any, at string, out map[string]string) {
	switch x := v.(type) {
	case map[string]any:
		for k, child := range x {
			if s, ok := child.(string); ok && k == "$ref" {
				out[at] = s
				continue
			}
			refs(child, at+"/"+k, out)
		}
	case []any:
		for i, child := range x {
			refs(child, at+"/"+strconv.Itoa(i), out)
		}
	}
}

// resolved follows a $ref of components once.
func resolved(doc any, v any) map[string]any {
	m, _ := v.(map[string]any)
	if r, ok := m["$ref"].(string); ok {
		target, _ := pointer(doc, r)
		m, _ = target.(map[string]any)
	}
	return m
}

var documentedRoles = []string{"none", "ingest", "finance", "operator", "admin"}

func TestOpenAPIDocumentIsValid(t *testing.T) {
	t.Parallel()
	c, doc := openAPI(t)
	require.NoError(t, c.ValidateDocument())
	require.Equal(t, "3.1.0", doc["openapi"])

	all := map[string]string{}
	refs(doc, "#", all)
	require.NotEmpty(t, all)
	for at, ref := range all {
		_, ok := pointer(doc, ref)
		require.True(t, ok, "%s: $ref %s resolves to nothing in the document", at, ref)
	}

	ids := map[string]string{}
	for path, item := range doc["paths"].(map[string]any) {
		require.True(t, strings.HasPrefix(path, "/v1/"), "%s: the document is of /v1", path)
		for method, raw := range item.(map[string]any) {
			op := raw.(map[string]any)
			name := strings.ToUpper(method) + " " + path
			id, _ := op["operationId"].(string)
			require.NotEmpty(t, id, name)
			require.NotContains(t, ids, id, "%s: operationId %s is also %s's", name, id, ids[id])
			ids[id] = name
			require.NotEmpty(t, op["summary"], name)
			role, _ := op["x-tally-role"].(string)
			require.Contains(t, documentedRoles, role, "%s: x-tally-role says the least role it needs", name)
			responses := op["responses"].(map[string]any)
			if role == "none" {
				require.Contains(t, op, "security", "%s needs no token: its security says so", name)
			} else {
				require.NotContains(t, op, "security", "%s: the document's bearer token", name)
				for _, status := range []string{"401", "403", "500", "503"} {
					require.Contains(t, responses, status, "%s: every route with a token may answer %s", name, status)
				}
				require.Contains(t, op["description"], "**"+role+"** role", "%s: the description names the role", name)
			}
			for status, raw := range responses {
				r := resolved(doc, raw)
				require.NotNil(t, r, "%s %s", name, status)
				headers, _ := r["headers"].(map[string]any)
				require.Contains(t, headers, "X-Request-Id", "%s %s: every answer carries X-Request-Id", name, status)
				if n, _ := strconv.Atoi(status); n >= 400 {
					require.NotEmpty(t, r["x-error-codes"], "%s %s: an error answer lists its codes", name, status)
					schema, _ := pointer(r, "#/content/application~1json/schema/$ref")
					require.Equal(t, "#/components/schemas/Error", schema, "%s %s: an error answer is the error shape", name, status)
				}
			}
		}
	}
}

// v1Router lists the /v1 routes of the router api.New builds, as "METHOD
// /v1/pattern".
func v1Router(t *testing.T, h *harness) []string {
	t.Helper()
	routes, ok := h.handler.(chi.Routes)
	require.True(t, ok, "api.New no longer returns a chi router: walk what it returns instead")
	var got []string
	require.NoError(t, chi.Walk(routes, func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		if strings.HasPrefix(route, "/v1/") {
			got = append(got, method+" "+route)
		}
		return nil
	}))
	sort.Strings(got)
	return got
}

func TestOpenAPIMatchesTheRouter(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	c, _ := openAPI(t)
	served := v1Router(t, h)
	require.NotEmpty(t, served)
	var documented []string
	for _, op := range c.Operations() {
		documented = append(documented, op.Method+" "+op.Path)
	}
	sort.Strings(documented)
	var undocumented, unserved []string
	for _, r := range served {
		if !slices.Contains(documented, r) {
			undocumented = append(undocumented, r)
		}
	}
	for _, r := range documented {
		if !slices.Contains(served, r) {
			unserved = append(unserved, r)
		}
	}
	require.Empty(t, undocumented, "routes the router serves and api/openapi.json does not document")
	require.Empty(t, unserved, "operations api/openapi.json documents and the router does not serve")
}

// roleBelow is the role just weaker than r ("" for ingest).
func roleBelow(r auth.Role) auth.Role {
	roles := []auth.Role{"", auth.RoleIngest, auth.RoleFinance, auth.RoleOperator, auth.RoleAdmin}
	return roles[slices.Index(roles, r)-1]
}

// TestOpenAPIRolesAreTheRoutersRoles calls every documented operation as
// its x-tally-role says: without a token (401, unless it needs none), with
// the role just below (403), and with the role itself (neither). Bodies
// are empty objects: no call changes anything.
func TestOpenAPIRolesAreTheRoutersRoles(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	c, _ := openAPI(t)
	tokens := map[auth.Role]string{}
	for _, r := range []auth.Role{auth.RoleIngest, auth.RoleFinance, auth.RoleOperator, auth.RoleAdmin} {
		tokens[r] = h.as(h.token("openapi-"+string(r), r))
	}
	params := strings.NewReplacer("{id}", "1", "{feature}", "openapi-role", "{tenant}", "openapi-role")
	for _, op := range c.Operations() {
		t.Run(op.Method+" "+op.Path, func(t *testing.T) {
			t.Parallel()
			h := h.in(t)
			path := params.Replace(op.Path)
			var body any
			if op.Method != http.MethodGet {
				body = "{}"
			}
			if op.Role == "none" {
				resp := h.request(op.Method, path, "", body)
				require.NotEqual(t, http.StatusUnauthorized, resp.status, "the document says it needs no token: %s", resp)
				return
			}
			role := auth.Role(op.Role)
			require.Contains(t, tokens, role, "x-tally-role %q is no role", op.Role)
			resp := h.request(op.Method, path, "", body)
			require.Equal(t, http.StatusUnauthorized, resp.status, "without a token: %s", resp)
			if below := roleBelow(role); below != "" {
				resp = h.request(op.Method, path, tokens[below], body)
				require.Equal(t, http.StatusForbidden, resp.status, "the document says %s needs %s; %s: %s", op.Path, role, below, resp)
				require.Equal(t, "forbidden", resp.errorCode(t))
			}
			resp = h.request(op.Method, path, tokens[role], body)
			require.NotContains(t, []int{http.StatusUnauthorized, http.StatusForbidden}, resp.status,
				"the document says %s is enough: %s", role, resp)
		})
	}
}

func TestOpenAPIServedWithoutAToken(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	first := h.request(http.MethodGet, "/v1/openapi.json", "", nil)
	require.Equal(t, http.StatusOK, first.status, "%s", first)
	etag := first.header.Get("ETag")
	require.True(t, strings.HasPrefix(etag, `"`) && strings.HasSuffix(etag, `"`) && len(etag) > 2, "a strong ETag: %q", etag)

	cases := []struct {
		name, authorization, ifNoneMatch string
		status                           int
	}{
		{"no token", "", "", http.StatusOK},
		{"a token is not looked at", "Bearer not-a-token", "", http.StatusOK},
		{"another version's ETag", "", `"0123"`, http.StatusOK},
		{"its ETag", "", etag, http.StatusNotModified},
		{"its ETag, weakly", "", "W/" + etag, http.StatusNotModified},
		{"its ETag in a list", "", `"0123", ` + etag, http.StatusNotModified},
		{"any", "", "*", http.StatusNotModified},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := h.in(t)
			req, err := http.NewRequestWithContext(h.ctx, http.MethodGet, h.url+"/v1/openapi.json", nil)
			require.NoError(t, err)
			if tc.authorization != "" {
				req.Header.Set("Authorization", tc.authorization)
			}
			if tc.ifNoneMatch != "" {
				req.Header.Set("If-None-Match", tc.ifNoneMatch)
			}
			resp := h.send(req)
			require.Equal(t, tc.status, resp.status, "%s", resp)
			require.Equal(t, etag, resp.header.Get("ETag"))
			require.Equal(t, "no-cache", resp.header.Get("Cache-Control"), "clients revalidate: an upgraded node is seen at once")
			if tc.status == http.StatusNotModified {
				require.Empty(t, resp.body)
				return
			}
			require.Equal(t, "application/json", resp.header.Get("Content-Type"))
			require.Equal(t, api.OpenAPI(), resp.body, "the document served is the one in the repository")
		})
	}
}

// TestOpenAPIEnumsAndLimitsAreTheCode checks the document's closed lists
// and limits against the code's own, so that a state, a reason or a limit
// added to the code fails here until the document has it.
func TestOpenAPIEnumsAndLimitsAreTheCode(t *testing.T) {
	t.Parallel()
	_, doc := openAPI(t)
	strs := func(vs ...any) []any { return vs }
	of := func(n int, f func(int) any) []any {
		out := make([]any, n)
		for i := range out {
			out[i] = f(i)
		}
		return out
	}
	states := of(len(outbox.States), func(i int) any { return string(outbox.States[i]) })
	reasons := of(len(outbox.Reasons), func(i int) any { return string(outbox.Reasons[i]) })
	cases := []struct {
		at   string // a JSON pointer
		want any
	}{
		{"#/components/schemas/State/enum", states},
		{"#/components/schemas/OutboxSummary/properties/counts/required", states},
		{"#/components/schemas/QuarantineReason/enum", reasons},
		{"#/components/schemas/BulkRequeueRequest/properties/reason/enum", append(strs(""), reasons...)},
		{"#/components/schemas/Exporter/enum", append(strs(mappings.ExporterDefault),
			of(len(mappings.Exporters), func(i int) any { return mappings.Exporters[i] })...)},
		{"#/components/schemas/Aggregation/enum", strs(string(mappings.Sum), string(mappings.Last), string(mappings.Count))},
		{"#/components/schemas/ResolutionReason/enum", of(len(reconcile.ResolutionReasons), func(i int) any {
			return string(reconcile.ResolutionReasons[i])
		})},
		{"#/components/schemas/DiscrepancyList/properties/status/enum",
			strs(string(reconcile.StatusOpen), string(reconcile.StatusResolved), string(reconcile.StatusAll))},
		{"#/paths/~1v1~1reconcile~1discrepancies/get/parameters/1/schema/default", string(reconcile.DefaultStatus)},
		{"#/components/schemas/RequeueResult/properties/action/enum", strs(quarantine.ActionRequeued, quarantine.ActionReaddressed)},
		{"#/components/schemas/BulkRequeueItem/properties/action/enum",
			strs(quarantine.ActionRequeued, quarantine.ActionReaddressed, quarantine.ActionRefused)},
		{"#/components/schemas/UsageBatch/properties/events/maxItems", float64(meter.MaxEvents)},
		{"#/components/schemas/BulkRequeueRequest/properties/limit/maximum", float64(quarantine.MaxBulkLimit)},
		{"#/components/schemas/BulkRequeueRequest/properties/limit/default", float64(quarantine.DefaultBulkLimit)},
	}
	for _, tc := range cases {
		got, ok := pointer(doc, tc.at)
		require.True(t, ok, "%s is not in the document", tc.at)
		require.Equal(t, tc.want, got, "%s is not what the code says", tc.at)
	}
	// A requeue's refusals: the codes of the single requeue's 409 (its
	// not_found is a 404) and those a bulk requeue's answer names.
	refusals := []string{quarantine.RefusalNotFound, quarantine.RefusalMappingChanged, quarantine.RefusalNotQuarantined,
		quarantine.RefusalStillIneligible, quarantine.RefusalMayHaveReached, quarantine.RefusalNotSendable,
		quarantine.RefusalAggregationChanged, quarantine.RefusalExportStalled, quarantine.RefusalSuccessorExists,
		quarantine.RefusalPeriodClosed}
	codes, _ := pointer(doc, "#/paths/~1v1~1outbox~1items~1{id}~1requeue/post/responses/409/x-error-codes")
	require.ElementsMatch(t, of(len(refusals)-1, func(i int) any { return refusals[i+1] }), codes)
	desc, _ := pointer(doc, "#/components/schemas/BulkRequeueItem/properties/refusal/description")
	for _, code := range refusals {
		require.Contains(t, desc, code, "a bulk requeue's refusal %s", code)
	}
}
