package exporter_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/syncbuf"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

func TestMain(m *testing.M) { testdb.Main(m) }

type rig struct {
	*stagetest.Env
	sim      *stripesim.Server
	resolver *exporter.Resolver
	base     string // the simulator's URL
}

// newRig is a staging path addressed to the simulator's account, with
// meters and customers for features api (sum) and logins (count) and
// tenants t0..t9.
func newRig(t *testing.T, cfg outbox.Config, opts ...func(*stripesim.Options)) *rig {
	t.Helper()
	o := stripesim.Options{Seed: 7}
	for _, f := range opts {
		f(&o)
	}
	sim := stripesim.New(o)
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	env := stagetest.New(t, cfg)
	res, err := exporter.NewResolver(exporter.Settings{Key: stripesim.DefaultKey, APIBase: srv.URL, MeterEventsBase: srv.URL})
	require.NoError(t, err)
	d, err := res.Resolve(context.Background())
	require.NoError(t, err)
	env.Target.Account, env.Target.Mode = d.Account, d.Mode
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "api", EventName: "api", Formula: "sum"})
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
	env.Feature(t, "api", mappings.Sum, time.Hour)
	env.Feature(t, "logins", mappings.Count, time.Hour)
	for i := 0; i < 10; i++ {
		name := fmt.Sprintf("t%d", i)
		env.Tenant(t, name, nil)
		sim.CreateCustomer(stripesim.DefaultAccount, "cus_"+name)
	}
	return &rig{Env: env, sim: sim, resolver: res, base: srv.URL}
}

// run runs a deliverer, and the outbox's maintenance as tally serve does,
// until stop is called; stop waits for them to return.
func (r *rig) run(t *testing.T, timeout time.Duration) (stop func()) {
	t.Helper()
	client := r.resolver.Client()
	d, err := exporter.NewDeliverer(exporter.DelivererConfig{Workers: 3, Batch: 20, InFlight: 16, PollInterval: 50 * time.Millisecond},
		r.Outbox, r.Pool, exporter.NewStripeV1(client, timeout), timeout, r.resolver.Destination, exporter.NewLimiter(5000), nil, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = d.Run(ctx) }()
	go func() { defer wg.Done(); _ = r.Outbox.RunMaintenance(ctx, r.Pool, 50*time.Millisecond, slog.Default()) }()
	return func() { cancel(); wg.Wait() }
}

func (r *rig) counts(t *testing.T) map[outbox.State]int64 {
	t.Helper()
	g, err := r.Outbox.ReadGauge(r.Ctx, r.Pool)
	require.NoError(t, err)
	return g.Counts
}

func (r *rig) waitDrained(t *testing.T) map[outbox.State]int64 {
	t.Helper()
	var c map[outbox.State]int64
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		c = r.counts(t)
		if c[outbox.StatePending]+c[outbox.StateLeased] == 0 {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("the outbox never drained: %v\n%s", c, r.attempts(t))
		}
	}
}

// attempts describes the attempt log, for a failure message.
func (r *rig) attempts(t *testing.T) string {
	t.Helper()
	rows, err := r.Pool.Query(r.Ctx, `SELECT item_id, lease_token, outcome, state_after, refused, coalesce(error_code, ''),
		to_char(leased_at, 'HH24:MI:SS.MS'), to_char(recorded_at, 'HH24:MI:SS.MS') FROM outbox_attempts ORDER BY item_id, lease_token`)
	require.NoError(t, err)
	var b strings.Builder
	for rows.Next() {
		var id, token int64
		var outcome, after, code, leased, recorded string
		var refused bool
		require.NoError(t, rows.Scan(&id, &token, &outcome, &after, &refused, &code, &leased, &recorded))
		fmt.Fprintf(&b, "item %d lease %d: %s -> %s refused=%v %s leased %s recorded %s\n", id, token, outcome, after, refused, code, leased, recorded)
	}
	require.NoError(t, rows.Err())
	var state, next string
	_ = r.Pool.QueryRow(r.Ctx, `SELECT state || ' attempts=' || attempts || ' first=' || coalesce(to_char(first_attempt_at, 'HH24:MI:SS.MS'), '-'),
		to_char(next_attempt_at, 'HH24:MI:SS.MS') || ' now=' || to_char(clock_timestamp(), 'HH24:MI:SS.MS') FROM outbox_items ORDER BY id DESC LIMIT 1`).Scan(&state, &next)
	fmt.Fprintf(&b, "last item: %s next=%s; %d calls to the simulator", state, next, len(r.sim.Requests()))
	return b.String()
}

