package exporter_test

import (
	"context"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/outbox"
)

func TestDestination(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{"sk_live_abc": "acct_live", "sk_test_abc": "acct_test"}})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(srv.Close)
	ctx := context.Background()

	none, err := exporter.NewResolver(exporter.Settings{})
	require.NoError(t, err)
	_, err = none.Resolve(ctx)
	require.ErrorIs(t, err, exporter.ErrNoKey, "no key: export stalls")
	require.ErrorIs(t, none.Check(ctx), exporter.ErrNoKey)

	live, err := exporter.NewResolver(exporter.Settings{Key: "sk_live_abc", APIBase: srv.URL})
	require.NoError(t, err)
	_, err = live.Destination()
	require.ErrorContains(t, err, "not resolved yet", "Destination never calls Stripe")
	require.Error(t, live.Check(ctx))
	d, err := live.Resolve(ctx)
	require.NoError(t, err)
	require.Equal(t, exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: "acct_live", Mode: outbox.ModeLive}, d)
	before := len(sim.Requests())
	_, err = live.Resolve(ctx)
	require.NoError(t, err)
	got, err := live.Destination()
	require.NoError(t, err)
	require.Equal(t, d, got)
	require.NoError(t, live.Check(ctx))
	require.Len(t, sim.Requests(), before, "resolved once, then remembered")

	connect, err := exporter.NewResolver(exporter.Settings{Key: "sk_test_abc", APIBase: srv.URL, Account: "acct_connected",
		Exporter: exporter.StripeMeterEventStream})
	require.NoError(t, err)
	before = len(sim.Requests())
	d, err = connect.Resolve(ctx)
	require.NoError(t, err)
	require.Equal(t, exporter.Destination{Exporter: exporter.StripeMeterEventStream, Account: "acct_connected", Mode: outbox.ModeTest}, d)
	require.Len(t, sim.Requests(), before, "STRIPE_ACCOUNT needs no call")

	refused, err := exporter.NewResolver(exporter.Settings{Key: "sk_test_unknown", APIBase: srv.URL})
	require.NoError(t, err)
	_, err = refused.Resolve(ctx)
	require.ErrorContains(t, err, "export stalled")
	require.ErrorContains(t, err, "401")
	require.NotContains(t, err.Error(), "unknown", "the key is never echoed")
	before = len(sim.Requests())
	_, err = refused.Resolve(ctx)
	require.Error(t, err)
	_, err = refused.Destination()
	require.ErrorContains(t, err, "401")
	require.Len(t, sim.Requests(), before, "a failed lookup is not retried at once")

	_, err = exporter.NewResolver(exporter.Settings{Key: "pk_test_abc"})
	require.Error(t, err, "a publishable key cannot export")
	_, err = exporter.NewResolver(exporter.Settings{Exporter: "carrier_pigeon"})
	require.Error(t, err)
}
