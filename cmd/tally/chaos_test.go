package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/embeddedpg"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/quarantine"
)

// TestChaos is issue 7's harness: three `tally serve` nodes on one
// PostgreSQL, the simulator with every fault (5xx before and after
// recording, lost replies, 429s, latency, hung calls), nodes SIGKILLed and
// restarted at random, PostgreSQL itself restarted mid-run, leases short
// enough to expire under load, and usage posted throughout — late events,
// corrections and duplicates among it. At the end: conservation for every
// tenant, feature and period; the simulator's aggregate for every
// (customer, meter) equals the ledger's; no identifier recorded twice;
// never two calls in flight for one customer and meter; and a reconcile
// run confirms everything from Stripe's own numbers.
//
// TALLY_CHAOS_DURATION sets how long the chaos lasts (default 20s, the CI
// run); docs/reliability.md records long runs.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos is not short")
	}
	t.Parallel()
	newChaosRun(t).run()
}

// run is the chaos and its end checks.
func (r *chaosRun) run() {
	r.startPostgres()
	r.startSimulator()
	r.startNodes()
	r.mapFeaturesAndTenants()
	r.startPoster()
	r.unleash()
	r.stopPoster()

	r.openPool()
	r.waitDrained()
	ledger := r.checkLedger()
	r.checkFaultsAndRoutes(ledger)
	r.checkConservation()
	r.checkLeases()
	r.checkReconcile()
}

const (
	chaosTenants = 20
	chaosAdmin   = "chaos-admin-token-0123456789abcdef"
)

// chaosFeature is a feature of the chaos run: its meter's formula and the
// exporter its mapping names (empty: the default, v1).
type chaosFeature struct{ name, formula, exporter string }

// chaosRun is one run of TestChaos: the PostgreSQL it restarts, the
// simulator, the nodes it kills, and the usage posted to them throughout.
type chaosRun struct {
	t        *testing.T
	ctx      context.Context
	duration time.Duration // how long the chaos lasts
	rng      *rand.Rand    // through intN and uint64: the poster, the killer and the restarts draw from it at once
	rngMu    sync.Mutex
	features []chaosFeature

	dataDir string
	port    int
	pgMu    sync.Mutex // held while Postgres is stopped or started
	pg      *embeddedpg.Cluster
	url     string
	// citus runs the database as a Citus coordinator with two workers,
	// Tally's tables distributed: a worker is restarted and a shard group
	// moved mid-run instead of Postgres restarted (chaos_citus_test.go).
	citus bool
	moved string // the shard move, for the log

	sim     *stripesim.Server
	simURL  string
	nodes   []*node
	nodesMu sync.Mutex // held while a node restarts or Postgres is down

	// The poster's state: what it posted, and the channel that stops it.
	now     time.Time
	posted  atomic.Int64
	seq     atomic.Int64
	stopped chan struct{}
	wg      sync.WaitGroup
	sentMu  sync.Mutex
	sent    [][]e2eEvent

	kills, restarts int
	pool            *pgxpool.Pool
}

func newChaosRun(t *testing.T) *chaosRun {
	t.Helper()
	duration := 20 * time.Second
	if s := os.Getenv("TALLY_CHAOS_DURATION"); s != "" {
		d, err := time.ParseDuration(s)
		require.NoError(t, err)
		duration = d
	}
	return &chaosRun{
		t:        t,
		ctx:      context.Background(),
		duration: duration,
		rng:      rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7)),
		// logins, the per-event feature, goes through the v2 stream (its
		// mapping names the exporter); the others through v1: both
		// deliverers of every node work the same outbox.
		features: []chaosFeature{{"api_calls", "sum", ""}, {"seats", "last", ""},
			{"logins", "count", "stripe_meter_event_stream"}},
		stopped: make(chan struct{}),
	}
}