func TestDeliverAcceptsAndMatchesTheLedger(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{BackoffBase: 10 * time.Millisecond, BackoffCap: 50 * time.Millisecond, RateLimitDelay: 20 * time.Millisecond, Lease: 10 * time.Second})
	r.sim.ConfigureDefault(stripesim.Limits{OneCallPerCustomerMeter: true, Faults: stripesim.Faults{
		FailBeforeRecord: 0.1, LoseReply: 0.1, RateLimitFault: 0.05, Latency: time.Millisecond, LatencyJitter: 3 * time.Millisecond}})
	stop := r.run(t, 2*time.Second)
	defer stop()

	sums := map[string]int64{}
	counts := map[string]int{}
	for i := 0; i < 400; i++ {
		tenant := fmt.Sprintf("t%d", i%10)
		r.MustIngest(t,
			stagetest.Ev(fmt.Sprintf("a%d", i), tenant, "api", int64(i%7), stagetest.Ago(2*time.Hour+time.Duration(i)*time.Second)),
			stagetest.Ev(fmt.Sprintf("l%d", i), tenant, "logins", 1, nil))
		sums[tenant] += int64(i % 7)
		counts[tenant]++
	}
	r.Pass(t)
	c := r.waitDrained(t)
	require.Zero(t, c[outbox.StateUncertain]+c[outbox.StateRejected]+c[outbox.StateQuarantined], "%v", c)
	for tenant, want := range sums {
		sum, _, _ := r.sim.Aggregate(stripesim.DefaultAccount, "api", "cus_"+tenant)
		require.Equal(t, want, sum, tenant)
		_, n, _ := r.sim.Aggregate(stripesim.DefaultAccount, "logins", "cus_"+tenant)
		require.Equal(t, counts[tenant], n, tenant)
	}
	require.Empty(t, r.sim.RecordedTwice())
	require.LessOrEqual(t, r.sim.MaxConcurrentPerKey(), 1, "never two calls in flight for one customer and meter: %v", r.sim.Overlaps())
}

// Past the attempt cap an item is uncertain and is not sent again: here
// every reply is lost, so Stripe has the event but Tally cannot know.
func TestCapEndsUncertainAndSendsNoMore(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{MaxAttempts: 3, BackoffBase: 10 * time.Millisecond, BackoffCap: 10 * time.Millisecond, Lease: 5 * time.Second})
	r.sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{LoseReply: 1}})
	stop := r.run(t, time.Second)
	defer stop()
	r.MustIngest(t, stagetest.Ev("l1", "t1", "logins", 1, nil))
	c := r.waitDrained(t)
	require.Equal(t, int64(1), c[outbox.StateUncertain])
	calls := len(r.sim.Requests())
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, calls, len(r.sim.Requests()), "an uncertain item is never sent again automatically")
	require.Len(t, r.sim.Events(stripesim.DefaultAccount), 1, "recorded once, for all the lost replies")
	require.Empty(t, r.sim.RecordedTwice())
}

