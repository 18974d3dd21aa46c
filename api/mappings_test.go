package api_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
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

// mappingsScenario is what the steps of TestMappingsAPI share besides the
// database: the tokens, and the versions the PUTs before a step stored.
type mappingsScenario struct {
	op, fin string
	feature int // the feature api's mapping version
	tenant  int // the tenant acme's mapping version
}

// put PUTs body at path as the operator and decodes a 200 both as a feature
// and as a tenant.
func (s *mappingsScenario) put(t *testing.T, h *harness, path string, body any) (response, featureView, tenantView) {
	resp := h.request(http.MethodPut, path, s.op, body)
	var f featureView
	var tn tenantView
	if resp.status == http.StatusOK {
		resp.decode(t, &f)
		resp.decode(t, &tn)
	}
	return resp, f, tn
}

func TestMappingsAPI(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	s := &mappingsScenario{op: h.as(h.token("operator", auth.RoleOperator)), fin: h.as(h.token("finance", auth.RoleFinance))}
	// In order, on one database: each refusal is checked against the
	// version the PUTs of the step before stored.
	runSteps(t, h,
		step{"features", s.features},
		step{"refused features", s.refusedFeatures},
		step{"tenants", s.tenants},
		step{"refused tenants", s.refusedTenants},
		step{"tenant period_anchor not RFC 3339", s.tenantAnchorNotRFC3339},
	)
}

