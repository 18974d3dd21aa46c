package api_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/mappings"
)

// accountView is a tenant mapping as PUT and GET show it, with its
// stripe_account.
type accountView struct {
	StripeCustomerID string        `json:"stripe_customer_id"`
	StripeAccount    *string       `json:"stripe_account"`
	MappingVersion   int           `json:"mapping_version"`
	Changed          *bool         `json:"changed"`
	History          []accountView `json:"history"`
}

// accountOf is a view's stripe_account, "-" when absent.
func accountOf(v accountView) string {
	if v.StripeAccount == nil {
		return "-"
	}
	return *v.StripeAccount
}

// A tenant mapping's stripe_account over the API, on a node without a
// Stripe key: set, shown, versioned like every other field (a change of it
// alone is a new version), absent, null or empty for the node's
// destination (and left out of the answer then); an id that is not one is
// a field problem, one that is not text a malformed body.
func TestTenantStripeAccountAPI(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	op, fin := h.as(h.token("operator", auth.RoleOperator)), h.as(h.token("finance", auth.RoleFinance))
	put := func(body any) (accountView, map[string]any) {
		t.Helper()
		resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, body)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		var v accountView
		resp.decode(t, &v)
		var raw map[string]any
		resp.decode(t, &raw)
		return v, raw
	}

	v1, raw := put(map[string]any{"stripe_customer_id": "cus_A1", "stripe_account": "acct_one"})
	require.True(t, *v1.Changed)
	require.Equal(t, "acct_one", raw["stripe_account"])
	same, _ := put(map[string]any{"stripe_customer_id": "cus_A1", "stripe_account": "acct_one"})
	require.False(t, *same.Changed, "the same account is no change")
	require.Equal(t, v1.MappingVersion, same.MappingVersion)
	v2, _ := put(map[string]any{"stripe_customer_id": "cus_A1", "stripe_account": "acct_two"})
	require.True(t, *v2.Changed, "another account alone is a change")
	require.Greater(t, v2.MappingVersion, v1.MappingVersion)
	v3, raw := put(map[string]any{"stripe_customer_id": "cus_A1", "stripe_account": nil})
	require.True(t, *v3.Changed, "null: back to the node's destination")
	require.NotContains(t, raw, "stripe_account", "unset: left out")
	v4, _ := put(map[string]any{"stripe_customer_id": "cus_A1"})
	require.False(t, *v4.Changed, "absent is null")
	v5, _ := put(map[string]any{"stripe_customer_id": "cus_A1", "stripe_account": ""})
	require.False(t, *v5.Changed, "empty is null")
	v6, _ := put(map[string]any{"stripe_customer_id": "cus_A1", "stripe_account": "acct_one"})
	require.True(t, *v6.Changed)

	for name, account := range map[string]any{
		"no prefix":     "one",
		"prefix only":   "acct_",
		"a customer":    "cus_A1",
		"a dash":        "acct_a-b",
		"a space":       "acct_a b",
		"upper prefix":  "ACCT_1",
		"too long":      "acct_" + strings.Repeat("a", 251),
		"a control":     "acct_1\n",
		"non-ascii":     "acct_é",
		"leading space": " acct_1",
	} {
		resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, map[string]any{"stripe_customer_id": "cus_A1", "stripe_account": account})
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_mapping", resp.errorCode(t), name)
		require.Equal(t, []problem{{Field: "stripe_account", Reason: "a Stripe account id (acct_…), or empty for this node's destination"}},
			resp.problems(t), name)
	}
	resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, `{"stripe_customer_id":"cus_A1","stripe_account":7}`)
	require.Equal(t, http.StatusBadRequest, resp.status, "an account that is not text is a malformed body: %s", resp)
	require.Equal(t, "invalid_json", resp.errorCode(t))

	resp = h.request(http.MethodGet, "/v1/mappings/tenants/acme", fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var got accountView
	resp.decode(t, &got)
	require.Equal(t, v6.MappingVersion, got.MappingVersion, "a refused PUT changes nothing")
	require.Equal(t, "acct_one", accountOf(got))
	var history []string
	for _, v := range got.History {
		history = append(history, accountOf(v))
	}
	require.Equal(t, []string{"acct_one", "acct_two", "-", "acct_one"}, history, "the history shows each version's")

	resp = h.request(http.MethodGet, "/v1/mappings/tenants", fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var list struct {
		Tenants []accountView `json:"tenants"`
	}
	resp.decode(t, &list)
	require.Len(t, list.Tenants, 1)
	require.Equal(t, "acct_one", accountOf(list.Tenants[0]))
}

// With a Stripe key, a tenant mapping that names a connected account is
// checked in it: an account the platform's key may not act for (unknown,
// or its access revoked) answers 422 account_unreachable, a customer of
// the platform's own account that the connected account does not have
// 422 customer_not_found naming the account; nothing is stored. A current
// customer of the account is saved; cleared, the mapping must name a
// customer of the node's account again.
func TestTenantStripeAccountIsChecked(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_platform")
	sim.CreateCustomer("acct_one", "cus_one")
	sim.CreateCustomer("acct_gone", "cus_gone")
	sim.RevokeAccess("acct_gone")
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	h := newHarnessWith(t, false, func(d *api.Deps) { d.Mappings = &mappings.Store{Checker: mappings.StripeMeters{Client: c}} })
	op := h.as(h.token("operator", auth.RoleOperator))
	put := func(customer string, account any) response {
		t.Helper()
		return h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, map[string]any{"stripe_customer_id": customer, "stripe_account": account})
	}
	message := func(resp response) string {
		t.Helper()
		var e errorShape
		resp.decode(t, &e)
		return e.Error.Message
	}

	for _, tc := range []struct {
		customer, account, code, says string
	}{
		{"cus_gone", "acct_gone", "account_unreachable",
			"the platform's key may not act for Stripe account acct_gone (not connected, or access revoked); connect it first or leave stripe_account empty"},
		{"cus_one", "acct_nowhere", "account_unreachable", "acct_nowhere"},
		{"cus_platform", "acct_one", "customer_not_found", "Stripe has no customer cus_platform in Stripe account acct_one"},
	} {
		resp := put(tc.customer, tc.account)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
		require.Equal(t, tc.code, resp.errorCode(t), "%s in %s", tc.customer, tc.account)
		require.Contains(t, message(resp), tc.says)
	}
	resp := h.request(http.MethodGet, "/v1/mappings/tenants/acme", op, nil)
	require.Equal(t, http.StatusNotFound, resp.status, "nothing stored: %s", resp)

	resp = put("cus_one", "acct_one")
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.NotContains(t, string(resp.body), "warning")
	require.Contains(t, string(resp.body), `"stripe_account":"acct_one"`)

	resp = put("cus_one", nil)
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "cleared, cus_one is not the node's account's: %s", resp)
	require.Equal(t, "customer_not_found", resp.errorCode(t))
	require.Contains(t, message(resp), "in the account this node exports to")
	resp = put("cus_platform", nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.NotContains(t, string(resp.body), "stripe_account")

	// The customer check asked the connected account, with Stripe-Account.
	var asked []string
	for _, r := range sim.Requests() {
		if strings.HasPrefix(r.Path, "/v1/customers/") {
			asked = append(asked, r.StripeAccount+" "+strings.TrimPrefix(r.Path, "/v1/customers/"))
		}
	}
	require.Contains(t, asked, "acct_one cus_platform")
	require.Contains(t, asked, "acct_one cus_one")
	require.Contains(t, asked, " cus_platform")
}
