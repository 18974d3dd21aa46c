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

	"github.com/tallymeter/tally/internal/testkit/benchstat"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// BenchmarkClaimAcceptVsRiver measures the outbox's claim + accept
// throughput at batch sizes 1, 10 and 100, and River inserting and working
// no-op jobs on the same server in the same run, and prints both and their
// ratio. Batch 100 (both policies) and River run first, in three alternating
// rounds, each on a fresh database, and are compared by their medians: on
// this 2-core machine one run of either moves by a third from run to run
// (River 13,000–20,500 jobs/s with the same binary), so a single pair says
// more about the moment than about the code. Run it with one iteration;
// every figure is a rate over a fixed number of items:
//
//	go test ./outbox -run '^$' -bench ClaimAcceptVsRiver -benchtime 1x
func BenchmarkClaimAcceptVsRiver(b *testing.B) {
	const (
		items   = 20000
		workers = 4
		rounds  = 3
	)
	var perKey, bestEffort, work, insert []float64
	fmt.Printf("\n%d items, %d outbox workers (one connection each); River: MaxWorkers 100, FetchCooldown 1ms\n", items, workers)
	fmt.Printf("%-8s %16s %16s %14s %14s\n", "round", "PerKey b100", "BestEffort b100", "River work", "River insert")
	for r := 1; r <= rounds; r++ {
		pk := benchOutbox(b, items, workers, 100, outbox.PerKey)
		be := benchOutbox(b, items, workers, 100, outbox.BestEffort)
		ins, w := benchRiver(b, items)
		perKey, bestEffort, work, insert = append(perKey, pk), append(bestEffort, be), append(work, w), append(insert, ins)
		fmt.Printf("%-8d %9.0f %5.2fx %9.0f %5.2fx %14.0f %14.0f\n", r, pk, pk/w, be, be/w, w, ins)
	}
	pk, be, w, ins := benchstat.Median(perKey), benchstat.Median(bestEffort), benchstat.Median(work), benchstat.Median(insert)
	// The small batches last: their tens of thousands of one-item
	// transactions leave autovacuum work behind that would slow the rounds.
	small := map[int]float64{}
	for _, batch := range []int{1, 10} {
		small[batch] = benchOutbox(b, items, workers, batch, outbox.PerKey)
	}

	for _, batch := range []int{1, 10} {
		b.ReportMetric(small[batch], fmt.Sprintf("outbox_b%d_items/s", batch))
	}
	b.ReportMetric(pk, "outbox_b100_items/s")
	b.ReportMetric(be, "outbox_b100_best_effort_items/s")
	b.ReportMetric(w, "river_work_jobs/s")
	b.ReportMetric(ins, "river_insert_jobs/s")
	fmt.Printf("\nmedians of %d rounds (batches 1 and 10: one run each, PerKey)\n", rounds)
	fmt.Printf("%-34s %12s %10s\n", "", "per second", "vs River")
	for _, batch := range []int{1, 10} {
		fmt.Printf("%-34s %12.0f %9.2fx\n", fmt.Sprintf("outbox claim + accept, batch %d", batch), small[batch], small[batch]/w)
	}
	fmt.Printf("%-34s %12.0f %9.2fx\n", "outbox claim + accept, batch 100", pk, pk/w)
	fmt.Printf("%-34s %12.0f %9.2fx\n", "outbox, batch 100, BestEffort", be, be/w)
	fmt.Printf("%-34s %12.0f %9.2fx\n", "River work no-op jobs", w, 1.0)
	fmt.Printf("%-34s %12.0f\n\n", "River insert jobs (InsertMany)", ins)
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
