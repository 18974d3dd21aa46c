package api_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
)

// graceView is a tenant mapping as PUT and GET show it, with its invoice
// grace; raw is the same answer as a map, to see which fields it has.
type graceView struct {
	StripeCustomerID string      `json:"stripe_customer_id"`
	InvoiceGrace     *string     `json:"invoice_grace"`
	MappingVersion   int         `json:"mapping_version"`
	Changed          *bool       `json:"changed"`
	Warning          string      `json:"warning"`
	History          []graceView `json:"history"`
}

// graceScenario is what the steps of TestTenantInvoiceGraceAPI share
// besides the database: the tokens and the tenant acme's last version.
type graceScenario struct {
	op, fin string
	version int
}

// put PUTs body as the tenant acme's mapping and expects a 200.
func (s *graceScenario) put(t *testing.T, h *harness, body any) (graceView, map[string]any) {
	t.Helper()
	resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", s.op, body)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var v graceView
	resp.decode(t, &v)
	var raw map[string]any
	resp.decode(t, &raw)
	return v, raw
}

// get reads the tenant acme's mapping, as a view and as a map.
func (s *graceScenario) get(t *testing.T, h *harness) (graceView, map[string]any) {
	t.Helper()
	resp := h.request(http.MethodGet, "/v1/mappings/tenants/acme", s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var v graceView
	resp.decode(t, &v)
	var raw map[string]any
	resp.decode(t, &raw)
	return v, raw
}

// A tenant mapping's invoice grace over the API: set as Go's duration
// text, shown as time.Duration's ("2h0m0s"), versioned like every other
// field, absent or null for the node's TALLY_INVOICE_GRACE, and refused as
// a field problem when it is no duration or not one Stripe allows.
func TestTenantInvoiceGraceAPI(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	s := &graceScenario{op: h.as(h.token("operator", auth.RoleOperator)), fin: h.as(h.token("finance", auth.RoleFinance))}
	// In order, on one database: the refusals are checked against the
	// version the first step stored.
	runSteps(t, h,
		step{"set, shown and versioned", s.versioned},
		step{"refused", s.refused},
	)
}

func (s *graceScenario) versioned(t *testing.T, h *harness) {
	v1, raw := s.put(t, h, map[string]any{"stripe_customer_id": "cus_A1", "invoice_grace": "2h"})
	require.True(t, *v1.Changed)
	require.Equal(t, "2h0m0s", *v1.InvoiceGrace)
	require.Equal(t, true, raw["changed"], "the view's own fields are beside the mapping's")
	require.Equal(t, "cus_A1", raw["stripe_customer_id"])
	require.NotEmpty(t, v1.Warning, "no Stripe key: saved unchecked, and the answer says so")

	same, _ := s.put(t, h, map[string]any{"stripe_customer_id": "cus_A1", "invoice_grace": "120m"})
	require.False(t, *same.Changed, "the same grace in other words is no change")
	require.Equal(t, v1.MappingVersion, same.MappingVersion)

	v2, _ := s.put(t, h, map[string]any{"stripe_customer_id": "cus_A1", "invoice_grace": "90m", "period_anchor": "2026-01-15T00:00:00Z"})
	require.True(t, *v2.Changed)
	require.Greater(t, v2.MappingVersion, v1.MappingVersion)
	require.Equal(t, "1h30m0s", *v2.InvoiceGrace)

	v3, raw := s.put(t, h, map[string]any{"stripe_customer_id": "cus_A1", "invoice_grace": nil, "period_anchor": "2026-01-15T00:00:00Z"})
	require.True(t, *v3.Changed, "null: back to the node's default")
	require.NotContains(t, raw, "invoice_grace", "unset: left out")
	v4, _ := s.put(t, h, map[string]any{"stripe_customer_id": "cus_A1", "period_anchor": "2026-01-15T00:00:00Z"})
	require.False(t, *v4.Changed, "absent is null")

	v5, _ := s.put(t, h, map[string]any{"stripe_customer_id": "cus_A1", "invoice_grace": "0s", "period_anchor": "2026-01-15T00:00:00Z"})
	require.True(t, *v5.Changed, "0s is a grace of its own")
	require.Equal(t, "0s", *v5.InvoiceGrace)
	v6, _ := s.put(t, h, map[string]any{"stripe_customer_id": "cus_A1", "invoice_grace": "72h", "period_anchor": "2026-01-15T00:00:00Z"})
	require.True(t, *v6.Changed)
	require.Equal(t, "72h0m0s", *v6.InvoiceGrace, "Stripe's largest")

	got, raw := s.get(t, h)
	require.Equal(t, v6.MappingVersion, got.MappingVersion)
	require.Equal(t, "72h0m0s", raw["invoice_grace"])
	require.Nil(t, got.Changed, "a GET says nothing of a change")
	var history []string
	for _, v := range got.History {
		g := "-"
		if v.InvoiceGrace != nil {
			g = *v.InvoiceGrace
		}
		history = append(history, g)
	}
	require.Equal(t, []string{"2h0m0s", "1h30m0s", "-", "0s", "72h0m0s"}, history, "the history shows each version's")

	resp := h.request(http.MethodGet, "/v1/mappings/tenants", s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var list struct {
		Tenants []graceView `json:"tenants"`
	}
	resp.decode(t, &list)
	require.Len(t, list.Tenants, 1)
	require.Equal(t, "72h0m0s", *list.Tenants[0].InvoiceGrace)
	s.version = v6.MappingVersion
}

func (s *graceScenario) refused(t *testing.T, h *harness) {
	for name, grace := range map[string]string{
		"not a duration":    "soon",
		"empty":             "",
		"a number in text":  "7200",
		"negative":          "-1h",
		"beyond 72 hours":   "72h0m1s",
		"days":              "3d",
		"fractional second": "1.5s",
		"a nanosecond":      "1ns",
	} {
		resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", s.op, map[string]any{"stripe_customer_id": "cus_A1", "invoice_grace": grace})
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_mapping", resp.errorCode(t), name)
		problems := resp.problems(t)
		require.Len(t, problems, 1, "%s: %s", name, resp)
		require.Equal(t, "invoice_grace", problems[0].Field, name)
		require.Contains(t, problems[0].Reason, "72h", name)
	}
	resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", s.op, map[string]any{"stripe_customer_id": "acct_1", "invoice_grace": "-1h"})
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
	var fields []string
	for _, p := range resp.problems(t) {
		fields = append(fields, p.Field)
	}
	require.ElementsMatch(t, []string{"stripe_customer_id", "invoice_grace"}, fields, "every problem is named")

	resp = h.request(http.MethodPut, "/v1/mappings/tenants/acme", s.op, `{"stripe_customer_id":"cus_A1","invoice_grace":7200}`)
	require.Equal(t, http.StatusBadRequest, resp.status, "a grace that is not text is a malformed body: %s", resp)
	require.Equal(t, "invalid_json", resp.errorCode(t))

	resp = h.request(http.MethodPut, "/v1/mappings/tenants/newco", s.op, map[string]any{"stripe_customer_id": "cus_N1", "invoice_grace": "100h"})
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
	resp = h.request(http.MethodGet, "/v1/mappings/tenants/newco", s.fin, nil)
	require.Equal(t, http.StatusNotFound, resp.status, "a refused new mapping is not stored: %s", resp)

	got, _ := s.get(t, h)
	require.Equal(t, s.version, got.MappingVersion, "a refused PUT changes nothing")
	require.Equal(t, "72h0m0s", *got.InvoiceGrace)
	require.Len(t, got.History, 5)
}
