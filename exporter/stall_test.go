package exporter_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// gate is Stripe that can go away: while down, every connection is closed
// without an answer (or, with status set, answered with that status).
type gate struct {
	down   atomic.Bool
	status atomic.Int32
	next   http.Handler
}

func (g *gate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !g.down.Load() {
		g.next.ServeHTTP(w, r)
		return
	}
	if s := g.status.Load(); s != 0 {
		w.WriteHeader(int(s))
		return
	}
	conn, _, err := http.NewResponseController(w).Hijack()
	if err == nil {
		_ = conn.Close()
	}
}

func newGate(t *testing.T) (*gate, *stripesim.Server, string) {
	t.Helper()
	sim := stripesim.New(stripesim.Options{Seed: 7})
	g := &gate{next: sim.Handler()}
	srv := httptest.NewServer(g)
	t.Cleanup(func() { sim.Close(); srv.Close() })
	return g, sim, srv.URL
}

// stalledSeries reads tally_export_stalled by reason.
func stalledSeries(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "tally_export_stalled" {
			continue
		}
		for _, m := range mf.GetMetric() {
			out[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
		}
	}
	return out
}

// Each of this node's reasons, and its way back: Stall names it, Ready
// fails on it, content-free.
func TestStallReasonsOfThisNode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	g, sim, base := newGate(t)

	none, err := exporter.NewResolver(exporter.Settings{})
	require.NoError(t, err)
	require.Equal(t, exporter.StallNoKey, none.Stall())
	require.ErrorIs(t, none.Ready(ctx), exporter.ErrNoKey)

	refused, err := exporter.NewResolver(exporter.Settings{Key: "sk_test_wrong", APIBase: base})
	require.NoError(t, err)
	_, err = refused.Resolve(ctx)
	require.ErrorContains(t, err, "401")
	require.Equal(t, exporter.StallKeyRefused, refused.Stall(), "the account lookup refused the key")
	require.Error(t, refused.Ready(ctx))

	g.down.Store(true)
	lookup, err := exporter.NewResolver(exporter.Settings{Key: stripesim.DefaultKey, APIBase: base})
	require.NoError(t, err)
	_, err = lookup.Resolve(ctx)
	require.Error(t, err)
	require.Equal(t, exporter.StallStripeUnreachable, lookup.Stall(), "the account lookup got no answer")
	require.Error(t, lookup.Ready(ctx))

	// Resolved without a call (STRIPE_ACCOUNT); then Stripe goes away.
	g.down.Store(false)
	res, err := exporter.NewResolver(exporter.Settings{Key: stripesim.DefaultKey, APIBase: base, Account: stripesim.DefaultAccount})
	require.NoError(t, err)
	_, err = res.Resolve(ctx)
	require.NoError(t, err)
	require.Equal(t, exporter.StallReason(""), res.Stall())
	require.NoError(t, res.Ready(ctx))
	call := func() {
		t.Helper()
		_, _ = res.Client().Meters(ctx)
	}
	g.down.Store(true)
	for i := 1; i < exporter.UnreachableAfter; i++ {
		call()
	}
	require.Equal(t, exporter.StallReason(""), res.Stall(), "a call or two without an answer is no stall")
	g.status.Store(http.StatusServiceUnavailable)
	call()
	require.Equal(t, exporter.StallStripeUnreachable, res.Stall(), "no answer, or a 5xx, calls in a row")
	require.ErrorContains(t, res.Ready(ctx), "Stripe has not answered")
	g.down.Store(false)
	call()
	require.Equal(t, exporter.StallReason(""), res.Stall(), "one answer and export resumes")
	require.NoError(t, res.Ready(ctx))

	require.True(t, res.KeyRefused(http.StatusUnauthorized))
	require.Equal(t, exporter.StallKeyRefused, res.Stall(), "a delivery's 401")
	require.True(t, res.KeyWorks())
	require.Equal(t, exporter.StallReason(""), res.Stall())
	require.NotEmpty(t, sim.Requests())

	for _, r := range exporter.StallReasons() {
		require.NotEqual(t, string(r), r.Explain(), "%s is explained", r)
	}
}

// The acceptance scenario: Stripe becomes unreachable under a running
// deliverer. tally_export_stalled{reason="stripe_unreachable"} turns 1
// after a few failed calls and retrying once an item has failed for the
// configured time; both clear once Stripe answers again and the outbox
// drains. Without a key, no_key is 1. The alert's minutes are
// alerts_test.yml's.
func TestStripeUnreachableStallsExport(t *testing.T) {
	t.Parallel()
	g, sim, base := newGate(t)
	env := stagetest.New(t, outbox.Config{BackoffBase: 20 * time.Millisecond, BackoffCap: 100 * time.Millisecond})
	res, err := exporter.NewResolver(exporter.Settings{Key: stripesim.DefaultKey, APIBase: base})
	require.NoError(t, err)
	d, err := res.Resolve(env.Ctx)
	require.NoError(t, err)
	env.Target.Account, env.Target.Mode = d.Account, d.Mode
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
	env.Feature(t, "logins", mappings.Count, time.Hour)
	env.Tenant(t, "t0", nil)
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_t0")

	const retryingAfter = 500 * time.Millisecond
	reg := prometheus.NewRegistry()
	reg.MustRegister(exporter.NewStalls(res, env.Outbox, env.Pool, retryingAfter))
	require.Equal(t, map[string]float64{"no_key": 0, "key_refused": 0, "stripe_unreachable": 0, "retrying": 0, "account_refused": 0, "meter_deactivated": 0}, stalledSeries(t, reg))

	rg := &rig{Env: env, sim: sim, resolver: res, base: base}
	stop := rg.run(t, time.Second)
	defer stop()
	g.down.Store(true)
	env.MustIngest(t, stagetest.Ev("e1", "t0", "logins", 1, nil), stagetest.Ev("e2", "t0", "logins", 1, nil))

	require.Eventually(t, func() bool { return stalledSeries(t, reg)["stripe_unreachable"] == 1 }, 20*time.Second, 20*time.Millisecond,
		"Stripe unreachable is a stall within seconds")
	require.Error(t, res.Ready(env.Ctx), "and /readyz fails")
	require.Eventually(t, func() bool { return stalledSeries(t, reg)["retrying"] == 1 }, 20*time.Second, 20*time.Millisecond,
		"items failing for the configured time are sustained retries")

	g.down.Store(false)
	rg.waitDrained(t)
	require.Equal(t, map[string]float64{"no_key": 0, "key_refused": 0, "stripe_unreachable": 0, "retrying": 0, "account_refused": 0, "meter_deactivated": 0}, stalledSeries(t, reg),
		"export resumed")

	none, err := exporter.NewResolver(exporter.Settings{})
	require.NoError(t, err)
	reg = prometheus.NewRegistry()
	reg.MustRegister(exporter.NewStalls(none, env.Outbox, env.Pool, 0))
	require.Equal(t, map[string]float64{"no_key": 1, "key_refused": 0, "stripe_unreachable": 0, "retrying": 0, "account_refused": 0, "meter_deactivated": 0}, stalledSeries(t, reg))
}