// Past the horizon (here two seconds, measured by the database clock) an
// item that may have reached Stripe is uncertain and is not sent again:
// either the retry that would fall past it records uncertain (T3), or the
// retry fell due just inside it, no claim took it in time, and the sweep
// (T4) found it past the horizon — claims never take such an item.
func TestHorizonEndsUncertainAndSendsNoMore(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{Horizon: 2 * time.Second, Lease: time.Second, MaxAttempts: 1000,
		BackoffBase: 100 * time.Millisecond, BackoffCap: 100 * time.Millisecond})
	r.sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{FailBeforeRecord: 1}})
	// A short request timeout so that a send ends well inside the lease.
	stop := r.run(t, 200*time.Millisecond)
	defer stop()
	r.MustIngest(t, stagetest.Ev("l1", "t1", "logins", 1, nil))
	c := r.waitDrained(t)
	require.Equal(t, int64(1), c[outbox.StateUncertain])
	var code string
	require.NoError(t, r.Pool.QueryRow(r.Ctx, "SELECT last_error_code FROM outbox_items").Scan(&code))
	require.Contains(t, []string{"stripe_5xx", "horizon"}, code)
	calls := len(r.sim.Requests())
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, calls, len(r.sim.Requests()))
}

// Claim-time checks (T6): an item staged for another account or mode is
// quarantined without a call to Stripe.
func TestClaimTimeChecks(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.Target.Account = "acct_other"
	r.MustIngest(t, stagetest.Ev("l1", "t1", "logins", 1, nil))
	r.Target.Mode = outbox.ModeLive
	r.Target.Account = stripesim.DefaultAccount
	r.MustIngest(t, stagetest.Ev("l2", "t1", "logins", 1, nil))
	stop := r.run(t, time.Second)
	defer stop()
	r.waitDrained(t)
	rows, err := r.Pool.Query(r.Ctx, "SELECT quarantine_reason FROM outbox_items ORDER BY id")
	require.NoError(t, err)
	var reasons []string
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		reasons = append(reasons, s)
	}
	require.Equal(t, []string{"account_mismatch", "mode_mismatch"}, reasons)
	require.Empty(t, r.sim.Events(stripesim.DefaultAccount))
}

// A shutdown lets the sends in flight finish and records their outcomes.
// The ten items are staged together, so that one claim leases them all and
// they wait on Stripe at once, for a second: long enough to be seen leased
// on a loaded machine.
func TestShutdownRecordsInFlightSends(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{Lease: 10 * time.Second})
	r.sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{Latency: time.Second}})
	stop := r.run(t, 2*time.Second)
	defer stop()
	evs := make([]meter.Event, 10)
	for i := range evs {
		evs[i] = stagetest.Ev(fmt.Sprintf("l%d", i), fmt.Sprintf("t%d", i), "logins", 1, nil)
	}
	r.MustIngest(t, evs...)
	require.Eventually(t, func() bool { return r.counts(t)[outbox.StateLeased] == 10 }, 5*time.Second, 5*time.Millisecond)
	stop() // while the sends wait on Stripe
	c := r.counts(t)
	require.Equal(t, int64(10), c[outbox.StateAccepted], "%v", c)
}

