package api_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// snapshotSecret signs the snapshot destination's posts; the thin one has
// webhookSecret. STRIPE_WEBHOOK_SECRET names both.
const snapshotSecret = "whsec_test_snapshot_fedcba9876"

// A billing.meter.* v1 event from a snapshot destination, signed with its
// own secret, makes Tally read that account's meters at once: a
// deactivation pauses the event name, a reactivation resumes it. An event
// about an account Tally does not export to is foreign, another v1 type is
// ignored, and a read Stripe fails is a 502 for Stripe to deliver again.
// Thin events keep their secret.
func TestMeterEventsReadTheAccountsMeters(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{stripesim.DefaultKey: "acct_1"}})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	meters := map[string]stripesim.Meter{}
	for _, a := range []string{"acct_1", webhookConnected, webhookForeign} {
		sim.AddAccount(a)
		meters[a] = sim.CreateMeter(a, stripesim.MeterSpec{EventName: "logins", Formula: "count"})
	}
	dir := exporter.NewMeterDirectory()
	h := newHarnessWith(t, true, func(d *api.Deps) {
		dest := func() (exporter.Destination, error) {
			return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: "acct_1", Mode: outbox.ModeTest}, nil
		}
		connected := func(context.Context, pgdb.Querier) ([]string, error) { return []string{webhookConnected}, nil }
		events, err := reconcile.NewEvents(reconcile.EventsConfig{Outbox: d.Outbox, Destination: dest, Connected: connected,
			Logger: slog.New(slog.DiscardHandler)})
		require.NoError(t, err)
		backfill, err := reconcile.NewBackfill(reconcile.BackfillConfig{Events: events, Key: stripesim.DefaultKey, APIBase: srv.URL,
			Destination: dest, Connected: connected, Limiter: exporter.NewLimiter(1000), Meters: dir,
			Logger: slog.New(slog.DiscardHandler), RetryInitial: time.Millisecond, RetryMax: 10 * time.Millisecond})
		require.NoError(t, err)
		client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
		require.NoError(t, err)
		d.Webhook = &api.WebhookDeps{Secret: webhookSecret + ", " + snapshotSecret, Events: events, Fetch: client.Event,
			Meters: backfill.MetersChanged}
	})
	post := func(ev stripesim.MeterEvent) response {
		t.Helper()
		body, sig := stripesim.SignedSnapshotEvent(ev, snapshotSecret, time.Now())
		return postSigned(t, h, body, sig)
	}
	last := func(account string) stripesim.MeterEvent {
		evs := sim.MeterEvents(account)
		return evs[len(evs)-1]
	}
	paused := func() []exporter.PausedMeter {
		t.Helper()
		dir.Invalidate()
		p, err := dir.Paused(h.ctx, h.pool)
		require.NoError(t, err)
		return p
	}

	require.NoError(t, sim.DeactivateMeter(webhookConnected, meters[webhookConnected].ID))
	resp := post(last(webhookConnected))
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.JSONEq(t, `{"status":"meters_read"}`, string(resp.body))
	p := paused()
	require.Len(t, p, 1)
	require.Equal(t, webhookConnected, p[0].Account)
	require.Equal(t, meters[webhookConnected].ID, p[0].Meter)

	require.NoError(t, sim.ReactivateMeter(webhookConnected, meters[webhookConnected].ID))
	resp = post(last(webhookConnected))
	require.JSONEq(t, `{"status":"meters_read"}`, string(resp.body))
	require.Empty(t, paused(), "resumed")

	// The node's own account: its events carry no "account".
	require.NoError(t, sim.DeactivateMeter("acct_1", meters["acct_1"].ID))
	resp = post(last("acct_1"))
	require.JSONEq(t, `{"status":"meters_read"}`, string(resp.body))
	require.Len(t, paused(), 1)

	require.NoError(t, sim.DeactivateMeter(webhookForeign, meters[webhookForeign].ID))
	resp = post(last(webhookForeign))
	require.JSONEq(t, `{"status":"foreign"}`, string(resp.body))

	other := last("acct_1")
	other.Type = "customer.created"
	resp = post(other)
	require.JSONEq(t, `{"status":"ignored"}`, string(resp.body))

	sim.Configure(webhookConnected, stripesim.Limits{Faults: stripesim.Faults{ReadFault: 1}})
	resp = post(last(webhookConnected))
	require.Equal(t, http.StatusBadGateway, resp.status, "%s", resp)

	body, sig := stripesim.SignedSnapshotEvent(last("acct_1"), "whsec_test_other", time.Now())
	require.Equal(t, http.StatusBadRequest, postSigned(t, h, body, sig).status, "a secret of neither destination")
}
