package exporter_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/outbox"
)

// An hour of Stripe answering 30% of one customer's calls 429 lock_timeout
// leaves no item uncertain: every lock timeout is a refused attempt
// ("Stripe doesn't process these failed requests"), so the horizon never
// binds the item, and the limiter is never halved.
//
// The outbox's backoff is the default's at a thousandth (5 ms to 900 ms),
// so the hour of retries runs in 3.6 s: an hour of the default backoff
// (5 s doubling to 900 s) makes 11 attempts, at 0, 5, 15, 35, 75, 155, 315,
// 635, 1,275, 2,175 and 3,075 s. The contended customer's events arrive
// in waves through that hour, a backlog first, while the other tenants'
// flow. The horizon is 0.7 s, so it passes during the test for the items
// that met lock timeouts and waited behind their key: counting such an
// attempt as one that may have reached Stripe, as Tally did, would have
// made each of them uncertain (the claim and the sweep refuse an item past
// the horizon once an attempt may have reached Stripe); the test counts
// them.
func TestLockTimeoutsForAnHourLeaveNothingUncertain(t *testing.T) {
	t.Parallel()
	const (
		hour    = 3600 * time.Millisecond // an hour of the default backoff at a thousandth
		horizon = 700 * time.Millisecond
		waves   = 6
		perWave = 24
	)
	r := newRig(t, outbox.Config{BackoffBase: 5 * time.Millisecond, BackoffCap: 900 * time.Millisecond,
		RateLimitDelay: 30 * time.Millisecond, Lease: 650 * time.Millisecond, Horizon: horizon})
	r.sim.ConfigureDefault(stripesim.Limits{OneCallPerCustomerMeter: true,
		Faults: stripesim.Faults{LockTimeouts: map[string]float64{"cus_t0": 0.3}}})
	limiter := exporter.NewLimiter(5000)
	client := r.resolver.Client()
	d, err := exporter.NewDeliverer(exporter.DelivererConfig{Workers: 3, Batch: 20, InFlight: 16,
		PollInterval: 10 * time.Millisecond, FlushEvery: 5 * time.Millisecond},
		r.Outbox, r.Pool, exporter.NewStripeV1(client, 300*time.Millisecond), 300*time.Millisecond, r.resolver.Destination, limiter, nil, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = d.Run(ctx) }()
	go func() { defer wg.Done(); _ = r.Outbox.RunMaintenance(ctx, r.Pool, 20*time.Millisecond, slog.Default()) }()
	defer func() { cancel(); wg.Wait() }()

	start := time.Now()
	counts := map[string]int{}
	for w := range waves {
		n := perWave
		if w == 0 {
			n = 8 * perWave // a backlog of the contended key: retries wait behind it
		}
		for i := range n {
			tenant := "t0"
			if i%4 == 3 {
				tenant = fmt.Sprintf("t%d", 1+i%5)
			}
			r.MustIngest(t, stagetest.Ev(fmt.Sprintf("w%d-%d", w, i), tenant, "logins", 1, nil))
			counts[tenant]++
		}
		r.Pass(t)
		time.Sleep(hour / waves)
	}
	c := r.waitDrained(t)
	require.GreaterOrEqual(t, time.Since(start), hour, "the contention lasted the hour")

	// A call cut by the request timeout, or still in flight when its
	// lease ran out (abandoned), which a loaded machine can reach, may
	// have reached Stripe, and past the horizon its item is rightly
	// uncertain. No item is uncertain without one.
	cut := map[string]int{}
	rows, err := r.Pool.Query(r.Ctx, `SELECT o.tenant_key FROM outbox_items o WHERE o.state = 'uncertain'
		AND EXISTS (SELECT 1 FROM outbox_attempts a WHERE a.item_id = o.id AND NOT a.refused
		            AND (a.error_code = 'timeout' OR a.outcome = 'abandoned'))`)
	require.NoError(t, err)
	tenants, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	for _, tenant := range tenants {
		cut[tenant]++
	}
	if len(tenants) > 0 {
		t.Logf("%d items uncertain after a call cut by the request timeout or its lease", len(tenants))
	}
	require.Equal(t, int64(len(tenants)), c[outbox.StateUncertain], "no item uncertain but after a cut call: %v\n%s", c, r.attempts(t))
	require.Equal(t, int64((waves+7)*perWave-len(tenants)), c[outbox.StateAccepted], "%v", c)
	for tenant, n := range counts {
		_, got, _ := r.sim.Aggregate(stripesim.DefaultAccount, "logins", "cus_"+tenant)
		require.LessOrEqual(t, got, n, tenant)
		require.GreaterOrEqual(t, got, n-cut[tenant], tenant)
	}
	require.Empty(t, r.sim.RecordedTwice())
	require.LessOrEqual(t, r.sim.MaxConcurrentPerKey(), 1, "%v", r.sim.Overlaps())
	require.Positive(t, r.sim.LockTimeouts(stripesim.DefaultAccount))
	require.Equal(t, 5000.0, limiter.Rate(), "lock timeouts slow no limiter")

	// Every lock timeout is logged as a refused retry; and some items met
	// one and were sent again past their horizon, which would have made
	// them uncertain had a lock timeout counted as possibly processed.
	var notRefused, pastHorizon int
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FILTER (WHERE a.error_code = 'lock_timeout' AND NOT a.refused)
		FROM outbox_attempts a`).Scan(&notRefused))
	require.Zero(t, notRefused)
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(DISTINCT o.id) FROM outbox_items o
		JOIN outbox_attempts a ON a.item_id = o.id
		WHERE a.leased_at > o.first_attempt_at + @horizon::interval
		  AND EXISTS (SELECT 1 FROM outbox_attempts l WHERE l.item_id = o.id AND l.error_code = 'lock_timeout')`,
		pgx.NamedArgs{"horizon": horizon}).Scan(&pastHorizon))
	t.Logf("%d lock timeouts; %d items sent again past their horizon after one", r.sim.LockTimeouts(stripesim.DefaultAccount), pastHorizon)
	require.Positive(t, pastHorizon, "the horizon passed during the test for items that met lock timeouts")
}
