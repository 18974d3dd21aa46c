package exporter_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// The delivery benchmarks behind docs/performance.md. Run each with one
// iteration; every figure is a rate over a fixed number of items:
//
//	go test ./exporter -run '^$' -bench 'Deliver' -benchtime 1x

const (
	benchItems     = 10000
	benchCustomers = 2000 // five items per customer and meter: PerKey holds some back
	benchTimeout   = 5 * time.Second
)

// runScope is a testing.TB whose cleanups run when end is called, not when
// the benchmark ends: a run's database and simulator are gone before the
// next run starts, so that a benchmark of many runs does not hold them all
// (in memory, or in the scratch cluster's /dev/shm).
type runScope struct {
	testing.TB
	cleanups []func()
}

func (s *runScope) Cleanup(f func()) { s.cleanups = append(s.cleanups, f) }

func (s *runScope) end() {
	for i := len(s.cleanups) - 1; i >= 0; i-- {
		s.cleanups[i]()
	}
	s.cleanups = nil
}

// benchSim is a simulator with the meter and the customers of benchItems.
func benchSim(b testing.TB, limits stripesim.Limits) (*stripesim.Server, string) {
	b.Helper()
	sim := stripesim.New(stripesim.Options{Seed: 1, Limits: limits})
	srv := httptest.NewServer(sim.Handler())
	b.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "api", EventName: "api_calls", Formula: "sum"})
	for c := 0; c < benchCustomers; c++ {
		sim.CreateCustomer(stripesim.DefaultAccount, fmt.Sprintf("cus_b%d", c))
	}
	return sim, srv.URL
}

func benchPayload(n int, ts int64) outbox.Payload {
	return outbox.Payload{Customer: fmt.Sprintf("cus_b%d", n%benchCustomers), EventName: "api_calls",
		Value: int64(n%50) + 1, Timestamp: ts, Feature: "api_calls", Period: "2026-11-01T00:00:00Z"}
}