// pgConfig is the configuration PostgreSQL starts and restarts with.
func (r *chaosRun) pgConfig() embeddedpg.Config {
	cfg := embeddedpg.Config{DataDir: r.dataDir, Port: r.port,
		Settings: map[string]string{"fsync": "off", "synchronous_commit": "off", "max_connections": "300"}}
	if r.citus {
		bin, err := embeddedpg.FindCitus()
		require.NoError(r.t, err)
		cfg.BinDir, cfg.Workers = bin, 2
		cfg.Settings["max_prepared_transactions"] = "300"
	}
	return cfg
}

// startPostgres starts a PostgreSQL of the run's own, on a fixed port, so
// that it can be restarted under the nodes.
func (r *chaosRun) startPostgres() {
	r.t.Helper()
	dataDir, err := os.MkdirTemp("", "tally-chaos-")
	require.NoError(r.t, err)
	r.t.Cleanup(func() { _ = os.RemoveAll(dataDir) })
	r.dataDir = dataDir
	r.port = freePort(r.t)
	r.pg, err = embeddedpg.Start(r.ctx, r.pgConfig())
	require.NoError(r.t, err)
	r.t.Cleanup(func() { r.pgMu.Lock(); defer r.pgMu.Unlock(); _ = r.pg.Stop(context.Background()) })
	r.url = r.pg.URL("postgres")
	if r.citus {
		require.NoError(r.t, r.pg.EnsureDatabase(r.ctx, "tally"))
		r.url = r.pg.URL("tally")
		code, out, errs := tally(r.t, r.url, "migrate", "--distribute")
		require.Equal(r.t, 0, code, errs)
		r.t.Logf("chaos: %s", strings.TrimSpace(out))
	}
}

// restartPostgres stops PostgreSQL under the nodes and starts it again
// after a pause; no node restarts meanwhile.
func (r *chaosRun) restartPostgres() {
	r.t.Helper()
	r.nodesMu.Lock()
	r.pgMu.Lock()
	require.NoError(r.t, r.pg.Stop(r.ctx))
	time.Sleep(time.Duration(500+r.intN(1500)) * time.Millisecond)
	var err error
	r.pg, err = embeddedpg.Start(r.ctx, r.pgConfig())
	r.pgMu.Unlock()
	require.NoError(r.t, err)
	r.nodesMu.Unlock()
	r.restarts++
}

// startSimulator starts the simulator with every fault, one meter per
// feature and one customer per tenant.
func (r *chaosRun) startSimulator() {
	r.t.Helper()
	r.sim = stripesim.New(stripesim.Options{Seed: r.uint64(), Limits: stripesim.Limits{
		OneCallPerCustomerMeter: true,
		Faults: stripesim.Faults{FailBeforeRecord: 0.08, FailAfterRecord: 0.04, LoseReply: 0.05, RateLimitFault: 0.05, Hang: 0.005,
			Latency: time.Millisecond, LatencyJitter: 15 * time.Millisecond},
	}})
	srv := httptest.NewServer(r.sim.Handler())
	r.t.Cleanup(func() { r.sim.Close(); srv.Close() })
	r.simURL = srv.URL
	for _, f := range r.features {
		r.sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: f.name, EventName: f.name, Formula: f.formula})
	}
	for i := 0; i < chaosTenants; i++ {
		r.sim.CreateCustomer(stripesim.DefaultAccount, fmt.Sprintf("cus_c%02d", i))
	}
}