// features: a PUT stores a version only when something changed; GET shows
// the history of versions.
func (s *mappingsScenario) features(t *testing.T, h *harness) {
	resp := h.request(http.MethodGet, "/v1/mappings/features", s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status)
	require.JSONEq(t, `{"features":[]}`, string(resp.body))

	resp, v1, _ := s.put(t, h, "/v1/mappings/features/api", map[string]any{"event_name": "api_calls", "aggregation": "sum"})
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
	resp, same, _ := s.put(t, h, "/v1/mappings/features/api", map[string]any{"event_name": "api_calls", "aggregation": "sum", "window": "1h"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.NotNil(t, same.Changed)
	require.False(t, *same.Changed)
	require.Equal(t, v1.MappingVersion, same.MappingVersion)

	resp, v2, _ := s.put(t, h, "/v1/mappings/features/api", map[string]any{"event_name": "api_calls", "aggregation": "sum", "window": "15m"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.True(t, *v2.Changed)
	require.Greater(t, v2.MappingVersion, v1.MappingVersion)
	require.Equal(t, "15m0s", v2.Window)

	resp = h.request(http.MethodGet, "/v1/mappings/features/api", s.fin, nil)
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

	resp = h.request(http.MethodGet, "/v1/mappings/features", s.fin, nil)
	var list struct {
		Features []featureView `json:"features"`
	}
	resp.decode(t, &list)
	require.Len(t, list.Features, 1)
	require.Equal(t, v2.MappingVersion, list.Features[0].MappingVersion)
	s.feature = v2.MappingVersion
}

// refusedFeatures: a refused PUT names every bad field and changes nothing.
func (s *mappingsScenario) refusedFeatures(t *testing.T, h *harness) {
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
		resp := h.request(http.MethodPut, tc.path, s.op, tc.body)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_mapping", resp.errorCode(t), name)
		var fields []string
		for _, p := range resp.problems(t) {
			fields = append(fields, p.Field)
			require.NotEmpty(t, p.Reason)
		}
		require.ElementsMatch(t, tc.fields, fields, "%s: %s", name, resp)
	}
	resp := h.request(http.MethodPut, "/v1/mappings/features/api", s.op, `{"event_name":"a","aggregation":"sum","window":"soon"}`)
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
		resp := h.request(http.MethodPut, "/v1/mappings/features/api", s.op, body)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_json", resp.errorCode(t), name)
	}
	resp = h.request(http.MethodGet, "/v1/mappings/features/api", s.fin, nil)
	var got featureView
	resp.decode(t, &got)
	require.Equal(t, s.feature, got.MappingVersion, "a refused PUT changes nothing")
	require.Len(t, got.History, 2)

	resp = h.request(http.MethodGet, "/v1/mappings/features/nosuch", s.fin, nil)
	require.Equal(t, http.StatusNotFound, resp.status)
	require.Equal(t, "not_found", resp.errorCode(t))
}

// tenants: a tenant's customer and period anchor, versioned like features.
func (s *mappingsScenario) tenants(t *testing.T, h *harness) {
	resp, _, tv1 := s.put(t, h, "/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_A1"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.NotNil(t, tv1.Changed)
	require.True(t, *tv1.Changed)
	require.Positive(t, tv1.MappingVersion)
	require.Equal(t, "cus_A1", tv1.StripeCustomerID)
	require.Nil(t, tv1.PeriodAnchor)
	resp, _, same := s.put(t, h, "/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_A1"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.NotNil(t, same.Changed)
	require.False(t, *same.Changed, "an identical PUT is no change")
	require.Equal(t, tv1.MappingVersion, same.MappingVersion)

	anchor := "2026-01-15T10:00:00+02:00"
	resp, _, tv2 := s.put(t, h, "/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_A1", "period_anchor": anchor})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.True(t, *tv2.Changed)
	require.Greater(t, tv2.MappingVersion, tv1.MappingVersion)
	require.NotNil(t, tv2.PeriodAnchor)
	require.True(t, tv2.PeriodAnchor.Equal(time.Date(2026, 1, 15, 8, 0, 0, 0, time.UTC)), tv2.PeriodAnchor)
	_, _, tv3 := s.put(t, h, "/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_A1", "period_anchor": "2026-01-15T08:00:00Z"})
	require.False(t, *tv3.Changed, "the same instant in another offset is no change")
	require.Equal(t, tv2.MappingVersion, tv3.MappingVersion)
	_, _, tv4 := s.put(t, h, "/v1/mappings/tenants/acme", map[string]any{"stripe_customer_id": "cus_B2"})
	require.True(t, *tv4.Changed)
	require.Nil(t, tv4.PeriodAnchor, "no anchor: back to calendar months")

	resp = h.request(http.MethodGet, "/v1/mappings/tenants/acme", s.fin, nil)
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

	resp = h.request(http.MethodGet, "/v1/mappings/tenants", s.fin, nil)
	var list struct {
		Tenants []tenantView `json:"tenants"`
	}
	resp.decode(t, &list)
	require.Len(t, list.Tenants, 1)
	s.tenant = tv4.MappingVersion
}

// refusedTenants: a refused PUT names every bad field and changes nothing.
func (s *mappingsScenario) refusedTenants(t *testing.T, h *harness) {
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
		resp := h.request(http.MethodPut, tc.path, s.op, tc.body)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_mapping", resp.errorCode(t), name)
		var fields []string
		for _, p := range resp.problems(t) {
			fields = append(fields, p.Field)
		}
		require.ElementsMatch(t, tc.fields, fields, "%s: %s", name, resp)
	}
	resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", s.op, `{"stripe_customer_id":"cus_1","customer":"x"}`)
	require.Equal(t, http.StatusBadRequest, resp.status, "%s", resp)
	require.Equal(t, "invalid_json", resp.errorCode(t))
	resp = h.request(http.MethodGet, "/v1/mappings/tenants/acme", s.fin, nil)
	var got tenantView
	resp.decode(t, &got)
	require.Equal(t, s.tenant, got.MappingVersion, "a refused PUT changes nothing")
}

func (s *mappingsScenario) tenantAnchorNotRFC3339(t *testing.T, h *harness) {
	resp := h.request(http.MethodPut, "/v1/mappings/tenants/acme", s.op, map[string]any{"stripe_customer_id": "cus_1", "period_anchor": "2026-01-15"})
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s", resp)
	require.Equal(t, "invalid_mapping", resp.errorCode(t))
	require.Equal(t, "period_anchor", resp.problems(t)[0].Field)
}

// exporterScenario is what the steps of TestFeatureMappingExporterAPI share
// besides the database: the tokens, and the feature api's last version.
type exporterScenario struct {
	op, fin string
	version int
}

// put PUTs body as the feature api's mapping and expects a 200.
func (s *exporterScenario) put(t *testing.T, h *harness, body any) featureView {
	t.Helper()
	resp := h.request(http.MethodPut, "/v1/mappings/features/api", s.op, body)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var f featureView
	resp.decode(t, &f)
	return f
}

// get reads the feature api's mapping, as a view and as raw JSON.
func (s *exporterScenario) get(t *testing.T, h *harness) (featureView, map[string]any) {
	t.Helper()
	resp := h.request(http.MethodGet, "/v1/mappings/features/api", s.fin, nil)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var f featureView
	resp.decode(t, &f)
	var raw map[string]any
	resp.decode(t, &raw)
	return f, raw
}

// A feature mapping's exporter over the API: set, shown (empty when it is
// the node's default), versioned like every other field, validated, and
// carried by the items staged for the feature.
func TestFeatureMappingExporterAPI(t *testing.T) {
	t.Parallel()
	h := newHarness(t, true)
	s := &exporterScenario{op: h.as(h.token("operator", auth.RoleOperator)), fin: h.as(h.token("finance", auth.RoleFinance))}
	// In order, on one database: the refusals are checked against the
	// version the first step stored.
	runSteps(t, h,
		step{"set, shown and versioned", s.versioned},
		step{"validated", s.validated},
		step{"carried by staged items", s.carriedByItems},
	)
}

func (s *exporterScenario) versioned(t *testing.T, h *harness) {
	v1 := s.put(t, h, map[string]any{"event_name": "api_calls", "aggregation": "sum", "exporter": "stripe_meter_event_stream"})
	require.True(t, *v1.Changed)
	require.Equal(t, "stripe_meter_event_stream", *v1.Exporter)
	same := s.put(t, h, map[string]any{"event_name": "api_calls", "aggregation": "sum", "window": "1h", "exporter": "stripe_meter_event_stream"})
	require.False(t, *same.Changed, "an identical PUT is no change")
	require.Equal(t, v1.MappingVersion, same.MappingVersion)
	got, raw := s.get(t, h)
	require.Equal(t, "stripe_meter_event_stream", raw["exporter"])
	require.Equal(t, v1.MappingVersion, got.MappingVersion)
	require.Len(t, got.History, 1)
	require.Equal(t, "stripe_meter_event_stream", *got.History[0].Exporter)

	// Left out: the node's default again, a change and a new version.
	v2 := s.put(t, h, map[string]any{"event_name": "api_calls", "aggregation": "sum"})
	require.True(t, *v2.Changed)
	require.Greater(t, v2.MappingVersion, v1.MappingVersion)
	require.Empty(t, *v2.Exporter)
	got, raw = s.get(t, h)
	require.Contains(t, raw, "exporter")
	require.Equal(t, "", raw["exporter"], "shown as the empty string")
	require.Len(t, got.History, 2)
	require.Empty(t, *got.History[1].Exporter)
	v3 := s.put(t, h, map[string]any{"event_name": "api_calls", "aggregation": "sum", "exporter": "stripe_meter_events"})
	require.True(t, *v3.Changed, "naming the default exporter is a choice of its own")
	require.Equal(t, "stripe_meter_events", *v3.Exporter)
	s.version = v3.MappingVersion
}

func (s *exporterScenario) validated(t *testing.T, h *harness) {
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
		resp := h.request(http.MethodPut, path, s.op, body)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_mapping", resp.errorCode(t), name)
		var fields []string
		for _, p := range resp.problems(t) {
			fields = append(fields, p.Field)
		}
		require.Contains(t, fields, "exporter", "%s: %s", name, resp)
	}
	resp := h.request(http.MethodPut, "/v1/mappings/features/api", s.op, `{"event_name":"api_calls","aggregation":"sum","exporter":2}`)
	require.Equal(t, http.StatusBadRequest, resp.status, "%s", resp)
	require.Equal(t, "invalid_json", resp.errorCode(t))
	got, _ := s.get(t, h)
	require.Equal(t, s.version, got.MappingVersion, "a refused PUT changes nothing")
	require.Len(t, got.History, 3)
	resp = h.request(http.MethodGet, "/v1/mappings/features/gpu", s.fin, nil)
	require.Equal(t, http.StatusNotFound, resp.status, "a refused new mapping is not stored")
}