// benchOutboxOf is a fresh database holding n pending items staged for the
// exporter named exp.
func benchOutboxOf(b testing.TB, n int, exp string) (*pgxpool.Pool, *outbox.Store) {
	b.Helper()
	ctx := context.Background()
	pool := testdb.New(b)
	// A rate-limited item waits a second, not the default 30, before it is
	// claimed again, so that a run's tail is not the rate-limit delay.
	store, err := outbox.New(outbox.Config{Lease: time.Minute, RateLimitDelay: time.Second}, nil)
	if err != nil {
		b.Fatal(err)
	}
	ts := time.Now().Add(-time.Hour).Unix()
	items := make([]outbox.NewItem, 0, 1000)
	for start := 0; start < n; start += 1000 {
		items = items[:0]
		for i := start; i < min(start+1000, n); i++ {
			items = append(items, outbox.NewItem{
				Identity: outbox.Identity{
					TenantKey: fmt.Sprintf("t%d", i%benchCustomers), SubjectKind: outbox.SubjectUsageWindow,
					SubjectRef: fmt.Sprintf("usage:api_calls:bench#%d", i), Exporter: exp,
					DestinationAccount: stripesim.DefaultAccount, Mode: outbox.ModeTest, MappingVersion: 1,
				},
				Payload: benchPayload(i, ts),
			})
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := store.EnqueueBatch(ctx, tx, items); err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE outbox_item_bodies, outbox_item_states"); err != nil {
		b.Fatal(err)
	}
	return pool, store
}

// instant is an exporter that accepts every item at once: the deliverer's
// own ceiling, without HTTP.
type instant struct{}

func (instant) Name() string               { return exporter.StripeMeterEvents }
func (instant) DedupWindow() time.Duration { return exporter.StripeDedupWindow }
func (instant) Accepts() (time.Duration, time.Duration) {
	return exporter.StripeAcceptPast, exporter.StripeAcceptFuture
}
func (instant) Send(context.Context, outbox.Lease) outbox.Outcome {
	return outbox.Outcome{Kind: outbox.Accepted}
}

type deliverRun struct {
	workers, batch, inflight int
	rate                     float64 // the deliverer's limiter
	exp                      func(*stripeapi.Client) exporter.Exporter
	// items is how many items to deliver (default benchItems); stream
	// stages them for the stream exporter and runs its deliverer's shape:
	// BestEffort claims, outcomes written record at a time (default
	// exporter.DefaultStreamRecordBatch).
	items  int
	stream bool
	record int
	// recorders is how many batches of outcomes are written at once
	// (default exporter.DefaultStreamRecorders for the stream, v1's
	// default otherwise).
	recorders int
}

// deliver runs a deliverer over a fresh outbox until every item is
// accepted and returns how long that took. The outbox's database is dropped
// when it returns.
func deliver(b *testing.B, apiBase string, r deliverRun) time.Duration {
	b.Helper()
	ctx := context.Background()
	if r.items == 0 {
		r.items = benchItems
	}
	name := exporter.StripeMeterEvents
	if r.stream {
		name = exporter.StripeMeterEventStream
	}
	scope := &runScope{TB: b}
	defer scope.end()
	pool, store := benchOutboxOf(scope, r.items, name)

	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: apiBase, MeterEventsBase: apiBase})
	if err != nil {
		b.Fatal(err)
	}
	exp := exporter.Exporter(exporter.NewStripeV1(client, benchTimeout))
	cfg := exporter.DelivererConfig{Workers: r.workers, Batch: r.batch, InFlight: r.inflight, PollInterval: 100 * time.Millisecond}
	if r.stream {
		exp = exporter.NewStripeStream(client, benchTimeout)
		cfg.Policy, cfg.RecordBatch, cfg.Recorders = outbox.BestEffort, r.record, r.recorders
		if r.record == 0 {
			cfg.RecordBatch = exporter.DefaultStreamRecordBatch
		}
		if r.recorders == 0 {
			cfg.Recorders = exporter.DefaultStreamRecorders
		}
	}
	if r.exp != nil {
		exp = r.exp(client)
	}
	dest := func() (exporter.Destination, error) {
		return exporter.Destination{Exporter: name, Account: stripesim.DefaultAccount, Mode: outbox.ModeTest}, nil
	}
	limiter := exporter.NewLimiter(r.rate)
	if r.stream {
		limiter = exporter.NewStreamLimiter(r.rate)
	}
	d, err := exporter.NewDeliverer(cfg, store, pool, exp, benchTimeout, dest, limiter, nil, nil)
	if err != nil {
		b.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	// The run is timed by the database clock, from before the deliverer
	// starts to the last accept, and watched every 100 ms by asking whether
	// any item is still open, the first entry of each open state's partial
	// index (openItems): a count of the open items was planned, on the
	// statistics taken while all were pending, as a scan of every row, 35–45
	// ms a call beside 100,000 items, and took a seventh of the two cores
	// from the run it measured.
	var start time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&start); err != nil {
		b.Fatal(err)
	}
	wg.Add(1)
	go func() { defer wg.Done(); _ = d.Run(runCtx) }()
	for {
		time.Sleep(100 * time.Millisecond)
		open, err := openItems(ctx, pool)
		if err != nil {
			b.Fatal(err)
		}
		if !open {
			break
		}
	}
	stop()
	wg.Wait()
	var accepted int
	var last time.Time
	if err := pool.QueryRow(ctx, `SELECT count(*), max(accepted_at) FROM outbox_items WHERE state = 'accepted'`).Scan(&accepted, &last); err != nil {
		b.Fatal(err)
	}
	if accepted != r.items {
		b.Fatalf("only %d of %d items accepted", accepted, r.items)
	}
	return last.Sub(start)
}

