package api_test

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/outbox"
)

const webhookSecret = "whsec_test_0123456789abcdef"

// Stripe's meter error reports arrive as signed thin events: a bad or stale
// signature answers 400 and records nothing; a good one is fetched and
// recorded once, however often it is delivered, as evidence on the item.
func TestStripeEventsWebhook(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{stripesim.DefaultKey: "acct_1"}})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateMeter("acct_1", stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
	sim.CreateCustomer("acct_1", "cus_1")
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)

	h := newHarnessWith(t, true, func(d *api.Deps) {
		d.Webhook = &api.WebhookDeps{Secret: webhookSecret, Fetch: client.MeterErrorEvent}
	})
	op := h.as(h.token("op", auth.RoleOperator))
	ingest := h.as(h.token("svc", auth.RoleIngest))
	require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/features/logins", op,
		map[string]any{"event_name": "logins", "aggregation": "count"}).status)
	require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/tenants/t1", op,
		map[string]any{"stripe_customer_id": "cus_1"}).status)
	require.Equal(t, http.StatusAccepted, h.request(http.MethodPost, "/v1/usage", ingest,
		batch(event{"id": "e1", "tenant": "t1", "feature": "logins", "value": 1})).status)

	// Send the item to the simulator; then Stripe fails it after the fact.
	leases, err := h.parts.Outbox.Claim(h.ctx, h.pool, outbox.ClaimOptions{Owner: "test", Limit: 1})
	require.NoError(t, err)
	require.Len(t, leases, 1)
	o := exporter.NewStripeV1(client, 2*time.Second).Send(h.ctx, leases[0])
	require.Equal(t, outbox.Accepted, o.Kind, "%+v", o)
	o.Lease = leases[0]
	_, err = h.parts.Outbox.Record(h.ctx, h.pool, []outbox.Outcome{o})
	require.NoError(t, err)
	require.True(t, sim.DropEvent("acct_1", leases[0].Identifier))
	reports := sim.ErrorReports("acct_1")
	require.Len(t, reports, 1)

	post := func(body []byte, sig string) response {
		req, err := http.NewRequestWithContext(h.ctx, http.MethodPost, h.url+"/v1/stripe/events", bytes.NewReader(body))
		require.NoError(t, err)
		if sig != "" {
			req.Header.Set("Stripe-Signature", sig)
		}
		return h.send(req)
	}
	recorded := func() int64 { return h.count(`SELECT count(*) FROM stripe_events`) }

	body, sig := stripesim.SignedThinEvent(reports[0], "whsec_wrong", time.Now())
	resp := post(body, sig)
	require.Equal(t, http.StatusBadRequest, resp.status, "%s", resp)
	require.Equal(t, "invalid_signature", resp.errorCode(t))
	body, sig = stripesim.SignedThinEvent(reports[0], webhookSecret, time.Now().Add(-10*time.Minute))
	resp = post(body, sig)
	require.Equal(t, http.StatusBadRequest, resp.status, "a stale signature: %s", resp)
	require.Contains(t, string(resp.body), "older than 300 seconds")
	resp = post(body, "")
	require.Equal(t, http.StatusBadRequest, resp.status)
	body, sig = stripesim.SignedThinEvent(reports[0], webhookSecret, time.Now())
	resp = post(append(body, ' '), sig)
	require.Equal(t, http.StatusBadRequest, resp.status, "the body was changed after signing")
	require.Zero(t, recorded(), "nothing recorded from a bad delivery")

	resp = post(body, sig)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.JSONEq(t, `{"status":"recorded"}`, string(resp.body))
	resp = post(body, sig)
	require.Equal(t, http.StatusOK, resp.status)
	require.JSONEq(t, `{"status":"duplicate"}`, string(resp.body))
	// Delivered again by the simulator's event destination: still once.
	n, err := sim.DeliverReports(context.Background(), "acct_1", h.url+"/v1/stripe/events", webhookSecret)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, int64(1), recorded())
	require.Equal(t, int64(1), h.count(`SELECT count(*) FROM meter_error_evidence WHERE item_id = $1`, leases[0].ID))

	resp = h.request(http.MethodGet, "/v1/outbox/items/"+strconv.FormatInt(leases[0].ID, 10), op, nil)
	var view struct {
		Evidence []struct {
			EventID    string `json:"event_id"`
			EventType  string `json:"event_type"`
			Identifier string `json:"identifier"`
			Code       string `json:"code"`
		} `json:"evidence"`
	}
	resp.decode(t, &view)
	require.Len(t, view.Evidence, 1)
	require.Equal(t, reports[0].ID, view.Evidence[0].EventID)
	require.Equal(t, stripeapi.EventMeterErrorReport, view.Evidence[0].EventType)
	require.Equal(t, leases[0].Identifier, view.Evidence[0].Identifier)
	require.Equal(t, stripesim.CodeDropped, view.Evidence[0].Code)

	// Another event type is acknowledged and ignored.
	other := reports[0]
	other.ID, other.Type = "evt_other", "v2.core.event_destination.ping"
	body, sig = stripesim.SignedThinEvent(other, webhookSecret, time.Now())
	resp = post(body, sig)
	require.JSONEq(t, `{"status":"ignored"}`, string(resp.body))
	require.Equal(t, int64(1), recorded())
}

// Without a signing secret the destination is not configured: 503.
func TestStripeEventsWithoutSecret(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	resp := h.request(http.MethodPost, "/v1/stripe/events", "", `{"id":"evt_1","type":"x"}`)
	require.Equal(t, http.StatusServiceUnavailable, resp.status)
	require.Equal(t, "webhooks_not_configured", resp.errorCode(t))
}
