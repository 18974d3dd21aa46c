package history_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/benchstat"
	"github.com/tallymeter/tally/internal/testkit/history"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// BenchmarkHistory measures Tally's routine operations on a database with
// a long history (history.Load: TALLY_HISTORY_ROWS ledger rows, 20 million
// by default, and a quarter as many confirmed items) beside the same
// operations on an empty database in the same run. Each operation runs its
// reps times on each database, alternating between the two, so that the
// machine's drift over the run (on this 2-core machine a 2–20 ms operation
// moves by a fifth from one minute to the next) falls on both alike. It
// prints the fixture's load time, each operation's median time on both and
// their ratio.
//
//	TALLY_HISTORY_ROWS=200000 go test ./internal/testkit/history -run '^$' -bench History -benchtime 1x
func BenchmarkHistory(b *testing.B) {
	size, err := history.SizeFrom(os.Getenv)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	now := time.Now().UTC()
	empty, loaded := newRig(ctx, b, now), newRig(ctx, b, now)
	l, err := history.Load(ctx, loaded.pool, size, now)
	if err != nil {
		b.Fatal(err)
	}
	fmt.Printf("\nhistory: %d ledger rows, %d confirmed items (and attempts), %s to %s\n",
		l.Size.Rows, l.Size.Items, l.From.Format(time.DateOnly), l.To.Format(time.DateOnly))
	fmt.Printf("load: COPY %s (%.0f rows/s), VACUUM ANALYZE %s\n\n", l.Copy.Round(time.Second),
		float64(l.Size.Rows+2*l.Size.Items)/l.Copy.Seconds(), l.Vacuum.Round(time.Second))
	b.ReportMetric(l.Copy.Seconds(), "load_s")
	for _, r := range []*rig{empty, loaded} {
		r.prepare(ctx, b)
		// Both are measured with statistics of what they hold, as
		// autovacuum keeps a live database's: left alone, the empty
		// database's small tables were analysed at some moment mid-run,
		// and its plans changed under the measurement.
		_, err := r.pool.Exec(ctx, "ANALYZE")
		must(b, err)
	}
	b.ResetTimer()
	fmt.Printf("%-44s %12s %12s %8s\n", "operation (median)", "empty", "history", "ratio")
	for _, op := range operations {
		var es, hs []time.Duration
		for range op.reps {
			es, hs = append(es, op.run(empty, ctx, b)), append(hs, op.run(loaded, ctx, b))
		}
		e, h := benchstat.Median(es), benchstat.Median(hs)
		ratio := float64(h) / float64(e)
		fmt.Printf("%-44s %12s %12s %7.2fx\n", op.name, e.Round(10*time.Microsecond), h.Round(10*time.Microsecond), ratio)
		b.ReportMetric(ratio, op.metric+"_ratio")
	}
	fmt.Println()
}

// reps is how many times an operation that writes runs on each database;
// its median is reported. Each run adds to what the next one meets (a
// claim's 400 items left pending, a stage's ten windows), so they are
// fewer than readReps; with 7, a staging pass of 10–13 ms and a claim of
// 3 ms moved by a quarter between runs of the same code.
const reps = 15

// readReps is how many times an operation that leaves nothing for the next
// run to meet (the summary, the gauge's pass, the report) runs on each
// database. Their 3–20 ms swing by a third from one run to the next on
// this machine (the summary measured 0.59× and 1.33× in two runs of seven
// reps an hour apart, doing the same work on both databases): more reps
// keep that swing out of the median.
const readReps = 25

// freshTenants is how many tenants post usage in the fresh hour.
const freshTenants = 20

var operations = []struct {
	name, metric string
	reps         int
	run          func(r *rig, ctx context.Context, b *testing.B) time.Duration
}{
	// First: its later runs stage and send supplements (topUp), which
	// must not meet the pending items the claim operation leaves.
	{"reconcile run over a fresh hour (100 items)", "reconcile", reps, (*rig).reconcile},
	{"staging pass (10 new windows)", "stage", reps, (*rig).stagePass},
	{"claim batch (100 of 500 pending)", "claim", reps, (*rig).claim},
	{"GET /v1/outbox/summary (ReadGauge)", "summary", readReps, (*rig).summary},
	{"state gauge (maintenance pass)", "gauge", readReps, (*rig).gauge},
	{"completeness report, current month", "completeness", readReps, (*rig).completeness},
}

// rig is one database with the services the operations run.
type rig struct {
	pool       *pgxpool.Pool
	store      *outbox.Store
	stager     *meter.Stager
	ingest     *meter.Ingester
	exp        *exporter.StripeV1
	rec        *reconcile.Reconciler
	fresh      time.Time // the fresh hour: its usage is staged, sent and accepted by prepare
	stages     int       // staging passes run so far
	claims     int       // claim batches enqueued so far
	reconciled int       // reconcile runs so far
	env        []string  // of the commands BenchmarkMonth runs on it
}