// openItems says whether any item is pending or leased. Each half reads the
// first entry of its state's partial index in that index's order
// (outbox_item_states_pending_due, _leased_expiry), which a plan for ORDER
// BY … LIMIT 1 takes whatever the statistics say (not EXISTS, which drops
// the order and, on statistics that say every row is pending, scans the
// table for its first row): the answer costs a few index pages, however
// many items the run has answered.
func openItems(ctx context.Context, pool *pgxpool.Pool) (bool, error) {
	var open bool
	err := pool.QueryRow(ctx, `SELECT (SELECT id FROM outbox_item_states WHERE state = 'pending' ORDER BY next_attempt_at, id LIMIT 1) IS NOT NULL
		OR (SELECT id FROM outbox_item_states WHERE state = 'leased' ORDER BY lease_expires_at, id LIMIT 1) IS NOT NULL`).Scan(&open)
	return open, err
}

// sendDirect posts benchItems meter events to the simulator from
// concurrency goroutines through the exporter alone — no database: the
// simulator's and HTTP's ceiling.
func sendDirect(b *testing.B, apiBase string, concurrency int) time.Duration {
	b.Helper()
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: apiBase})
	if err != nil {
		b.Fatal(err)
	}
	exp := exporter.NewStripeV1(client, benchTimeout)
	ts := time.Now().Add(-time.Hour).Unix()
	var next atomic.Int64
	var failed atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for g := 0; g < concurrency; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				n := int(next.Add(1)) - 1
				if n >= benchItems {
					return
				}
				// Consecutive items have distinct customers, so calls for
				// one customer rarely overlap; the simulator has no
				// one-call rule here in any case.
				p := benchPayload(n, ts)
				p.Identifier = fmt.Sprintf("tly_direct_%064d", n)
				if o := exp.Send(context.Background(), outbox.Lease{Item: outbox.Item{Payload: p}}); o.Kind != outbox.Accepted {
					failed.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if f := failed.Load(); f > 0 {
		b.Fatalf("%d direct sends were not accepted", f)
	}
	return time.Since(start)
}

// BenchmarkDeliverUnlimited measures items per second from pending to
// accepted against the simulator without a rate limit, for workers × batch
// sizes, beside two ceilings measured in the same run: the deliverer with an
// exporter that accepts at once (the outbox's share), and the exporter
// posting straight to the simulator from as many goroutines as the
// deliverer has sends in flight (HTTP's and the simulator's share).
func BenchmarkDeliverUnlimited(b *testing.B) {
	const inflight = 64
	_, base := benchSim(b, stripesim.Limits{})
	type row struct {
		name string
		rate float64
	}
	var rows []row
	direct := sendDirect(b, base, inflight)
	rows = append(rows, row{fmt.Sprintf("exporter alone, %d goroutines, no database", inflight), benchItems / direct.Seconds()})
	instantRun := deliver(b, base, deliverRun{workers: 4, batch: 50, inflight: inflight, rate: 1e6,
		exp: func(*stripeapi.Client) exporter.Exporter { return instant{} }})
	rows = append(rows, row{"deliverer 4×50, instant exporter (no HTTP)", benchItems / instantRun.Seconds()})
	for _, workers := range []int{1, 4, 8} {
		for _, batch := range []int{10, 50, 100} {
			// Each run gets a fresh simulator: identifiers repeat across runs.
			_, base := benchSim(b, stripesim.Limits{})
			el := deliver(b, base, deliverRun{workers: workers, batch: batch, inflight: inflight, rate: 1e6})
			rows = append(rows, row{fmt.Sprintf("deliverer %d workers × batch %d", workers, batch), benchItems / el.Seconds()})
			b.ReportMetric(benchItems/el.Seconds(), fmt.Sprintf("w%d_b%d_items/s", workers, batch))
		}
	}
	fmt.Printf("\n%d items over %d customers, one meter; in flight ≤ %d; simulator without limits on loopback\n", benchItems, benchCustomers, inflight)
	fmt.Printf("%-52s %10s %14s\n", "", "items/s", "vs exporter")
	for _, r := range rows {
		fmt.Printf("%-52s %10.0f %13.2fx\n", r.name, r.rate, r.rate/rows[0].rate)
	}
	fmt.Println()
}

