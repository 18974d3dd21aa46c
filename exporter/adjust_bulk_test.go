package exporter_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// A bulk cancellation of 2,000 events, in live mode under Stripe's default
// 25 requests a second per endpoint and 100 a second of basic limit, while
// meter events flow and reconcile runs read: every adjustment lands within
// its 24 hours, on the deliverer and the class of its own (20 a second),
// the meter events' rate is never halved and their throughput is measured
// against a phase without cancellations, and no call of the account —
// reconciliation's reads above all — meets the basic limit.
//
// It takes the 100 s that 2,000 adjustments need at 20 a second.
func TestBulkCancellationKeepsToItsClass(t *testing.T) {
	if testing.Short() {
		t.Skip("cancels thousands of events at Stripe's rate: a load test")
	}
	t.Parallel()
	const (
		liveKey    = "sk_live_51SimBulkCancellation"
		cancelled  = 2000
		cancelled0 = 10 // tenants c0..c9 whose events are cancelled
		flowing    = 20 // tenants f0..f19 whose events flow meanwhile
		eventsRate = 100
		baseline   = 5 * time.Second
	)
	ctx := context.Background()
	sim := stripesim.New(stripesim.Options{Seed: 23, Keys: map[string]string{liveKey: stripesim.DefaultAccount}})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count", Livemode: true})
	env := stagetest.New(t, outbox.Config{})
	res, err := exporter.NewResolver(exporter.Settings{Key: liveKey, APIBase: srv.URL, MeterEventsBase: srv.URL,
		Rates: exporter.Rates{Events: eventsRate}})
	require.NoError(t, err)
	dest, err := res.Resolve(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.ModeLive, dest.Mode, "meter events have their own limit in live mode only")
	env.Target.Account, env.Target.Mode = dest.Account, dest.Mode
	env.Feature(t, "logins", mappings.Count, time.Hour)
	for i := range cancelled0 {
		env.Tenant(t, fmt.Sprintf("c%d", i), nil)
		sim.CreateCustomer(stripesim.DefaultAccount, fmt.Sprintf("cus_c%d", i))
	}
	for i := range flowing {
		env.Tenant(t, fmt.Sprintf("f%d", i), nil)
		sim.CreateCustomer(stripesim.DefaultAccount, fmt.Sprintf("cus_f%d", i))
	}

	// The events to cancel, accepted by Stripe before the limits are set.
	at := stagetest.Ago(time.Hour)
	for i := 0; i < cancelled; i += 500 {
		evs := make([]meter.Event, 500)
		for j := range evs {
			evs[j] = stagetest.Ev(fmt.Sprintf("x%d", i+j), fmt.Sprintf("c%d", (i+j)%cancelled0), "logins", 1, at)
		}
		env.MustIngest(t, evs...)
	}
	env.Pass(t)
	deliverDirectly(t, env, exporter.NewStripeV1(res.Client(), 2*time.Second))

	sim.Configure(stripesim.DefaultAccount, stripesim.Limits{BasicRatePerSecond: 100, EndpointRatePerSecond: 25,
		RatePerSecond: 1000, OneCallPerCustomerMeter: true})
	b := res.Budget()
	v1, err := exporter.NewDeliverer(exporter.DelivererConfig{PollInterval: 50 * time.Millisecond}, env.Outbox, env.Pool,
		exporter.NewStripeV1(res.Client(), 2*time.Second).PaceAdjustments(b.Adjust()), 2*time.Second, res.Destination, b.Events(), nil, nil)
	require.NoError(t, err)
	adjust, err := exporter.NewDeliverer(exporter.DelivererConfig{Workers: exporter.DefaultAdjustWorkers, Batch: exporter.DefaultAdjustBatch,
		InFlight: exporter.AdjustInFlight(b.Adjust().Rate()), PollInterval: 50 * time.Millisecond}, env.Outbox, env.Pool,
		exporter.NewStripeAdjustments(res.Client(), 2*time.Second).PaceProbes(b.Adjust()), 2*time.Second, res.Destination, b.Adjust(), nil, nil)
	require.NoError(t, err)
	rec, err := reconcile.New(reconcile.Config{Outbox: env.Outbox, Key: liveKey, APIBase: srv.URL, Destination: res.Destination,
		Limiter: b.Reads(), RetryInitial: 10 * time.Millisecond, RetryMax: time.Second, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)

	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var flowErr atomic.Value
	for _, run := range []func(){
		func() { _ = v1.Run(runCtx) },
		func() { _ = adjust.Run(runCtx) },
		func() { _ = env.Outbox.RunMaintenance(runCtx, env.Pool, 100*time.Millisecond, slog.Default()) },
		func() {
			if err := flow(runCtx, env, flowing, 3*eventsRate); err != nil {
				flowErr.Store(err)
			}
		},
	} {
		wg.Add(1)
		go func() { defer wg.Done(); run() }()
	}
	defer func() { stop(); wg.Wait() }()

	sent := func() int {
		var n int
		require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_item_states
			WHERE exporter = 'stripe_meter_events' AND state IN ('accepted', 'confirmed')`).Scan(&n))
		return n - cancelled
	}
	time.Sleep(time.Second) // the flow settles into its pace
	n0, t0 := sent(), time.Now()
	time.Sleep(baseline)
	before := float64(sent()-n0) / time.Since(t0).Seconds()

	// The bulk cancellation, in four requests.
	n1, t1 := sent(), time.Now()
	for i := 0; i < cancelled; i += 500 {
		cs := make([]meter.Cancellation, 500)
		for j := range cs {
			cs[j] = meter.Cancellation{Tenant: fmt.Sprintf("c%d", (i+j)%cancelled0), ID: fmt.Sprintf("x%d", i+j)}
		}
		require.NoError(t, pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
			out, err := env.Stager.Cancel(ctx, tx, "test", cs)
			for _, c := range out {
				require.Equal(t, meter.CancelAdjustment, c.Outcome)
			}
			return err
		}))
	}
	// Reconcile runs read while the adjustments go out.
	runs := 0
	for open := cancelled; open > 0; {
		run, err := rec.RunNow(ctx, env.Pool, reconcile.TriggerCommand, "test", reconcile.Options{})
		require.NoError(t, err)
		require.Equal(t, "succeeded", run.Status, "%+v", run)
		runs++
		require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_items
			WHERE subject_kind = 'usage_cancellation' AND state IN ('pending', 'leased')`).Scan(&open))
		// A bound on never draining, not a speed check: on CI's two
		// loaded cores the 100 s have taken four minutes.
		require.Less(t, time.Since(t1), 8*time.Minute, "the adjustments never drained")
	}
	during := float64(sent()-n1) / time.Since(t1).Seconds()
	took := time.Since(t1)
	stop()
	wg.Wait()
	if err, _ := flowErr.Load().(error); err != nil {
		t.Fatal(err)
	}
	t.Logf("meter events %.0f/s before, %.0f/s during the cancellation; %d adjustments in %s (%.1f/s); %d reconcile runs",
		before, during, cancelled, took.Round(time.Second), float64(cancelled)/took.Seconds(), runs)

	// Every adjustment on its own exporter, accepted within its 24 hours:
	// accepted still, or confirmed already by a run that read its
	// customer's hour once the last of that customer's cancellations was
	// out (which customers drain before the last run reads them is
	// timing's).
	var (
		adjusted, late int
		states         string
	)
	require.NoError(t, env.Pool.QueryRow(ctx, `SELECT
		count(*) FILTER (WHERE state IN ('accepted', 'confirmed') AND exporter = 'stripe_meter_event_adjustments'),
		count(*) FILTER (WHERE accepted_at IS NULL OR accepted_at > to_timestamp((payload ->> 'cancel_by')::bigint)),
		(SELECT string_agg(concat_ws(' ', n, exporter, state, quarantine_reason, last_error_code), '; ')
			FROM (SELECT count(*) AS n, exporter, state, quarantine_reason, last_error_code FROM outbox_items
				WHERE subject_kind = 'usage_cancellation' GROUP BY 2, 3, 4, 5) s)
		FROM outbox_items WHERE subject_kind = 'usage_cancellation'`).Scan(&adjusted, &late, &states))
	t.Logf("the cancellations: %s", states)
	require.Equal(t, cancelled, adjusted)
	require.Zero(t, late)
	for i := range cancelled0 {
		_, n, _ := sim.Aggregate(stripesim.DefaultAccount, "logins", fmt.Sprintf("cus_c%d", i))
		require.Zero(t, n, "every event cancelled at Stripe")
	}
	// Meter events kept their pace; no call met the basic limit.
	require.Equal(t, float64(eventsRate), b.Events().Rate(), "the meter events' class was never slowed")
	require.Greater(t, during, before/2, "meter-event throughput is not halved")
	for k, n := range sim.RateLimited(stripesim.DefaultAccount) {
		require.NotEqual(t, stripesim.LimiterBasic, k.Limiter, "%d calls to %s met the basic limit", n, k.Endpoint)
		require.NotEqual(t, stripesim.LimiterMeterEvents, k.Limiter, "%d meter events met their limit", n)
	}
	require.LessOrEqual(t, sim.MaxConcurrentPerKey(), 1, "%v", sim.Overlaps())
	require.Positive(t, runs)
}

