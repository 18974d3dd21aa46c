package main

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// newAccountDoors is newDoors on a simulator with connected accounts: the
// platform's own account has the customer cus_acme; the connected account
// acct_one has cus_one; acct_gone has cus_gone, and the platform's access
// to it is revoked.
func newAccountDoors(t *testing.T) (*doors, *stripesim.Server) {
	t.Helper()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_acme")
	sim.CreateCustomer("acct_one", "cus_one")
	sim.CreateCustomer("acct_gone", "cus_gone")
	sim.RevokeAccess("acct_gone")

	env := []string{"TALLY_DATABASE_URL=" + testdb.URL(t), "STRIPE_API_KEY=" + stripesim.DefaultKey,
		"STRIPE_API_BASE=" + srv.URL, "STRIPE_METER_EVENTS_BASE=" + srv.URL, "TALLY_LOG_LEVEL=warn"}
	n := &node{t: t, addr: freeAddr(t), env: append(env, "TALLY_ADMIN_TOKEN="+doorsAdmin)}
	n.env = append(n.env, "TALLY_LISTEN="+n.addr)
	n.start()
	t.Cleanup(n.stop)
	d := &doors{t: t, base: "http://" + n.addr, env: env}
	d.signIn()
	return d, sim
}

// A tenant mapping naming a connected account the platform's key may not
// act for (revoked, or never connected) is refused account_unreachable by
// the API, `tally mappings tenants set --stripe-account` and the console
// alike; a customer of the platform's own account is refused
// customer_not_found for a tenant mapped to a connected account, the
// message naming the account. Nothing refused is saved. Restored, the
// account is accepted at every door.
func TestTenantStripeAccountIsRefusedAtEveryDoor(t *testing.T) {
	t.Parallel()
	d, sim := newAccountDoors(t)
	for _, tc := range []struct {
		name, customer, account, code, says string
	}{
		{"revoked account", "cus_gone", "acct_gone", "account_unreachable",
			"the platform's key may not act for Stripe account acct_gone (not connected, or access revoked); connect it first or leave stripe_account empty"},
		{"unknown account", "cus_one", "acct_nowhere", "account_unreachable", "Stripe account acct_nowhere"},
		{"the platform's customer", "cus_acme", "acct_one", "customer_not_found", "Stripe has no customer cus_acme in Stripe account acct_one"},
	} {
		code, body := post(t, http.MethodPut, d.base+"/v1/mappings/tenants/acme", doorsAdmin,
			map[string]string{"stripe_customer_id": tc.customer, "stripe_account": tc.account})
		require.Equal(t, http.StatusUnprocessableEntity, code, "API, %s: %s", tc.name, body)
		require.Contains(t, body, `"code":"`+tc.code+`"`, "API, %s", tc.name)
		require.Contains(t, body, tc.says, "API, %s", tc.name)

		status, _, stderr := d.cli("mappings", "tenants", "set", "acme", "--customer", tc.customer, "--stripe-account", tc.account)
		require.Equal(t, 1, status, "CLI, %s: %s", tc.name, stderr)
		require.Contains(t, stderr, "tally mappings tenants: "+tc.code+": ", "CLI, %s", tc.name)
		require.Contains(t, stderr, tc.says, "CLI, %s", tc.name)

		require.Equal(t, "refused "+tc.code, d.console("tenants",
			url.Values{"tenant": {"acme"}, "customer": {tc.customer}, "stripe_account": {tc.account}}), "console, %s", tc.name)

		code, body = post(t, http.MethodGet, d.base+"/v1/mappings/tenants/acme", doorsAdmin, nil)
		require.Equal(t, http.StatusNotFound, code, "%s: nothing saved: %s", tc.name, body)
	}

	sim.RestoreAccess("acct_gone")
	code, body := post(t, http.MethodPut, d.base+"/v1/mappings/tenants/acme", doorsAdmin,
		map[string]string{"stripe_customer_id": "cus_gone", "stripe_account": "acct_gone"})
	require.Equal(t, http.StatusOK, code, "API, restored: %s", body)
	status, out, stderr := d.cli("mappings", "tenants", "set", "globex", "--customer", "cus_gone", "--stripe-account", "acct_gone")
	require.Equal(t, 0, status, "CLI, restored: %s", stderr)
	require.Contains(t, out, `"stripe_account": "acct_gone"`)
	require.Equal(t, "saved tenant_saved", d.console("tenants",
		url.Values{"tenant": {"initech"}, "customer": {"cus_gone"}, "stripe_account": {"acct_gone"}}), "console, restored")

	sim.RevokeAccess("acct_gone")
	status, _, stderr = d.cli("mappings", "tenants", "set", "globex", "--customer", "cus_gone", "--stripe-account", "acct_gone")
	require.Equal(t, 1, status, "revoked again, even an unchanged mapping is refused: %s", stderr)
	require.Contains(t, stderr, "account_unreachable: ")
}

// `tally mappings tenants set --stripe-account` sets the tenant mapping's
// connected account, versioned like its other fields: the same again is
// no change; left out (or empty), the mapping goes back to the node's
// destination — whose customer it must then name. A malformed id is a
// usage error that saves nothing. The flag is the mapping's, never the
// node's STRIPE_ACCOUNT.
func TestMappingsTenantsSetStripeAccount(t *testing.T) {
	t.Parallel()
	d, _ := newAccountDoors(t)
	set := func(args ...string) (int, string, string) {
		t.Helper()
		return d.cli(append([]string{"mappings", "tenants", "set", "acme"}, args...)...)
	}
	status, out, stderr := set("--customer", "cus_one", "--stripe-account", "acct_one")
	require.Equal(t, 0, status, stderr)
	require.Contains(t, out, `"stripe_account": "acct_one"`)
	require.Contains(t, out, `"changed": true`)
	status, out, stderr = set("--customer", "cus_one", "--stripe-account=acct_one")
	require.Equal(t, 0, status, stderr)
	require.Contains(t, out, `"changed": false`, "the same account")

	for _, bad := range []string{"cus_1", "acct_", "acct_a-b", "acct_" + strings.Repeat("a", 251)} {
		status, _, stderr = set("--customer", "cus_one", "--stripe-account", bad)
		require.Equal(t, 2, status, "%s: %s", bad, stderr)
		require.Contains(t, stderr, "invalid_mapping: invalid input: stripe_account: a Stripe account id (acct_…), or empty for this node's destination", bad)
	}

	status, _, stderr = set("--customer", "cus_one")
	require.Equal(t, 1, status, "left out: the node's account, which has no cus_one: %s", stderr)
	require.Contains(t, stderr, "customer_not_found: Stripe has no customer cus_one in the account this node exports to")
	status, out, stderr = set("--customer", "cus_acme", "--stripe-account", "")
	require.Equal(t, 0, status, stderr)
	require.Contains(t, out, `"changed": true`, "cleared: the node's destination again")
	require.NotContains(t, out, "stripe_account")

	status, out, stderr = d.cli("mappings", "tenants", "get", "acme")
	require.Equal(t, 0, status, stderr)
	require.Equal(t, 1, strings.Count(out, `"stripe_account": "acct_one"`), "the first version, in the history and nowhere else: %s", out)
	status, out, stderr = d.cli("mappings", "tenants", "-h")
	require.Equal(t, 0, status, stderr)
	require.Contains(t, out+stderr, "the Stripe Connect connected account (acct_…) the tenant's usage is exported to")
}