// BenchmarkDeliverAtStripeLimit measures the rate the deliverer achieves
// against a simulator that allows 1,000 calls a second (a bucket of 100)
// and answers 429 beyond it, and the share of calls answered 429, for
// limiter rates around the limit. The target: at least 95% of the limit
// with under 1% of calls refused.
func BenchmarkDeliverAtStripeLimit(b *testing.B) {
	const limit = 1000
	fmt.Printf("\n%d items over %d customers; the simulator allows %d calls/s (bucket 100); deliverer 4 workers × batch 50, 64 in flight\n",
		benchItems, benchCustomers, limit)
	fmt.Printf("%-22s %12s %12s %10s %10s %10s\n", "limiter rate", "overall/s", "steady/s", "of limit", "calls", "429s")
	for _, rate := range []float64{900, 950, 1000, 1100} {
		sim, base := benchSim(b, stripesim.Limits{RatePerSecond: limit, Burst: 100})
		deliver(b, base, deliverRun{workers: 4, batch: 50, inflight: 64, rate: rate})
		var times []time.Time
		calls, refused := 0, 0
		for _, r := range sim.Requests() {
			if r.Path != "/v1/billing/meter_events" {
				continue
			}
			calls++
			switch r.Status {
			case 200:
				times = append(times, r.Time)
			case 429:
				refused++
			}
		}
		sort.Slice(times, func(i, j int) bool { return times[i].Before(times[j]) })
		whole := float64(len(times)-1) / times[len(times)-1].Sub(times[0]).Seconds()
		// Steady: from the end of the first second (the buckets' initial
		// bursts would flatter the figure) to the 99th percentile of the
		// accepted calls (the tail is the few rate-limited items waiting out
		// their delay, not the pace of the backlog).
		cut := times[0].Add(time.Second)
		first := sort.Search(len(times), func(i int) bool { return !times[i].Before(cut) })
		p99 := len(times) * 99 / 100
		steady := float64(p99-first) / times[p99].Sub(times[first]).Seconds()
		fmt.Printf("%-22.0f %12.0f %12.0f %9.1f%% %10d %9.2f%%\n", rate, whole, steady, 100*steady/limit, calls, 100*float64(refused)/float64(calls))
		b.ReportMetric(steady, fmt.Sprintf("rate%.0f_steady_calls/s", rate))
		b.ReportMetric(100*float64(refused)/float64(calls), fmt.Sprintf("rate%.0f_429_%%", rate))
	}
	fmt.Println()
}

// instantBatch is a batch exporter that accepts every item at once: the
// stream deliverer's own ceiling, without HTTP.
type instantBatch struct{ instant }

func (instantBatch) Name() string  { return exporter.StripeMeterEventStream }
func (instantBatch) MaxBatch() int { return exporter.StreamMaxEvents }
func (instantBatch) SendBatch(_ context.Context, items []outbox.Lease, _ func(context.Context, int) error) []outbox.Outcome {
	out := make([]outbox.Outcome, len(items))
	for i := range out {
		out[i] = outbox.Outcome{Kind: outbox.Accepted}
	}
	return out
}

// streamDirect posts n events to the simulator's stream in requests of 100
// from concurrency goroutines through the stream exporter alone — no
// database: the simulator's and HTTP's ceiling for the stream.
func streamDirect(b *testing.B, apiBase string, n, concurrency int) time.Duration {
	b.Helper()
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: apiBase, MeterEventsBase: apiBase})
	if err != nil {
		b.Fatal(err)
	}
	exp := exporter.NewStripeStream(client, benchTimeout)
	ts := time.Now().Add(-time.Hour).Unix()
	var next, failed atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for g := 0; g < concurrency; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				first := int(next.Add(exporter.StreamMaxEvents)) - exporter.StreamMaxEvents
				if first >= n {
					return
				}
				batch := make([]outbox.Lease, 0, exporter.StreamMaxEvents)
				for i := first; i < min(first+exporter.StreamMaxEvents, n); i++ {
					p := benchPayload(i, ts)
					p.Identifier = fmt.Sprintf("tly_direct_%064d", i)
					batch = append(batch, outbox.Lease{Item: outbox.Item{Payload: p}})
				}
				for _, o := range exp.SendBatch(context.Background(), batch, nil) {
					if o.Kind != outbox.Accepted {
						failed.Add(1)
					}
				}
			}
		}()
	}
	wg.Wait()
	if f := failed.Load(); f > 0 {
		b.Fatalf("%d direct stream events were not accepted", f)
	}
	return time.Since(start)
}