// A shutdown that comes while a claim is at the database lets the claim
// answer and sends what it leased. Cut short, the claim commits at the
// server unheard: its items wait leased, unsent, until their leases
// expire, and the attempt that never went out counts as one that may have
// reached Stripe. A table lock holds the claim at the database here, after
// its transaction began: the deliverer's one connection has run the
// claim's statements once already, so that none waits to be prepared.
func TestShutdownLetsAClaimInFlightSend(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{Lease: 10 * time.Second})
	cfg := r.Pool.Config()
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(r.Ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	exp := exporter.NewStripeV1(r.resolver.Client(), 2*time.Second)
	past, future := exp.Accepts()
	leases, err := r.Outbox.Claim(r.Ctx, pool, outbox.ClaimOptions{Owner: "warm", Limit: 10, AcceptPast: past, AcceptFuture: future,
		Exporter: exp.Name()})
	require.NoError(t, err)
	require.Empty(t, leases)

	evs := make([]meter.Event, 10)
	for i := range evs {
		evs[i] = stagetest.Ev(fmt.Sprintf("l%d", i), fmt.Sprintf("t%d", i), "logins", 1, nil)
	}
	r.MustIngest(t, evs...)
	lock, err := r.Pool.Begin(r.Ctx)
	require.NoError(t, err)
	defer func() { _ = lock.Rollback(r.Ctx) }()
	_, err = lock.Exec(r.Ctx, `LOCK TABLE outbox_item_states IN EXCLUSIVE MODE`)
	require.NoError(t, err)

	d, err := exporter.NewDeliverer(exporter.DelivererConfig{Workers: 1, PollInterval: 50 * time.Millisecond}, r.Outbox, pool,
		exp, 2*time.Second, r.resolver.Destination, exporter.NewLimiter(5000), nil, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	defer func() { cancel(); <-done }()
	require.Eventually(t, func() bool {
		var waiting bool
		require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND datname = current_database() AND state = 'active')`).Scan(&waiting))
		return waiting
	}, 10*time.Second, 5*time.Millisecond, "the claim waits for the lock")
	cancel() // the shutdown, while the claim waits
	select { // a claim cut short ends Run at once
	case <-done:
	case <-time.After(200 * time.Millisecond):
	}
	require.NoError(t, lock.Rollback(r.Ctx))
	<-done
	require.Eventually(t, func() bool {
		var busy bool
		require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE state = 'active' AND datname = current_database() AND pid <> pg_backend_pid())`).Scan(&busy))
		return !busy
	}, 10*time.Second, 5*time.Millisecond, "the claim ends at the database")
	c := r.counts(t)
	require.Zero(t, c[outbox.StateLeased], "leased and never sent: %v", c)
	require.Equal(t, int64(10), c[outbox.StateAccepted], "%v", c)
	require.Len(t, r.sim.Events(stripesim.DefaultAccount), 10)
}

// Without a destination (no key) the deliverer sends nothing: items stay
// pending.
func TestStalledDeliverSendsNothing(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.MustIngest(t, stagetest.Ev("l1", "t1", "logins", 1, nil))
	d, err := exporter.NewDeliverer(exporter.DelivererConfig{PollInterval: 20 * time.Millisecond}, r.Outbox, r.Pool,
		exporter.NewStripeV1(r.resolver.Client(), time.Second), time.Second,
		func() (exporter.Destination, error) { return exporter.Destination{}, exporter.ErrNoKey }, exporter.NewLimiter(100), nil, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	require.NoError(t, d.Run(ctx))
	require.Equal(t, int64(1), r.counts(t)[outbox.StatePending])
	require.Empty(t, r.sim.Events(stripesim.DefaultAccount))
	for _, req := range r.sim.Requests() {
		require.NotEqual(t, "/v1/billing/meter_events", req.Path)
	}
}

// A key Stripe stops accepting (rolled, deleted) stalls export visibly:
// items stay pending — a 401 is the key's fault, not the item's — the
// resolver's readiness check says why, and the first accepted delivery
// after the key works again clears it.
func TestRefusedKeyStallsVisibly(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{BackoffBase: 20 * time.Millisecond, BackoffCap: 50 * time.Millisecond, Lease: 10 * time.Second})
	// A key long enough that Stripe's 401 shows its last four characters.
	const key = "sk_test_51TallyRefusedKeyTail9Zq"
	r.sim.AddKey(key, stripesim.DefaultAccount)
	res, err := exporter.NewResolver(exporter.Settings{Key: key, APIBase: r.base})
	require.NoError(t, err)
	_, err = res.Resolve(r.Ctx)
	require.NoError(t, err)
	var logs syncbuf.Buffer
	d, err := exporter.NewDeliverer(exporter.DelivererConfig{Workers: 2, Batch: 10, InFlight: 8, PollInterval: 20 * time.Millisecond, Keys: res},
		r.Outbox, r.Pool, exporter.NewStripeV1(res.Client(), time.Second), time.Second, res.Destination,
		exporter.NewLimiter(1000), slog.New(slog.NewTextHandler(&logs, nil)), nil)
	require.NoError(t, err)
	require.NoError(t, res.Check(r.Ctx))

	r.sim.RevokeKey(key)
	r.MustIngest(t, stagetest.Ev("l1", "t1", "logins", 1, nil), stagetest.Ev("l2", "t2", "logins", 1, nil))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	defer func() { cancel(); <-done }()

	require.Eventually(t, func() bool { return res.Check(r.Ctx) != nil }, 10*time.Second, 10*time.Millisecond)
	require.EqualError(t, res.Check(r.Ctx), "export stalled: Stripe refused the API key, or its access to the destination account (status 401)")
	var refused int
	require.Eventually(t, func() bool {
		require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM outbox_attempts WHERE error_code = 'stripe_auth' AND refused`).Scan(&refused))
		return refused >= 4
	}, 10*time.Second, 10*time.Millisecond)
	c := r.counts(t)
	require.Equal(t, int64(2), c[outbox.StatePending]+c[outbox.StateLeased], "%v", c)
	require.Empty(t, r.sim.Events(stripesim.DefaultAccount))
	require.Equal(t, 1, strings.Count(logs.String(), "level=ERROR"), "one error line per stall, not one per call:\n%s", logs.String())
	// Stripe's 401 shows the key masked, its last characters in clear:
	// none of it reaches the database.
	var leaked int
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT (SELECT count(*) FROM outbox_items WHERE last_error ~ '(sk_|9Zq)')
		+ (SELECT count(*) FROM outbox_attempts WHERE error_message ~ '(sk_|9Zq)')`).Scan(&leaked))
	require.Zero(t, leaked)

	r.sim.AddKey(key, stripesim.DefaultAccount)
	require.Eventually(t, func() bool { return r.counts(t)[outbox.StateAccepted] == 2 }, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, res.Check(r.Ctx))
	require.Contains(t, logs.String(), "export resumed")
}

