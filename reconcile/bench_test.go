package reconcile_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// BenchmarkReconcile100k measures a reconcile run over 100,000 accepted
// items of 1,000 customers (one meter, 100 hourly items each): its time
// and its Stripe calls, beside the same summaries read straight from the
// simulator by 1,000 sequential calls with no database (the floor: what
// Stripe's reads cost alone); then the next run, which reads every hour of
// the open period again and finds it matching (reread_s).
//
//	go test ./reconcile -run '^$' -bench Reconcile100k -benchtime 1x
func BenchmarkReconcile100k(b *testing.B) {
	ctx := context.Background()
	sim := stripesim.New(stripesim.Options{Seed: 3})
	srv := httptest.NewServer(sim.Handler())
	b.Cleanup(func() { sim.Close(); srv.Close() })
	meter := sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "api", EventName: "api", Formula: "sum"})
	for c := 0; c < benchCustomers; c++ {
		sim.CreateCustomer(stripesim.DefaultAccount, fmt.Sprintf("cus_r%04d", c))
	}
	pool := testdb.New(b)
	store, err := outbox.New(outbox.Config{}, nil)
	if err != nil {
		b.Fatal(err)
	}
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	if err != nil {
		b.Fatal(err)
	}

	// 100,000 items, one per customer and hour of the last 100 hours,
	// sent to the simulator and accepted, as the deliverer would.
	start := time.Now()
	hour0 := time.Now().Add(-time.Duration(benchPerKey+2) * time.Hour).Truncate(time.Hour)
	enqueueBenchItems(ctx, b, pool, store, hour0)
	deliverBenchItems(ctx, b, pool, store, exporter.NewStripeV1(client, 5*time.Second))
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE outbox_item_bodies, outbox_item_states"); err != nil {
		b.Fatal(err)
	}
	setup := time.Since(start)

	floor, floorCalls := summariesFloor(ctx, b, client, meter.ID, hour0)

	rec, err := reconcile.New(reconcile.Config{Outbox: store, Key: stripesim.DefaultKey, APIBase: srv.URL,
		Destination: func() (exporter.Destination, error) {
			return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: stripesim.DefaultAccount, Mode: outbox.ModeTest}, nil
		}, Limiter: exporter.NewLimiter(100000), InvoiceGrace: 72 * time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	runStart := time.Now()
	run, err := rec.RunNow(ctx, pool, reconcile.TriggerCommand, "bench", reconcile.Options{})
	elapsed := time.Since(runStart)
	b.StopTimer()
	if err != nil || run.ItemsConfirmed != benchCustomers*benchPerKey || run.Discrepancies != 0 {
		b.Fatalf("run %+v: %v", run, err)
	}
	// The next night's run: every key's period is open, so every hour is
	// read and compared again; nothing is left to confirm.
	againStart := time.Now()
	again, err := rec.RunNow(ctx, pool, reconcile.TriggerCommand, "bench", reconcile.Options{})
	reread := time.Since(againStart)
	if err != nil || again.KeysTotal != benchCustomers || again.HoursMatched != benchCustomers*benchPerKey || again.Discrepancies != 0 {
		b.Fatalf("run again %+v: %v", again, err)
	}
	fmt.Printf("\n%d accepted items over %d customers (one meter, %d hours each); setup (enqueue, send, accept) took %s\n",
		benchCustomers*benchPerKey, benchCustomers, benchPerKey, setup.Round(time.Second))
	fmt.Printf("%-48s %10s %12s %12s\n", "", "seconds", "Stripe calls", "items/s")
	fmt.Printf("%-48s %10.1f %12d %12s\n", "summaries alone, sequential, no database (floor)", floor.Seconds(), floorCalls, "")
	fmt.Printf("%-48s %10.1f %12d %12.0f\n", "reconcile run: compare and confirm all (T7)", elapsed.Seconds(), run.StripeCalls,
		float64(run.ItemsConfirmed)/elapsed.Seconds())
	fmt.Printf("%-48s %10.2fx\n", "run / floor", elapsed.Seconds()/floor.Seconds())
	fmt.Printf("%-48s %10.1f %12d %12.0f\n\n", "run again: the open period re-read, all matching", reread.Seconds(), again.StripeCalls,
		float64(again.HoursMatched)/reread.Seconds())
	b.ReportMetric(elapsed.Seconds(), "run_s")
	b.ReportMetric(reread.Seconds(), "reread_s")
	b.ReportMetric(float64(run.StripeCalls), "stripe_calls")
	b.ReportMetric(floor.Seconds(), "floor_s")
}