// startNodes starts three nodes on the one PostgreSQL, with leases short
// enough to expire under load (longer on Citus: loadPasses).
func (r *chaosRun) startNodes() {
	r.t.Helper()
	stage, maintenance, lease, poll := loadPasses(r.citus, "300ms", "1s", "2s", "100ms")
	r.nodes = make([]*node, 3)
	for i := range r.nodes {
		n := &node{t: r.t, addr: freeAddr(r.t)}
		n.env = []string{
			"TALLY_DATABASE_URL=" + r.url, "TALLY_LISTEN=" + n.addr, "TALLY_ADMIN_TOKEN=" + chaosAdmin,
			"STRIPE_API_KEY=" + stripesim.DefaultKey, "STRIPE_API_BASE=" + r.simURL, "STRIPE_METER_EVENTS_BASE=" + r.simURL,
			"TALLY_STAGE_INTERVAL=" + stage, "TALLY_WINDOW_GRACE=1s", "TALLY_MAINTENANCE_INTERVAL=" + maintenance,
			"TALLY_OUTBOX_BACKOFF_BASE=50ms", "TALLY_OUTBOX_BACKOFF_CAP=400ms", "TALLY_OUTBOX_RATE_LIMIT_DELAY=100ms",
			"TALLY_OUTBOX_MAX_ATTEMPTS=200", "TALLY_OUTBOX_LEASE=" + lease, "TALLY_STRIPE_TIMEOUT=" + chaosStripeTimeout.String(),
			"TALLY_RATE_TEST=1000", "TALLY_STREAM_RATE_TEST=100000", "TALLY_BASIC_RATE_TEST=3000", "TALLY_POLL_INTERVAL=" + poll, "TALLY_SHUTDOWN_TIMEOUT=5s", "TALLY_LOG_LEVEL=error",
			"TALLY_DELIVERY_INFLIGHT=32",
		}
		r.nodes[i] = n
	}
	r.nodes[0].start() // migrates; the others then find the schema current
	for _, n := range r.nodes[1:] {
		n.start()
	}
	r.t.Cleanup(func() {
		for _, n := range r.nodes {
			n.stop()
		}
	})
}

// intN draws from the run's random source, which several goroutines share.
func (r *chaosRun) intN(n int) int {
	r.rngMu.Lock()
	defer r.rngMu.Unlock()
	return r.rng.IntN(n)
}

// uint64 draws from the run's random source, which several goroutines share.
func (r *chaosRun) uint64() uint64 {
	r.rngMu.Lock()
	defer r.rngMu.Unlock()
	return r.rng.Uint64()
}

// live is the base URL of a node picked at random, once no node is
// restarting and Postgres is up.
func (r *chaosRun) live() string {
	r.nodesMu.Lock()
	defer r.nodesMu.Unlock()
	return "http://" + r.nodes[r.intN(len(r.nodes))].addr
}

func (r *chaosRun) mapFeaturesAndTenants() {
	r.t.Helper()
	for _, f := range r.features {
		code, body := post(r.t, http.MethodPut, r.live()+"/v1/mappings/features/"+f.name, chaosAdmin,
			map[string]string{"event_name": f.name, "aggregation": f.formula, "exporter": f.exporter})
		require.Equal(r.t, http.StatusOK, code, body)
	}
	for i := 0; i < chaosTenants; i++ {
		code, body := post(r.t, http.MethodPut, fmt.Sprintf("%s/v1/mappings/tenants/c%02d", r.live(), i), chaosAdmin,
			map[string]string{"stripe_customer_id": fmt.Sprintf("cus_c%02d", i)})
		require.Equal(r.t, http.StatusOK, code, body)
	}
}

// startPoster starts posting batches of usage to a random node,
// throughout, until stopPoster. Some are late (their window was staged
// already), some are corrections, and some batches are posted again whole
// (duplicates).
func (r *chaosRun) startPoster() {
	r.now = time.Now().UTC().Truncate(time.Second)
	r.wg.Add(1)
	go r.post()
}

func (r *chaosRun) post() {
	defer r.wg.Done()
	prng := rand.New(rand.NewPCG(r.uint64(), 1))
	for {
		select {
		case <-r.stopped:
			return
		default:
		}
		batch := r.duplicate(prng)
		if batch == nil {
			batch = r.newBatch(prng)
		}
		if !r.deliver(batch) {
			return
		}
		r.posted.Add(int64(len(batch)))
		// About 1,000 events a second in the short run; a tenth of that
		// in a long one, which the deliverers (held to 1,000 calls a
		// second, one per count event) must keep up with.
		pause := time.Duration(20+prng.IntN(80)) * time.Millisecond
		if r.duration > time.Minute {
			pause *= 10
		}
		time.Sleep(pause)
	}
}

