package outbox_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// BenchmarkClaimAcceptVsRiver measures the outbox's claim + accept
// throughput at batch sizes 1, 10 and 100, and River inserting and working
// no-op jobs on the same server in the same run, and prints both and their
// ratio. Run it with one iteration; every figure is a rate over a fixed
// number of items:
//
//	go test ./outbox -run '^$' -bench ClaimAcceptVsRiver -benchtime 1x
func BenchmarkClaimAcceptVsRiver(b *testing.B) {
	const (
		items   = 20000
		workers = 4
	)
	var rates = map[int]float64{}
	for _, batch := range []int{1, 10, 100} {
		rates[batch] = benchOutbox(b, items, workers, batch, outbox.PerKey)
	}
	bestEffort := benchOutbox(b, items, workers, 100, outbox.BestEffort)
	insert, work := benchRiver(b, items)

	for _, batch := range []int{1, 10, 100} {
		b.ReportMetric(rates[batch], fmt.Sprintf("outbox_b%d_items/s", batch))
	}
	b.ReportMetric(bestEffort, "outbox_b100_best_effort_items/s")
	b.ReportMetric(work, "river_work_jobs/s")
	b.ReportMetric(insert, "river_insert_jobs/s")
	fmt.Printf("\n%d items, %d outbox workers (one connection each, PerKey unless named); River: MaxWorkers 100, FetchCooldown 1ms\n", items, workers)
	fmt.Printf("%-34s %12s %10s\n", "", "per second", "vs River")
	for _, batch := range []int{1, 10, 100} {
		fmt.Printf("%-34s %12.0f %9.2fx\n", fmt.Sprintf("outbox claim + accept, batch %d", batch), rates[batch], rates[batch]/work)
	}
	fmt.Printf("%-34s %12.0f %9.2fx\n", "outbox, batch 100, BestEffort", bestEffort, bestEffort/work)
	fmt.Printf("%-34s %12.0f %9.2fx\n", "River work no-op jobs", work, 1.0)
	fmt.Printf("%-34s %12.0f\n\n", "River insert jobs (InsertMany)", insert)
}

// enqueuedForBench is a fresh database holding items pending items, one
// customer each (the per-key policy never holds one back), analysed as a
// database that has run a while would be, and the Store over it.
func enqueuedForBench(b *testing.B, items int) (*pgxpool.Pool, *outbox.Store) {
	b.Helper()
	ctx := context.Background()
	pool := testdb.New(b)
	store, err := outbox.New(outbox.Config{}, nil)
	if err != nil {
		b.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < items; i++ {
		if _, err := store.Enqueue(ctx, tx, newItem(i)); err != nil {
			b.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE outbox_item_bodies, outbox_item_states"); err != nil {
		b.Fatal(err)
	}
	return pool, store
}

// benchOutbox enqueues items, then times workers claiming and accepting them
// all, batch at a time; it returns items per second.
func benchOutbox(b *testing.B, items, workers, batch int, policy outbox.Policy) float64 {
	b.Helper()
	ctx := context.Background()
	pool, store := enqueuedForBench(b, items)

	var (
		done atomic.Int64
		wg   sync.WaitGroup
	)
	start := time.Now()
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := pgx.Connect(ctx, testdb.URLOf(b, pool))
			if err != nil {
				b.Error(err)
				return
			}
			defer conn.Close(ctx)
			owner := fmt.Sprintf("bench-%d", w)
			outcomes := make([]outbox.Outcome, 0, batch)
			for {
				leases, err := store.Claim(ctx, conn, outbox.ClaimOptions{Owner: owner, Limit: batch, Policy: policy})
				if err != nil {
					b.Error(err)
					return
				}
				if len(leases) == 0 {
					return
				}
				outcomes = outcomes[:0]
				for _, l := range leases {
					outcomes = append(outcomes, outbox.Outcome{Lease: l, Kind: outbox.Accepted, ProviderRef: "req_bench"})
				}
				res, err := store.Record(ctx, conn, outcomes)
				if err != nil {
					b.Error(err)
					return
				}
				for _, r := range res {
					if r.Err != nil {
						b.Error(r.Err)
						return
					}
				}
				done.Add(int64(len(leases)))
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if int(done.Load()) != items {
		b.Fatalf("outbox batch %d: accepted %d of %d", batch, done.Load(), items)
	}
	return float64(items) / elapsed.Seconds()
}

type noopArgs struct{ N int }

func (noopArgs) Kind() string { return "tally_bench_noop" }

type noopWorker struct {
	river.WorkerDefaults[noopArgs]
}

func (noopWorker) Work(context.Context, *river.Job[noopArgs]) error { return nil }

// benchRiver inserts items no-op jobs, then starts a River client and times
// it working them all; it returns inserts per second and jobs worked per
// second.
func benchRiver(b *testing.B, items int) (insertRate, workRate float64) {
	b.Helper()
	ctx := context.Background()
	pool := testdb.New(b)
	workers := river.NewWorkers()
	river.AddWorker(workers, &noopWorker{})
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 100}},
		Workers:           workers,
		FetchCooldown:     time.Millisecond,
		FetchPollInterval: 5 * time.Millisecond,
		Logger:            quietLogger(),
	})
	if err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	for i := 0; i < items; i += 1000 {
		params := make([]river.InsertManyParams, 0, 1000)
		for j := i; j < min(i+1000, items); j++ {
			params = append(params, river.InsertManyParams{Args: noopArgs{N: j}})
		}
		if _, err := client.InsertManyFast(ctx, params); err != nil {
			b.Fatal(err)
		}
	}
	insertRate = float64(items) / time.Since(start).Seconds()
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE river_job"); err != nil {
		b.Fatal(err)
	}

	// A channel as large as the run, so that no completion event is dropped.
	events, cancel := client.SubscribeConfig(&river.SubscribeConfig{
		ChanSize: items, Kinds: []river.EventKind{river.EventKindJobCompleted},
	})
	defer cancel()
	start = time.Now()
	if err := client.Start(ctx); err != nil {
		b.Fatal(err)
	}
	for n := 0; n < items; n++ {
		select {
		case <-events:
		case <-time.After(time.Minute):
			b.Fatalf("river: %d of %d jobs completed", n, items)
		}
	}
	workRate = float64(items) / time.Since(start).Seconds()
	stopCtx, stop := context.WithTimeout(ctx, 10*time.Second)
	defer stop()
	if err := client.Stop(stopCtx); err != nil {
		b.Fatal(err)
	}
	waitRiverCompleted(b, pool, items)
	return insertRate, workRate
}

// waitRiverCompleted checks that River recorded every job as completed.
func waitRiverCompleted(b *testing.B, pool *pgxpool.Pool, items int) {
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM river_job WHERE state = 'completed'").Scan(&n); err != nil {
		b.Fatal(err)
	}
	if n != items {
		b.Fatalf("river: %d of %d jobs recorded completed", n, items)
	}
}