func newRig(ctx context.Context, b testing.TB, now time.Time) *rig {
	sim := stripesim.New(stripesim.Options{Seed: 7})
	srv := httptest.NewServer(sim.Handler())
	b.Cleanup(func() { sim.Close(); srv.Close() })
	for _, f := range history.Features {
		sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: f, EventName: f, Formula: "sum"})
	}
	for _, t := range history.Tenants {
		sim.CreateCustomer(stripesim.DefaultAccount, history.Customer(t))
	}
	store, err := outbox.New(outbox.Config{}, nil)
	must(b, err)
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	must(b, err)
	dest := exporter.Destination{Exporter: history.Exporter, Account: history.Account, Mode: history.Mode}
	rec, err := reconcile.New(reconcile.Config{Outbox: store, Key: stripesim.DefaultKey, APIBase: srv.URL,
		Destination: func() (exporter.Destination, error) { return dest, nil }, Limiter: exporter.NewLimiter(100000)})
	must(b, err)
	target := meter.Target{Exporter: history.Exporter, Account: history.Account, Mode: history.Mode,
		AcceptPast: 35 * 24 * time.Hour, AcceptFuture: 5 * time.Minute, MaxValue: stripeapi.MaxValue,
		InvoiceGrace: meter.MaxInvoiceGrace, LateUsage: meter.LateSend}
	stager := &meter.Stager{Outbox: store, Target: func(context.Context) (meter.Target, bool) { return target, true }}
	r := &rig{pool: testdb.New(b), store: store, stager: stager, ingest: &meter.Ingester{Stager: stager},
		exp: exporter.NewStripeV1(client, 5*time.Second), rec: rec, fresh: now.Truncate(time.Hour).Add(-3 * time.Hour)}
	must(b, history.Map(ctx, r.pool))
	return r
}

// prepare posts the fresh hour's usage (every feature of freshTenants
// tenants, four events each), stages it and has the simulator accept it.
func (r *rig) prepare(ctx context.Context, b testing.TB) {
	var evs []meter.Event
	for _, t := range history.Tenants[:freshTenants] {
		for _, f := range history.Features {
			for j := range 4 {
				at := r.fresh.Add(time.Duration(j)*10*time.Minute + time.Second)
				evs = append(evs, meter.Event{ID: fmt.Sprintf("fresh-%s-%d", f, j), Tenant: t, Feature: f, Value: int64(j + 1), Timestamp: &at})
			}
		}
	}
	r.post(ctx, b, evs)
	r.stageAndAccept(ctx, b)
}

// topUp posts one more event in the fresh hour for each of its windows,
// after their items were sent: staging makes a supplement of each, which
// the simulator accepts.
func (r *rig) topUp(ctx context.Context, b testing.TB) {
	var evs []meter.Event
	for _, t := range history.Tenants[:freshTenants] {
		for _, f := range history.Features {
			at := r.fresh.Add(45*time.Minute + time.Duration(r.reconciled)*time.Second)
			evs = append(evs, meter.Event{ID: fmt.Sprintf("topup-%s-%d", f, r.reconciled), Tenant: t, Feature: f, Value: 2, Timestamp: &at})
		}
	}
	r.post(ctx, b, evs)
	r.stageAndAccept(ctx, b)
}

// stageAndAccept stages what was posted and has the simulator accept
// every item, then settles the gauge.
func (r *rig) stageAndAccept(ctx context.Context, b testing.TB) {
	_, err := r.stager.Pass(ctx, r.pool)
	must(b, err)
	for {
		leases, err := r.store.Claim(ctx, r.pool, outbox.ClaimOptions{Owner: "bench", Limit: 500, Policy: outbox.BestEffort})
		must(b, err)
		if len(leases) == 0 {
			r.settle(ctx, b)
			return
		}
		outcomes := make([]outbox.Outcome, len(leases))
		for i, l := range leases {
			outcomes[i] = r.exp.Send(ctx, l)
			outcomes[i].Lease = l
			if outcomes[i].Kind != outbox.Accepted {
				b.Fatalf("fresh item %d not accepted: %+v", l.ID, outcomes[i])
			}
		}
		_, err = r.store.Record(ctx, r.pool, outcomes)
		must(b, err)
	}
}