// A limiter slowed to its floor (one call a second) never holds a leased
// item past its lease: the deliverer takes its limiter slots before it
// claims, and a send ends inside its lease. Before, the items of a claim
// queued at the slowed limiter for longer than their leases; another claim
// took them over and sent them while the first sends were still to come —
// two calls in flight for one customer and meter, and each item sent twice.
func TestDeliverNeverSendsPastTheLease(t *testing.T) {
	t.Parallel()
	const items = 6
	r := newRig(t, outbox.Config{BackoffBase: 10 * time.Millisecond, BackoffCap: 50 * time.Millisecond, Lease: 1500 * time.Millisecond})
	r.sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{Latency: time.Millisecond}})
	lim := exporter.NewLimiter(100)
	timeout := 300 * time.Millisecond
	d, err := exporter.NewDeliverer(exporter.DelivererConfig{Workers: 3, Batch: 20, InFlight: 16, PollInterval: 50 * time.Millisecond},
		r.Outbox, r.Pool, exporter.NewStripeV1(r.resolver.Client(), timeout), timeout, r.resolver.Destination, lim, nil, nil)
	require.NoError(t, err)
	for range 10 {
		lim.Slow(time.Now())
	}
	require.Equal(t, 1.0, lim.Rate())
	n, err := lim.Take(context.Background(), 10)
	require.NoError(t, err)
	require.Equal(t, 10, n, "the bucket is empty: calls go out at the slowed rate")

	for i := range items {
		r.MustIngest(t, stagetest.Ev(fmt.Sprintf("l%d", i), fmt.Sprintf("t%d", i), "logins", 1, nil))
	}
	r.Pass(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	defer func() { cancel(); <-done }()
	c := r.waitDrained(t)
	require.Equal(t, int64(items), c[outbox.StateAccepted], "%v", c)

	var abandoned int
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM outbox_attempts WHERE outcome = 'abandoned'`).Scan(&abandoned))
	require.Zero(t, abandoned, "no lease expired while its item waited to be sent:\n%s", r.attempts(t))
	require.LessOrEqual(t, r.sim.MaxConcurrentPerKey(), 1, "never two calls in flight for one customer and meter: %v", r.sim.Overlaps())
	calls := map[string]int{}
	for _, rq := range r.sim.Requests() {
		if rq.Path == "/v1/billing/meter_events" {
			calls[rq.Form.Get("identifier")]++
		}
	}
	require.Len(t, calls, items)
	for id, n := range calls {
		require.Equal(t, 1, n, "each item sent once: %s", id)
	}
}