// duplicate picks, one time in ten, a batch posted before, to deliver
// again (nil otherwise).
func (r *chaosRun) duplicate(prng *rand.Rand) []e2eEvent {
	if prng.IntN(10) != 0 {
		return nil
	}
	r.sentMu.Lock()
	defer r.sentMu.Unlock()
	if len(r.sent) == 0 {
		return nil
	}
	return r.sent[prng.IntN(len(r.sent))] // a duplicate delivery
}

// newBatch makes 50 new events, corrections among them, and remembers
// them for duplicate deliveries.
func (r *chaosRun) newBatch(prng *rand.Rand) []e2eEvent {
	var batch []e2eEvent
	for k := 0; k < 50; k++ {
		i := r.seq.Add(1)
		f := r.features[prng.IntN(3)].name
		v := int64(prng.IntN(20) + 1)
		if f == "api_calls" && prng.IntN(8) == 0 {
			v = -v // a correction
		}
		if f == "logins" {
			v = 1
		}
		// Usage of the two hours before the current one: its hourly
		// windows are closed, so they are staged at once, and every later
		// event of them is late (a supplement).
		age := time.Duration(prng.IntN(2*3600)) * time.Second
		batch = append(batch, e2eEvent{ID: fmt.Sprintf("x%07d", i), Tenant: fmt.Sprintf("c%02d", prng.IntN(chaosTenants)),
			Feature: f, Value: v, Timestamp: r.now.Truncate(time.Hour).Add(-time.Second - age).Format(time.RFC3339)})
	}
	r.sentMu.Lock()
	r.sent = append(r.sent, batch)
	r.sentMu.Unlock()
	return batch
}

