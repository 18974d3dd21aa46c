package api_test

import (
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

// With a Stripe key, a feature mapping takes its meter's payload keys: PUT
// and GET show them. On a node whose key is restricted (rk_…), a mapping
// that names the stream exporter is refused (422, field exporter) and
// nothing is written; v1 is still taken.
func TestFeatureMappingPayloadKeysAndRestrictedKey(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "tokens", Formula: "sum",
		CustomerPayloadKey: "account", ValuePayloadKey: "n"})
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	h := newHarnessWith(t, false, func(d *api.Deps) {
		d.Mappings = &mappings.Store{Checker: mappings.StripeMeters{Client: c}, RestrictedKey: true}
	})
	op := h.as(h.token("operator", auth.RoleOperator))
	fin := h.as(h.token("finance", auth.RoleFinance))

	resp := h.request(http.MethodPut, "/v1/mappings/features/tokens", op,
		map[string]any{"event_name": "tokens", "aggregation": "sum", "exporter": "stripe_meter_event_stream"})
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
	require.Equal(t, "invalid_mapping", resp.errorCode(t))
	problems := resp.problems(t)
	require.Len(t, problems, 1)
	require.Equal(t, "exporter", problems[0].Field)
	require.Contains(t, problems[0].Reason, "restricted key (rk_…)")
	resp = h.request(http.MethodGet, "/v1/mappings/features/tokens", fin, nil)
	require.Equal(t, http.StatusNotFound, resp.status, "nothing written: %s", resp)

	resp = h.request(http.MethodPut, "/v1/mappings/features/tokens", op,
		map[string]any{"event_name": "tokens", "aggregation": "sum", "exporter": "stripe_meter_events"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var put featureView
	resp.decode(t, &put)
	require.Equal(t, "account", *put.CustomerPayloadKey)
	require.Equal(t, "n", *put.ValuePayloadKey)

	resp = h.request(http.MethodGet, "/v1/mappings/features/tokens", fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var got featureView
	resp.decode(t, &got)
	require.Equal(t, put.MappingVersion, got.MappingVersion)
	require.Equal(t, "account", *got.CustomerPayloadKey)
	require.Equal(t, "n", *got.ValuePayloadKey)
	require.Len(t, got.History, 1)
	require.Equal(t, "account", *got.History[0].CustomerPayloadKey)
	require.Contains(t, string(resp.body), `"customer_payload_key":"account"`)
	require.Contains(t, string(resp.body), `"value_payload_key":"n"`)

	// A meter whose keys Tally cannot send is refused with its own code.
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "same", Formula: "sum",
		CustomerPayloadKey: "k", ValuePayloadKey: "k"})
	resp = h.request(http.MethodPut, "/v1/mappings/features/same", op, map[string]any{"event_name": "same", "aggregation": "sum"})
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
	require.Equal(t, "meter_payload_key_invalid", resp.errorCode(t))
}