// The benchmark's size: its customers, and the hourly items of each.
const (
	benchCustomers = 1000
	benchPerKey    = 100
)

// enqueueBenchItems enqueues one item per customer and hour from hour0, in
// batches of 10,000, all of the calendar month of now: an open period.
func enqueueBenchItems(ctx context.Context, b *testing.B, pool *pgxpool.Pool, store *outbox.Store, hour0 time.Time) {
	now := time.Now().UTC()
	period := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC).Format(time.RFC3339)
	items := make([]outbox.NewItem, 0, 10000)
	for h := 0; h < benchPerKey; h++ {
		for c := 0; c < benchCustomers; c++ {
			items = append(items, outbox.NewItem{
				Identity: outbox.Identity{TenantKey: fmt.Sprintf("r%04d", c), SubjectKind: outbox.SubjectUsageWindow,
					SubjectRef: fmt.Sprintf("usage:api:bench:%d", h), Exporter: exporter.StripeMeterEvents,
					DestinationAccount: stripesim.DefaultAccount, Mode: outbox.ModeTest, MappingVersion: 1},
				Payload: outbox.Payload{Customer: fmt.Sprintf("cus_r%04d", c), EventName: "api", Value: int64(c%7 + h%5 + 1),
					Timestamp: hour0.Add(time.Duration(h)*time.Hour + 30*time.Minute).Unix(), Feature: "api", Period: period},
			})
			if len(items) == cap(items) {
				if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { _, err := store.EnqueueBatch(ctx, tx, items); return err }); err != nil {
					b.Fatal(err)
				}
				items = items[:0]
			}
		}
	}
}

// deliverBenchItems sends every pending item through exp with four
// workers and records the outcomes, as the deliverer would; every send
// must be accepted.
func deliverBenchItems(ctx context.Context, b *testing.B, pool *pgxpool.Pool, store *outbox.Store, exp *exporter.StripeV1) {
	var wg sync.WaitGroup
	var failed atomic.Int64
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				leases, err := store.Claim(ctx, pool, outbox.ClaimOptions{Owner: "bench", Limit: 500, Policy: outbox.BestEffort})
				if err != nil {
					b.Error(err)
					return
				}
				if len(leases) == 0 {
					return
				}
				outcomes := make([]outbox.Outcome, len(leases))
				for i, l := range leases {
					outcomes[i] = exp.Send(ctx, l)
					outcomes[i].Lease = l
					if outcomes[i].Kind != outbox.Accepted {
						failed.Add(1)
					}
				}
				if _, err := store.Record(ctx, pool, outcomes); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if failed.Load() > 0 {
		b.Fatalf("%d sends were not accepted", failed.Load())
	}
}

// summariesFloor reads every customer's summaries straight from the
// simulator, with no database: what Stripe's reads cost alone, and how
// many calls they take.
func summariesFloor(ctx context.Context, b *testing.B, client *stripeapi.Client, meterID string, hour0 time.Time) (time.Duration, int) {
	from, to := hour0.Unix(), hour0.Add(time.Duration(benchPerKey)*time.Hour).Unix()
	floorStart := time.Now()
	floorCalls := 0
	for c := 0; c < benchCustomers; c++ {
		s, err := client.EventSummaries(ctx, meterID, fmt.Sprintf("cus_r%04d", c), from, to, stripeapi.Hour)
		if err != nil || len(s) != benchPerKey {
			b.Fatalf("summaries of customer %d: %d, %v", c, len(s), err)
		}
		floorCalls += (len(s) + 99) / 100
	}
	return time.Since(floorStart), floorCalls
}