// deliverDirectly sends every pending item once, one at a time, and
// records the outcomes: the setup of events Stripe has, before any limit.
func deliverDirectly(t *testing.T, env *stagetest.Env, exp *exporter.StripeV1) {
	t.Helper()
	for {
		leases, err := env.Outbox.Claim(env.Ctx, env.Pool, outbox.ClaimOptions{Owner: "setup", Limit: 500, Policy: outbox.BestEffort})
		require.NoError(t, err)
		if len(leases) == 0 {
			return
		}
		outcomes := make([]outbox.Outcome, len(leases))
		for i, l := range leases {
			outcomes[i] = exp.Send(env.Ctx, l)
			outcomes[i].Lease = l
			require.Equal(t, outbox.Accepted, outcomes[i].Kind, "%+v", outcomes[i])
		}
		_, err = env.Outbox.Record(env.Ctx, env.Pool, outcomes)
		require.NoError(t, err)
	}
}

// flow keeps meter events of tenants f0..f<tenants-1> pending ahead of the
// deliverer — at least backlog at each look, ten times a second — until
// ctx ends, so that the meter events' class, not the supply, bounds their
// throughput. It returns the first failure before ctx ended.
func flow(ctx context.Context, env *stagetest.Env, tenants, backlog int) error {
	if err := feed(ctx, env, tenants, backlog); ctx.Err() == nil {
		return err
	}
	return nil
}

func feed(ctx context.Context, env *stagetest.Env, tenants, backlog int) error {
	n := 0
	for ctx.Err() == nil {
		var pending int
		if err := env.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_item_states
			WHERE exporter = 'stripe_meter_events' AND state = 'pending'`).Scan(&pending); err != nil {
			return err
		}
		if more := backlog - pending; more > 0 {
			evs := make([]meter.Event, more)
			for i := range evs {
				evs[i] = stagetest.Ev(fmt.Sprintf("f-%d", n), fmt.Sprintf("f%d", n%tenants), "logins", 1, nil)
				n++
			}
			if err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
				_, err := env.Ingester.Ingest(ctx, tx, evs)
				return err
			}); err != nil {
				return err
			}
			if _, err := env.Stager.Pass(ctx, env.Pool); err != nil {
				return err
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}