// streamShapes are the stream deliverer's shapes BenchmarkDeliverStreamVsV1
// runs, each on a fresh database and simulator: every workers × claim batch
// × recorders of TALLY_BENCH_STREAM_WORKERS, TALLY_BENCH_STREAM_BATCH and
// TALLY_BENCH_STREAM_RECORDERS (comma-separated; by default 2, 3 and 4
// workers claiming exporter.DefaultStreamBatch and outbox.MaxClaim, with
// exporter.DefaultStreamRecorders; the instant exporter's ceiling once for
// each number of recorders), TALLY_BENCH_STREAM_ROUNDS times over (default
// 1), interleaved: each round runs every shape once. Every shape
// has TALLY_BENCH_STREAM_INFLIGHT events in flight and writes outcomes
// TALLY_BENCH_STREAM_RECORD at a time (default the service's:
// exporter.DefaultStreamInFlight, DefaultStreamRecordBatch).
type streamShapes struct {
	workers, batches, recorders []int
	rounds, inflight, record    int
}

func streamShapesFromEnv(b *testing.B) streamShapes {
	b.Helper()
	one := func(env string, def int) int { return benchInts(b, env, def)[0] }
	return streamShapes{
		workers:   benchInts(b, "TALLY_BENCH_STREAM_WORKERS", 2, 3, 4),
		batches:   benchInts(b, "TALLY_BENCH_STREAM_BATCH", exporter.DefaultStreamBatch, outbox.MaxClaim),
		recorders: benchInts(b, "TALLY_BENCH_STREAM_RECORDERS", exporter.DefaultStreamRecorders),
		rounds:    one("TALLY_BENCH_STREAM_ROUNDS", 1),
		inflight:  one("TALLY_BENCH_STREAM_INFLIGHT", exporter.DefaultStreamInFlight),
		record:    one("TALLY_BENCH_STREAM_RECORD", exporter.DefaultStreamRecordBatch),
	}
}

// benchInts is the comma-separated positive whole numbers of the
// environment variable env, or def when it is unset.
func benchInts(b *testing.B, env string, def ...int) []int {
	b.Helper()
	v := os.Getenv(env)
	if v == "" {
		return def
	}
	var out []int
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			b.Fatalf("%s must be comma-separated positive whole numbers, got %q", env, v)
		}
		out = append(out, n)
	}
	return out
}

// streamRow is one run of BenchmarkDeliverStreamVsV1 and the machine's
// load average (1 minute) when it ended: the machine is shared.
type streamRow struct {
	name  string
	items int
	el    time.Duration
	load  string
}

// loadAverage is the 1-minute load average, or "-" where /proc has none.
func loadAverage() string {
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 0 {
			return f[0]
		}
	}
	return "-"
}

// streamRound runs the stream deliverer over n items once in each shape and
// once with the instant batch exporter in the default shape (the outbox's
// ceiling), starting at a shape that moves with the round, so that no shape
// always runs first or last.
func streamRound(b *testing.B, shapes streamShapes, n, round int) []streamRow {
	b.Helper()
	type run struct {
		name                     string
		workers, size, recorders int
		instant                  bool
	}
	var runs []run
	for _, rec := range shapes.recorders {
		runs = append(runs, run{fmt.Sprintf("stream deliverer %d × %d, %d recorders, instant batch exporter (no HTTP)", exporter.DefaultStreamWorkers, exporter.DefaultStreamBatch, rec),
			exporter.DefaultStreamWorkers, exporter.DefaultStreamBatch, rec, true})
	}
	for _, w := range shapes.workers {
		for _, size := range shapes.batches {
			for _, rec := range shapes.recorders {
				runs = append(runs, run{fmt.Sprintf("stream deliverer %d workers × claim %d, %d recorders", w, size, rec), w, size, rec, false})
			}
		}
	}
	var rows []streamRow
	for i := range runs {
		r := runs[(i+round-1)%len(runs)]
		dr := deliverRun{workers: r.workers, batch: r.size, inflight: shapes.inflight, record: shapes.record, recorders: r.recorders, rate: 1e6, items: n, stream: true}
		if r.instant {
			dr.exp = func(*stripeapi.Client) exporter.Exporter { return instantBatch{} }
		}
		scope := &runScope{TB: b}
		_, base := benchSim(scope, stripesim.Limits{})
		el := deliver(b, base, dr)
		scope.end()
		rows = append(rows, streamRow{fmt.Sprintf("%s (round %d)", r.name, round), n, el, loadAverage()})
		if !r.instant {
			b.ReportMetric(float64(n)/el.Seconds(), fmt.Sprintf("stream_w%d_b%d_rec%d_r%d_items/s", r.workers, r.size, r.recorders, round))
		}
	}
	return rows
}

