package api_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/mappings"
)

// With a Stripe key, a tenant mapping's customer must exist, not deleted,
// in the node's account: 422 with the refusal's code otherwise, nothing
// stored; a current customer is saved with no warning.
func TestTenantMappingChecksTheCustomer(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_acme")
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_gone")
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	_, err = c.Stripe().V1Customers.Delete(context.Background(), "cus_gone", nil)
	require.NoError(t, err)
	h := newHarnessWith(t, false, func(d *api.Deps) { d.Mappings = &mappings.Store{Checker: mappings.StripeMeters{Client: c}} })
	op := h.as(h.token("operator", auth.RoleOperator))

	for customer, code := range map[string]string{"cus_acmee": "customer_not_found", "cus_gone": "customer_deleted"} {
		resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, map[string]any{"stripe_customer_id": customer})
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
		require.Equal(t, code, resp.errorCode(t), customer)
	}
	resp := h.request(http.MethodGet, "/v1/mappings/tenants/acme", op, nil)
	require.Equal(t, http.StatusNotFound, resp.status, "nothing stored: %s", resp)

	resp = h.request(http.MethodPut, "/v1/mappings/tenants/acme", op, map[string]any{"stripe_customer_id": "cus_acme"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.NotContains(t, string(resp.body), "warning")
}

// Without a Stripe key a mapping is saved, and the answer says it was not
// checked.
func TestMappingWithoutAKeyIsSavedWithAWarning(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	op := h.as(h.token("operator", auth.RoleOperator))
	for path, body := range map[string]map[string]any{
		"/v1/mappings/tenants/acme":   {"stripe_customer_id": "cus_typo"},
		"/v1/mappings/features/api_x": {"event_name": "api_callz", "aggregation": "sum"},
	} {
		resp := h.request(http.MethodPut, path, op, body)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		var got struct{ Warning string }
		resp.decode(t, &got)
		require.Equal(t, mappings.UncheckedWarning, got.Warning, path)
	}
}