// settle runs maintenance passes, as every node does every 15 seconds,
// until the gauge's watermark has passed every item there is.
func (r *rig) settle(ctx context.Context, b testing.TB) {
	var watermarked bool
	must(b, r.pool.QueryRow(ctx, `SELECT to_regclass('outbox_gauge_settled') IS NOT NULL`).Scan(&watermarked))
	if !watermarked { // before migration 22: the figures the doc keeps
		return
	}
	for range 100 {
		_, err := r.store.Maintain(ctx, r.pool)
		must(b, err)
		var below, next int64
		must(b, r.pool.QueryRow(ctx, `SELECT (SELECT below FROM outbox_gauge_settled),
			(SELECT coalesce(max(id), 0) + 1 FROM outbox_item_states)`).Scan(&below, &next))
		if below == next {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	b.Fatal("the gauge's watermark never reached the last item")
}

func (r *rig) post(ctx context.Context, b testing.TB, evs []meter.Event) {
	must(b, pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error { _, err := r.ingest.Ingest(ctx, tx, evs); return err }))
}

// stagePass posts usage of two tenants in a closed hour before the fresh
// one (ten windows), then times the pass that stages it.
func (r *rig) stagePass(ctx context.Context, b *testing.B) time.Duration {
	r.stages++
	hour := r.fresh.Add(-time.Duration(r.stages) * time.Hour)
	var evs []meter.Event
	for _, t := range history.Tenants[freshTenants : freshTenants+2] {
		for _, f := range history.Features {
			at := hour.Add(17 * time.Minute)
			evs = append(evs, meter.Event{ID: fmt.Sprintf("stage-%d-%s", r.stages, f), Tenant: t, Feature: f, Value: 3, Timestamp: &at})
		}
	}
	r.post(ctx, b, evs)
	start := time.Now()
	res, err := r.stager.Pass(ctx, r.pool)
	took := time.Since(start)
	must(b, err)
	if res.Items != 10 {
		b.Fatalf("staging pass made %d items, want 10", res.Items)
	}
	return took
}

// claim enqueues 500 fresh pending items, then times a claim of 100.
func (r *rig) claim(ctx context.Context, b *testing.B) time.Duration {
	r.enqueue(ctx, b, "bench")
	start := time.Now()
	leases, err := r.store.Claim(ctx, r.pool, outbox.ClaimOptions{Owner: "bench", Limit: 100, Policy: outbox.BestEffort})
	took := time.Since(start)
	must(b, err)
	if len(leases) != 100 {
		b.Fatalf("claimed %d, want 100", len(leases))
	}
	return took
}

// enqueue enqueues 500 fresh pending items, their subjects named by kind
// and the count of claims so far.
func (r *rig) enqueue(ctx context.Context, b *testing.B, kind string) {
	r.claims++
	items := make([]outbox.NewItem, 500)
	for i := range items {
		t := history.Tenants[i%len(history.Tenants)]
		items[i] = outbox.NewItem{
			Identity: outbox.Identity{TenantKey: t, SubjectKind: outbox.SubjectUsageWindow,
				SubjectRef: fmt.Sprintf("usage:%s:%d:%d", kind, r.claims, i), Exporter: history.Exporter,
				DestinationAccount: history.Account, Mode: history.Mode, MappingVersion: 1},
			Payload: outbox.Payload{Customer: history.Customer(t), EventName: history.Features[0], Value: 1,
				Timestamp: r.fresh.Add(-30 * time.Hour).Unix(), Feature: history.Features[0], Period: "2026-01-01T00:00:00Z"},
		}
	}
	must(b, pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error { _, err := r.store.EnqueueBatch(ctx, tx, items); return err }))
}

func (r *rig) summary(ctx context.Context, b *testing.B) time.Duration {
	start := time.Now()
	_, err := r.store.ReadGauge(ctx, r.pool)
	must(b, err)
	return time.Since(start)
}

func (r *rig) gauge(ctx context.Context, b *testing.B) time.Duration {
	start := time.Now()
	_, err := r.store.Maintain(ctx, r.pool)
	must(b, err)
	return time.Since(start)
}

func (r *rig) completeness(ctx context.Context, b *testing.B) time.Duration {
	period := r.fresh.Format("2006-01")
	start := time.Now()
	c, err := quarantine.CompletenessOf(ctx, r.pool, period, "")
	took := time.Since(start)
	must(b, err)
	if len(c.Lines) < freshTenants*len(history.Features) {
		b.Fatalf("completeness of %s has %d lines", period, len(c.Lines))
	}
	return took
}

// reconcile times one run over the fresh hour, which confirms the 100
// items accepted since the last: the first run the fresh hour's windows
// (prepare), each later one a supplement of each window, posted, staged
// and accepted first (topUp).
func (r *rig) reconcile(ctx context.Context, b *testing.B) time.Duration {
	if r.reconciled > 0 {
		r.topUp(ctx, b)
	}
	r.reconciled++
	start := time.Now()
	run, err := r.rec.RunNow(ctx, r.pool, reconcile.TriggerCommand, "bench", reconcile.Options{Since: r.fresh})
	took := time.Since(start)
	must(b, err)
	if run.ItemsConfirmed != int64(freshTenants*len(history.Features)) {
		b.Fatalf("reconcile run confirmed %d items: %+v", run.ItemsConfirmed, run)
	}
	return took
}

func must(b testing.TB, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}
