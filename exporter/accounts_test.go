package exporter_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
)

// Connected reads the mapped accounts again for an account it does not
// know (a mapping saved a moment ago), stalls and restores accounts one at
// a time, and a probe restores only an account Stripe answers for again.
func TestConnectedStallsAndProbesPerAccount(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	sim := stripesim.New(stripesim.Options{AccountInvalidStatus: http.StatusBadRequest})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.AddAccount("acct_a")
	sim.AddAccount("acct_b")
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)

	mapped := []string{"acct_a"}
	var loads atomic.Int32
	c := exporter.NewConnected(nil, client.CheckAccess, nil)
	_, err = c.Known(ctx, "acct_a")
	require.Error(t, err, "no source yet: the item is put back, not quarantined")
	c.SetSource(func(context.Context) ([]string, error) { loads.Add(1); return mapped, nil })
	ok, err := c.Known(ctx, "acct_a")
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = c.Known(ctx, "acct_a")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, int32(1), loads.Load(), "a known account is not read again")
	mapped = append(mapped, "acct_b")
	ok, err = c.Known(ctx, "acct_b")
	require.NoError(t, err)
	require.True(t, ok, "an unknown account is read again first")
	ok, err = c.Known(ctx, "acct_never")
	require.NoError(t, err)
	require.False(t, ok)

	require.Nil(t, c.Skip())
	require.True(t, c.Refused("acct_b", 400))
	require.False(t, c.Refused("acct_b", 400), "not news twice")
	require.True(t, c.Refused("acct_a", 403))
	require.Equal(t, []string{"acct_a", "acct_b"}, c.Skip())

	// acct_a answers again, acct_b is revoked: one probe restores acct_a
	// alone.
	sim.RevokeAccess("acct_b")
	c.ProbeOnce(ctx)
	require.Equal(t, []string{"acct_b"}, c.Skip())
	stalled := c.Stalled()
	require.Len(t, stalled, 1)
	require.Equal(t, 400, stalled[0].Status)
	require.False(t, stalled[0].Probed.IsZero())
	require.Contains(t, stalled[0].Explain(), "acct_b")

	sim.RestoreAccess("acct_b")
	c.ProbeOnce(ctx)
	require.Nil(t, c.Skip())
	require.False(t, c.Works("acct_b"), "not stalled any more")

	// A source that fails says so.
	c2 := exporter.NewConnected(func(context.Context) ([]string, error) { return nil, errors.New("down") }, nil, nil)
	_, err = c2.Known(ctx, "acct_a")
	require.Error(t, err)
}