// carriedByItems: staged items take the feature's exporter, or the node's
// default (testTarget: stripe_meter_events) when it names none.
func (s *exporterScenario) carriedByItems(t *testing.T, h *harness) {
	s.put(t, h, map[string]any{"event_name": "api_calls", "aggregation": "sum", "exporter": "stripe_meter_event_stream"})
	resp := h.request(http.MethodPut, "/v1/mappings/features/logins", s.op, map[string]any{"event_name": "logins", "aggregation": "count"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	resp = h.request(http.MethodPut, "/v1/mappings/tenants/acme", s.op, map[string]any{"stripe_customer_id": "cus_acme"})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	hour := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour)
	resp = h.request(http.MethodPost, "/v1/usage", h.as(h.token("ing", auth.RoleIngest)), batch(
		event{"id": "a1", "tenant": "acme", "feature": "api", "value": 2, "timestamp": rfc(hour.Add(time.Minute))},
		event{"id": "l1", "tenant": "acme", "feature": "logins", "value": 1},
	))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
	require.Equal(t, meter.PassResult{Items: 1, Events: 1}, h.pass())
	for feature, want := range map[string]string{"api": "stripe_meter_event_stream", "logins": "stripe_meter_events"} {
		resp = h.request(http.MethodGet, "/v1/outbox/items?feature="+feature, s.fin, nil)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		var list struct {
			Items []ItemView `json:"items"`
		}
		resp.decode(t, &list)
		require.Len(t, list.Items, 1, feature)
		require.Equal(t, want, list.Items[0].Exporter, feature)
		require.Equal(t, outbox.Identity{TenantKey: "acme", SubjectKind: list.Items[0].SubjectKind, SubjectRef: list.Items[0].SubjectRef,
			Exporter: want, DestinationAccount: "acct_1", Mode: outbox.ModeTest, MappingVersion: list.Items[0].MappingVersion}.Identifier(),
			list.Items[0].Identifier, feature)
	}
}