// deliver posts a batch until a node accepts it; it reports false if the
// poster was stopped first.
func (r *chaosRun) deliver(batch []e2eEvent) bool {
	for {
		code, _ := postOnce(r.live()+"/v1/usage", chaosAdmin, map[string]any{"events": batch})
		if code == http.StatusAccepted {
			return true
		}
		select { // the node was down or Postgres was: try again
		case <-r.stopped:
			return false
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// minKills is how many nodes the chaos kills at least: a slow restart or
// shard move may take the whole run's time, and the kills then go on after
// it.
const minKills = 10

// unleash is the chaos: a node killed and restarted every 1-3 s; Postgres
// restarted at a third and at two thirds of the run.
func (r *chaosRun) unleash() {
	r.t.Helper()
	deadline := time.Now().Add(r.duration)
	pgAt := []time.Time{time.Now().Add(r.duration / 3), time.Now().Add(2 * r.duration / 3)}
	database := func() {
		pgAt = pgAt[1:]
		switch {
		case !r.citus:
			r.restartPostgres()
		case len(pgAt) == 1:
			r.restartWorker()
		default:
			r.moveShard()
		}
	}
	// A slow restart or move may take the run past its end: what is left
	// of the database's part still happens, after it.
	defer func() {
		for len(pgAt) > 0 {
			database()
		}
	}()
	for time.Now().Before(deadline) || r.kills < minKills {
		time.Sleep(time.Duration(1000+r.intN(2000)) * time.Millisecond)
		if len(pgAt) > 0 && time.Now().After(pgAt[0]) {
			database()
			continue
		}
		r.nodesMu.Lock()
		n := r.nodes[r.intN(len(r.nodes))]
		n.kill()
		n.start()
		r.nodesMu.Unlock()
		r.kills++
		// Stripe's sessions may end at any moment too.
		r.sim.ExpireSessions(stripesim.DefaultAccount)
	}
}

func (r *chaosRun) stopPoster() {
	r.t.Helper()
	close(r.stopped)
	r.wg.Wait()
	if r.citus {
		r.t.Logf("chaos: %d events posted, %d kills, %d worker restarts; %s", r.posted.Load(), r.kills, r.restarts, r.moved)
		return
	}
	r.t.Logf("chaos: %d events posted, %d kills, %d Postgres restarts", r.posted.Load(), r.kills, r.restarts)
}

func (r *chaosRun) openPool() {
	r.t.Helper()
	pool, err := pgxpool.New(r.ctx, r.url)
	require.NoError(r.t, err)
	r.t.Cleanup(pool.Close)
	r.pool = pool
}

// drained reports whether every event is staged and no item is open; a
// read that fails says not yet.
func (r *chaosRun) drained() bool {
	unstaged, open, err := openWork(r.ctx, r.pool)
	if err != nil {
		r.t.Logf("chaos: reading the outbox: %v", err)
		return false
	}
	return open == 0 && unstaged == 0
}

// waitDrained waits for the outbox to drain, three minutes and a second
// per 300 events posted at most, and fails with the nodes' logs, then how
// the open work went down meanwhile, the outbox, River's jobs and its
// leader: the end of the message is what a truncated log keeps.
func (r *chaosRun) waitDrained() {
	r.t.Helper()
	start := time.Now()
	var progress []string
	next := start
	for end := start.Add(3*time.Minute + time.Duration(r.posted.Load()/300)*time.Second); !r.drained(); time.Sleep(200 * time.Millisecond) {
		if time.Now().After(next) {
			unstaged, open, err := openWork(r.ctx, r.pool)
			progress = append(progress, fmt.Sprintf("%s: %d unstaged, %d open %v", time.Since(start).Round(time.Second), unstaged, open, err))
			next = next.Add(15 * time.Second)
		}
		if time.Now().After(end) {
			var logs string
			for i, n := range r.nodes {
				logs += fmt.Sprintf("--- node %d ---\n%s\n", i, squeezeLog(n.out.String(), 12))
			}
			r.t.Fatalf("the outbox never drained\n%s--- drain ---\n%s\n--- outbox ---\n%s\njobs:\n%sleader: %s",
				logs, strings.Join(progress, "\n"), outboxSummary(r.ctx, r.pool), r.riverJobs(), r.riverLeader())
		}
	}
	r.t.Logf("chaos: the outbox drained in %s after the chaos", time.Since(start).Round(100*time.Millisecond))
}

// squeezeLog is the last n kinds of line of a node's log, a JSON line's
// kind being its message and the start of its error, each with how often
// it came and when last (a JSON line's time).
func squeezeLog(out string, n int) string {
	type kind struct {
		count int
		last  string
	}
	kinds := map[string]*kind{}
	var order []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var l struct{ Time, Msg, Error string }
		key := line
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg != "" {
			key = l.Msg + ": " + l.Error[:min(len(l.Error), 100)]
		}
		k, ok := kinds[key]
		if !ok {
			k = &kind{}
			kinds[key] = k
		}
		k.count++
		if l.Time != "" {
			k.last = " (last " + l.Time + ")"
		}
		order = slices.DeleteFunc(order, func(s string) bool { return s == key })
		order = append(order, key)
	}
	var b strings.Builder
	for _, key := range order[max(0, len(order)-n):] {
		fmt.Fprintf(&b, "%d× %s%s\n", kinds[key].count, key, kinds[key].last)
	}
	return b.String()
}

// riverJobs describes River's jobs by kind and state, for a failure message.
func (r *chaosRun) riverJobs() string {
	jobs := ""
	if rows, err := r.pool.Query(r.ctx, `SELECT kind || ' ' || state || ' ' || count(*) || ' newest ' || max(created_at)::text || ' ' || coalesce(max(attempted_by::text), '')
				FROM river_job GROUP BY kind, state`); err == nil {
		for rows.Next() {
			var l string
			_ = rows.Scan(&l)
			jobs += l + "\n"
		}
	}
	return jobs
}

// riverLeader names River's leader and when its term ends, for a failure
// message.
func (r *chaosRun) riverLeader() string {
	var leader string
	_ = r.pool.QueryRow(r.ctx, `SELECT coalesce((SELECT leader_id || ' expires ' || expires_at::text FROM river_leader), 'no leader') || ' now ' || now()::text`).Scan(&leader)
	return leader
}

// checkLedger checks that every item was accepted, that the ledger holds
// exactly what was posted, once, and that Stripe's aggregates are the
// ledger's; it returns the ledger's size.
func (r *chaosRun) checkLedger() int64 {
	r.t.Helper()
	// Every item accepted.
	var notAccepted int
	require.NoError(r.t, r.pool.QueryRow(r.ctx, `SELECT count(*) FROM outbox_items WHERE state NOT IN ('accepted', 'superseded')`).Scan(&notAccepted))
	require.Zero(r.t, notAccepted, outboxSummary(r.ctx, r.pool))

	// The ledger holds exactly what was posted, once (duplicates stored nothing).
	var ledger int64
	require.NoError(r.t, r.pool.QueryRow(r.ctx, `SELECT count(*) FROM usage_events`).Scan(&ledger))
	require.Equal(r.t, r.seq.Load(), ledger)

	// Stripe's aggregate for every customer and meter is the ledger's.
	checkAggregates(r.t, r.ctx, r.pool, r.sim)
	return ledger
}

// checkFaultsAndRoutes logs the faults the simulator injected, by what
// the calls were answered, and checks that each feature went through its
// exporter, that no identifier was recorded twice and that no two calls
// for one customer and meter were ever in flight together.
func (r *chaosRun) checkFaultsAndRoutes(ledger int64) {
	r.t.Helper()
	answered, streamed := map[int]int{}, map[int]int{}
	calls, streamCalls := 0, 0
	for _, rq := range r.sim.Requests() {
		switch rq.Path {
		case "/v1/billing/meter_events":
			answered[rq.Status]++
			calls++
		case "/v2/billing/meter_event_stream":
			streamed[rq.Status]++
			streamCalls++
		}
	}
	r.t.Logf("chaos: %d meter-event calls: %d accepted (200), %d duplicates (400), %d failed before recording or hung (500), %d lost replies (502), %d rate-limited (429)",
		calls, answered[200], answered[400], answered[500], answered[502], answered[429])
	r.t.Logf("chaos: %d stream requests: %d accepted (200), %d failed before recording or hung (500), %d lost replies (502), %d rate-limited (429), %d expired sessions (401)",
		streamCalls, streamed[200], streamed[500], streamed[502], streamed[429], streamed[401])
	require.Positive(r.t, streamed[200], "the stream exported the count feature")
	var wrongRoute int
	require.NoError(r.t, r.pool.QueryRow(r.ctx, `SELECT count(*) FROM outbox_items
		WHERE (payload ->> 'feature' = 'logins') <> (exporter = 'stripe_meter_event_stream')`).Scan(&wrongRoute))
	require.Zero(r.t, wrongRoute, "every logins item, and only those, went to the stream")
	var items, supplements int
	require.NoError(r.t, r.pool.QueryRow(r.ctx, `SELECT count(*), count(*) FILTER (WHERE subject_ref LIKE '%#%') FROM outbox_items`).Scan(&items, &supplements))
	r.t.Logf("chaos: %d events in the ledger, %d items (%d supplements of late usage)", ledger, items, supplements)
	require.Empty(r.t, r.sim.RecordedTwice(), "no identifier recorded twice")
	live, all := liveOverlaps(r.sim, chaosStripeTimeout)
	require.Empty(r.t, live, "never two calls in flight for one customer and meter (of the simulator's overlaps: %v)", all)
}

// chaosStripeTimeout is the chaos nodes' TALLY_STRIPE_TIMEOUT.
const chaosStripeTimeout = 400 * time.Millisecond

// liveOverlaps is the simulator's overlaps of v1 calls for one customer and
// meter in which two calls were live: neither's client had given up. A
// call older than the client's own timeout was abandoned by it, whether or
// not the simulator had noticed the closed connection yet (under load it
// takes tens of milliseconds): Tally then records the attempt as one that
// may have reached Stripe and may send the key's next item, and whether
// Stripe still counts the abandoned call is the unverified case
// docs/stripe.md designs for (a 429, never a second event). Too many
// overlaps to see them all fail.
func liveOverlaps(sim *stripesim.Server, clientTimeout time.Duration) (live, all []stripesim.Overlap) {
	all = sim.Overlaps()
	if len(all) >= 50 {
		return all, all
	}
	for _, o := range all {
		n := 0
		for _, c := range o.Calls {
			if !c.ClientGone && c.Age < clientTimeout {
				n++
			}
		}
		if n > 1 {
			live = append(live, o)
		}
	}
	return live, all
}

// checkConservation checks conservation for every tenant, feature and
// period.
func (r *chaosRun) checkConservation() {
	r.t.Helper()
	for _, m := range []string{r.now.Format("2006-01"), r.now.Add(-3 * time.Hour).Format("2006-01")} {
		rep, err := quarantine.CompletenessOf(r.ctx, r.pool, m, "")
		require.NoError(r.t, err)
		require.True(r.t, rep.Holds, "%+v", rep)
	}
}

// checkLeases checks that leases expired under load had their late
// outcomes fenced out: one outcome per lease (the attempt log's key), and
// each item's state is what its latest lease recorded. The surviving
// nodes counted the stale writes they refused (a killed node's count dies
// with it).
func (r *chaosRun) checkLeases() {
	r.t.Helper()
	var abandoned, mismatched int
	require.NoError(r.t, r.pool.QueryRow(r.ctx, `SELECT count(*) FROM outbox_attempts WHERE outcome = 'abandoned'`).Scan(&abandoned))
	require.NoError(r.t, r.pool.QueryRow(r.ctx, `SELECT count(*) FROM outbox_items o
		JOIN LATERAL (SELECT state_after FROM outbox_attempts a WHERE a.item_id = o.id AND a.bucket = o.bucket ORDER BY lease_token DESC LIMIT 1) last ON true
		WHERE o.state IN ('accepted', 'confirmed') AND last.state_after <> 'accepted'`).Scan(&mismatched))
	require.Zero(r.t, mismatched, "an item's state is its latest lease's outcome")
	stale := 0.0
	for _, n := range r.nodes {
		_, body := get("http://" + n.addr + "/metrics")
		for _, line := range strings.Split(body, "\n") {
			if strings.HasPrefix(line, "tally_outbox_stale_writes_total{") {
				if f := strings.Fields(line); len(f) == 2 {
					v, _ := strconv.ParseFloat(f[1], 64)
					stale += v
				}
			}
		}
	}
	r.t.Logf("chaos: %d leases taken over after their holder died or stalled; %.0f stale writes refused and counted by the surviving nodes", abandoned, stale)
}

// checkReconcile checks that Stripe's own numbers confirm every item.
func (r *chaosRun) checkReconcile() {
	r.t.Helper()
	code, body := post(r.t, http.MethodPost, r.live()+"/v1/reconcile/runs", chaosAdmin, map[string]string{"settle": "0s"})
	require.Equal(r.t, http.StatusAccepted, code, body)
	var run struct {
		ID             int64  `json:"id"`
		Status         string `json:"status"`
		ItemsConfirmed int64  `json:"items_confirmed"`
		Discrepancies  int    `json:"discrepancies"`
	}
	require.NoError(r.t, json.Unmarshal([]byte(body), &run))
	require.Eventually(r.t, func() bool {
		code, body := post(r.t, http.MethodGet, r.live()+"/v1/reconcile/runs/"+strconv.FormatInt(run.ID, 10), chaosAdmin, nil)
		require.Equal(r.t, http.StatusOK, code, body)
		require.NoError(r.t, json.Unmarshal([]byte(body), &run))
		return run.Status != "queued" && run.Status != "running"
	}, time.Minute, 200*time.Millisecond)
	require.Equal(r.t, "succeeded", run.Status)
	require.Zero(r.t, run.Discrepancies)
	var left int
	require.NoError(r.t, r.pool.QueryRow(r.ctx, `SELECT count(*) FROM outbox_items WHERE state = 'accepted'`).Scan(&left))
	require.Zero(r.t, left)
}

// moveOldest moves a shard group with its writes blocked, in a transaction
// older than every transaction that writes to it: one that takes its
// distributed identity first, with a read of the shard, and waits (up to
// wait) until the transactions that began before it have ended. In a
// deadlock with a Tally transaction, Citus then cancels Tally's, which
// Tally retries, rather than the move.
func moveOldest(ctx context.Context, conn *pgx.Conn, bucket int16, shard int64, from, to int, wait time.Duration) error {
	return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		var since time.Time
		if err := tx.QueryRow(ctx, `SELECT clock_timestamp() FROM (SELECT count(*) FROM outbox_item_states WHERE bucket = $1) s`,
			bucket).Scan(&since); err != nil {
			return err
		}
		for end := time.Now().Add(wait); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
			if _, err := tx.Exec(ctx, `SELECT pg_stat_clear_snapshot()`); err != nil {
				return err
			}
			var older int
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
				  AND state <> 'idle' AND xact_start < $1`, since).Scan(&older); err != nil {
				return err
			}
			if older == 0 {
				break
			}
		}
		_, err := tx.Exec(ctx, `SELECT citus_move_shard_placement($1, '127.0.0.1', $2, '127.0.0.1', $3, 'block_writes')`, shard, from, to)
		return err
	})
}

// restartWorker stops the first worker under the nodes and starts it again
// after a pause: the tenants of its shards stall meanwhile.
func (r *chaosRun) restartWorker() {
	r.t.Helper()
	r.pgMu.Lock()
	defer r.pgMu.Unlock()
	require.NoError(r.t, r.pg.RestartWorker(r.ctx, 0, time.Duration(500+r.intN(1500))*time.Millisecond))
	r.restarts++
}

// moveShard moves the shard group that holds tenant c00's bucket to the
// worker that does not hold it while usage and delivery go on, as
// docs/operations.md tells an operator to.
func (r *chaosRun) moveShard() {
	r.t.Helper()
	r.pgMu.Lock()
	defer r.pgMu.Unlock()
	conn, err := pgx.Connect(r.ctx, r.url)
	require.NoError(r.t, err)
	defer conn.Close(context.WithoutCancel(r.ctx))
	var shard int64
	var from int
	require.NoError(r.t, conn.QueryRow(r.ctx, `SELECT p.shardid, p.nodeport FROM pg_dist_shard_placement p
		WHERE p.shardid = get_shard_id_for_distribution_column('outbox_item_states', $1::smallint)`,
		tenantbucket.Of("c00")).Scan(&shard, &from))
	to := r.pg.Workers()[0].Port()
	if to == from {
		to = r.pg.Workers()[1].Port()
	}
	// The move locks the group's shards in shard order, and a Tally
	// transaction that wrote a later table of the group before an earlier
	// one waits for it while it waits for the transaction: Citus cancels
	// the youngest of the two. So the operator's move is made the oldest
	// (moveOldest); should it lose all the same, it is run again after a
	// pause that grows.
	start, tries, mode := time.Now(), 0, "block_writes, oldest"
	pause := time.Second
	for {
		tries++
		err = moveOldest(r.ctx, conn, tenantbucket.Of("c00"), shard, from, to, time.Minute)
		var pe *pgconn.PgError
		if err == nil || !errors.As(err, &pe) || pe.Code != "40P01" || time.Since(start) > 8*time.Minute {
			break
		}
		r.t.Logf("chaos: move try %d lost to a deadlock after %s", tries, time.Since(start).Round(time.Millisecond))
		time.Sleep(pause/2 + time.Duration(r.intN(int(pause/time.Millisecond)))*time.Millisecond)
		pause = min(2*pause, 15*time.Second)
	}
	require.NoError(r.t, err, "moving shard %d after %d tries in %s", shard, tries, time.Since(start).Round(time.Millisecond))
	r.moved = fmt.Sprintf("shard %d of outbox_item_states and its group moved from port %d to %d in %s (%d tries, %s)", shard, from, to, time.Since(start).Round(time.Millisecond), tries, mode)
}