// BenchmarkDeliverStreamVsV1 measures the v2 stream exporter's items per
// second from pending to accepted against the simulator (no limit), for the
// stream deliverer's shapes (streamShapes), beside v1's default deliverer in
// the same run and two ceilings of the stream: its exporter posting straight
// to the simulator with no database, and its default deliverer with an
// exporter that accepts at once (the outbox's share, once a round).
//
//	go test ./exporter -run '^$' -bench DeliverStreamVsV1 -benchtime 1x
//	TALLY_BENCH_STREAM_WORKERS=1,2,3,4 TALLY_BENCH_STREAM_BATCH=500,1000 TALLY_BENCH_STREAM_ROUNDS=2 \
//	  go test ./exporter -run '^$' -bench DeliverStreamVsV1 -benchtime 1x -timeout 60m
func BenchmarkDeliverStreamVsV1(b *testing.B) {
	const (
		streamItems = 100_000
		v1Items     = 20_000
	)
	shapes := streamShapesFromEnv(b)
	_, base := benchSim(b, stripesim.Limits{})
	rows := []streamRow{{"stream exporter alone, 20 goroutines × 100 events, no database", streamItems, streamDirect(b, base, streamItems, 20), loadAverage()}}
	for round := 1; round <= shapes.rounds; round++ {
		rows = append(rows, streamRound(b, shapes, streamItems, round)...)
	}
	_, base = benchSim(b, stripesim.Limits{})
	rows = append(rows, streamRow{"v1 exporter alone, 64 goroutines, no database", benchItems, sendDirect(b, base, 64), loadAverage()})
	_, base = benchSim(b, stripesim.Limits{})
	el := deliver(b, base, deliverRun{workers: exporter.DefaultWorkers, batch: exporter.DefaultBatch, inflight: exporter.DefaultInFlight, rate: 1e6, items: v1Items})
	rows = append(rows, streamRow{fmt.Sprintf("v1 deliverer %d × %d, %d in flight (the default)", exporter.DefaultWorkers, exporter.DefaultBatch, exporter.DefaultInFlight),
		v1Items, el, loadAverage()})
	b.ReportMetric(v1Items/el.Seconds(), "v1_items/s")
	b.ReportMetric(streamItems/rows[0].el.Seconds(), "stream_exporter_events/s")
	fmt.Printf("\nitems over %d customers, one meter; simulator without limits on loopback; each item is one meter event; "+
		"stream: %d events in flight, outcomes written %d at a time; load: the 1-minute load average at the run's end\n",
		benchCustomers, shapes.inflight, shapes.record)
	fmt.Printf("%-86s %8s %8s %10s %12s %6s\n", "", "items", "seconds", "items/s", "vs v1 deliv.", "load")
	v1 := float64(v1Items) / el.Seconds()
	for _, r := range rows {
		rate := float64(r.items) / r.el.Seconds()
		fmt.Printf("%-86s %8d %8.1f %10.0f %11.1fx %6s\n", r.name, r.items, r.el.Seconds(), rate, rate/v1, r.load)
	}
	fmt.Println()
}
