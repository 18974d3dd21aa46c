package quarantine_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/tallymeter/tally/internal/testkit/benchstat"
	"github.com/tallymeter/tally/internal/testkit/history"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// BenchmarkCompletenessCounters measures, in one run: the completeness
// report of a month read from the counters against the full computation
// from the ledger (history.Load's fixture, TALLY_HISTORY_ROWS ledger rows,
// 1 million by default, loaded with COPY: 4,000 events an hour, so up to
// 2.9 million fall in one month), the counters' recount of the whole
// database (what migration 37 costs an existing one), and what the
// triggers add to ingest (one event a transaction, windowed and per-event
// features; batches of 100) and to a staging pass: each on a database with
// the triggers and one without, alternating.
//
//	TALLY_HISTORY_ROWS=1000000 go test ./quarantine -run '^$' -bench CompletenessCounters -benchtime 1x
func BenchmarkCompletenessCounters(b *testing.B) {
	size := history.Size{Rows: 1_000_000, Items: 250_000}
	if os.Getenv(history.EnvRows) != "" {
		var err error
		if size, err = history.SizeFrom(os.Getenv); err != nil {
			b.Fatal(err)
		}
	}
	ctx := context.Background()
	pool := testdb.New(b)
	must(b, history.Map(ctx, pool))
	now := time.Now().UTC()
	l, err := history.Load(ctx, pool, size, now)
	must(b, err)
	month := l.To.Add(-time.Hour).Format("2006-01")
	var events int64
	must(b, pool.QueryRow(ctx, `SELECT coalesce(sum(ingested_events), 0) FROM completeness_counters
		WHERE period = $1::timestamptz`, month+"-01T00:00:00Z").Scan(&events))
	fmt.Printf("\n%d ledger rows in %d items (COPY and recount %s); %d events in %s\n", size.Rows, size.Items,
		l.Copy.Round(time.Second), events, month)

	start := time.Now()
	_, err = pool.Exec(ctx, `SELECT completeness_recount('-infinity', 'infinity')`)
	must(b, err)
	recount := time.Since(start)
	fmt.Printf("recount of every period (the migration's backfill): %s, %.1f µs an event\n",
		recount.Round(time.Millisecond), float64(recount.Microseconds())/float64(size.Rows))
	_, err = pool.Exec(ctx, "VACUUM ANALYZE completeness_counters, completeness_items")
	must(b, err)

	a, err := quarantine.AuditCompleteness(ctx, pool, month, quarantine.AuditVerify, 0)
	must(b, err)
	if a.DriftKeys != 0 {
		b.Fatalf("the counters differ from the ledger: %v", a.Drift[:min(5, len(a.Drift))])
	}
	var cs, ls []time.Duration
	for i := range 5 {
		start := time.Now()
		c, err := quarantine.CompletenessOf(ctx, pool, month, "")
		cs = append(cs, time.Since(start))
		must(b, err)
		if len(c.Lines) != len(history.Tenants)*len(history.Features) || !c.Holds {
			b.Fatalf("the counters' report has %d lines, holds %v", len(c.Lines), c.Holds)
		}
		if i < 3 {
			start = time.Now()
			_, err = quarantine.LedgerCompletenessOf(ctx, pool, month, "")
			ls = append(ls, time.Since(start))
			must(b, err)
		}
	}
	c, lg := benchstat.Median(cs), benchstat.Median(ls)
	fmt.Printf("%-52s %12s %12s %8s\n", "completeness report of "+month+" (median)", "counters", "ledger", "ratio")
	fmt.Printf("%-52s %12s %12s %7.0fx\n", fmt.Sprintf("%d lines, %d events", len(history.Tenants)*len(history.Features), events),
		c.Round(10*time.Microsecond), lg.Round(time.Millisecond), float64(lg)/float64(c))
	b.ReportMetric(c.Seconds()*1000, "counters_ms")
	b.ReportMetric(lg.Seconds()*1000, "ledger_ms")

	// A busy node's counters are spread over every slot: the same keys,
	// sixteen rows each.
	_, err = pool.Exec(ctx, `INSERT INTO completeness_counters (period, tenant, feature, account, slot, bucket)
		SELECT period, tenant, feature, account, s, bucket FROM completeness_counters, generate_series(1, 15) s WHERE slot = 0`)
	must(b, err)
	_, err = pool.Exec(ctx, "VACUUM ANALYZE completeness_counters")
	must(b, err)
	cs = cs[:0]
	for range 5 {
		start := time.Now()
		_, err := quarantine.CompletenessOf(ctx, pool, month, "")
		cs = append(cs, time.Since(start))
		must(b, err)
	}
	fmt.Printf("%-52s %12s\n", "the same, every key in 16 slots", benchstat.Median(cs).Round(10*time.Microsecond))
	var rows, itemBytes, counterBytes, items int64
	must(b, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM completeness_counters), (SELECT count(*) FROM completeness_items),
		pg_total_relation_size('completeness_items'), pg_total_relation_size('completeness_counters')`).Scan(&rows, &items, &itemBytes, &counterBytes))
	fmt.Printf("completeness_items: %d rows, %d bytes a row with its indexes; completeness_counters: %d rows, %d bytes\n",
		items, itemBytes/max(items, 1), rows, counterBytes)

	benchTriggers(b)
}

// BenchmarkCompletenessTriggers is the second half of
// BenchmarkCompletenessCounters alone: what the counters' triggers add to
// ingest and staging.
//
//	go test ./quarantine -run '^$' -bench CompletenessTriggers -benchtime 1x
func BenchmarkCompletenessTriggers(b *testing.B) { benchTriggers(b) }

// benchTriggers times ingest and staging on a database with the counters'
// triggers and on one without them, alternating.
func benchTriggers(b *testing.B) {
	with, without := triggerEnv(b, true), triggerEnv(b, false)
	fmt.Printf("\n%-52s %12s %12s %8s\n", "cost of the triggers (median)", "without", "with", "ratio")
	for _, op := range []struct {
		name string
		reps int
		run  func(*stagetest.Env, int) time.Duration
	}{
		{"staging pass, 100 windows of 10 events", 11, stagePass(100, 10)},
		{"ingest, 1 event a transaction (window), 60 tx", 21, ingestSingles("calls", 60)},
		{"ingest, 1 event a transaction (per-event item), 30 tx", 21, ingestSingles("logins", 30)},
		{"ingest, 100 events a transaction, 5 tx", 21, ingestBatches(5, 100)},
	} {
		var ws, outs []time.Duration
		for i := range op.reps {
			outs, ws = append(outs, op.run(without, i)), append(ws, op.run(with, i))
		}
		w, o := benchstat.Median(ws), benchstat.Median(outs)
		fmt.Printf("%-52s %12s %12s %7.2fx\n", op.name, o.Round(10*time.Microsecond), w.Round(10*time.Microsecond), float64(w)/float64(o))
	}
	fmt.Println()
}

// triggerEnv is a staging path whose database has the counters' triggers,
// or has them disabled.
func triggerEnv(b *testing.B, triggers bool) *stagetest.Env {
	e := stagetest.New(b, outbox.Config{})
	e.Feature(b, "calls", mappings.Sum, time.Hour)
	e.Feature(b, "logins", mappings.Count, time.Hour)
	for i := range 200 {
		e.Tenant(b, fmt.Sprintf("t%03d", i), nil)
	}
	if !triggers {
		for _, s := range []string{
			`ALTER TABLE usage_events DISABLE TRIGGER usage_events_completeness_insert`,
			`ALTER TABLE usage_events DISABLE TRIGGER usage_events_completeness_update`,
			`ALTER TABLE outbox_item_states DISABLE TRIGGER outbox_item_states_completeness_insert`,
			`ALTER TABLE outbox_item_states DISABLE TRIGGER outbox_item_states_completeness_update`,
		} {
			_, err := e.Pool.Exec(e.Ctx, s)
			must(b, err)
		}
	}
	return e
}

func ingestSingles(feature string, n int) func(*stagetest.Env, int) time.Duration {
	return func(e *stagetest.Env, rep int) time.Duration {
		at := time.Now().UTC().Add(-30 * time.Minute)
		start := time.Now()
		for i := range n {
			tx, err := e.Pool.Begin(e.Ctx)
			must(nil, err)
			_, err = e.Ingester.Ingest(e.Ctx, tx, []meter.Event{{Tenant: fmt.Sprintf("t%03d", i%200), ID: fmt.Sprintf("%s-%d-%d", feature, rep, i),
				Feature: feature, Value: 1, Timestamp: &at}})
			must(nil, err)
			must(nil, tx.Commit(e.Ctx))
		}
		return time.Since(start)
	}
}

func ingestBatches(n, size int) func(*stagetest.Env, int) time.Duration {
	return func(e *stagetest.Env, rep int) time.Duration {
		at := time.Now().UTC().Add(-30 * time.Minute)
		start := time.Now()
		for i := range n {
			batch := make([]meter.Event, size)
			for j := range batch {
				batch[j] = meter.Event{Tenant: fmt.Sprintf("t%03d", j%200), ID: fmt.Sprintf("b-%d-%d-%d", rep, i, j),
					Feature: "calls", Value: 3, Timestamp: &at}
			}
			tx, err := e.Pool.Begin(e.Ctx)
			must(nil, err)
			_, err = e.Ingester.Ingest(e.Ctx, tx, batch)
			must(nil, err)
			must(nil, tx.Commit(e.Ctx))
		}
		return time.Since(start)
	}
}

// stagePass ingests windows × per events in a closed hour (one window per
// tenant and hour), then times the pass that stages them.
func stagePass(windows, per int) func(*stagetest.Env, int) time.Duration {
	return func(e *stagetest.Env, rep int) time.Duration {
		at := time.Now().UTC().Add(-time.Duration(3+rep) * time.Hour).Truncate(time.Hour).Add(10 * time.Minute) // a window of its own
		var batch []meter.Event
		for w := range windows {
			for j := range per {
				batch = append(batch, meter.Event{Tenant: fmt.Sprintf("t%03d", w%200), ID: fmt.Sprintf("s-%d-%d-%d", rep, w, j),
					Feature: "calls", Value: 2, Timestamp: &at})
			}
		}
		tx, err := e.Pool.Begin(e.Ctx)
		must(nil, err)
		_, err = e.Ingester.Ingest(e.Ctx, tx, batch)
		must(nil, err)
		must(nil, tx.Commit(e.Ctx))
		start := time.Now()
		_, err = e.Stager.Pass(e.Ctx, e.Pool)
		took := time.Since(start)
		must(nil, err)
		return took
	}
}

func must(b testing.TB, err error) {
	if err != nil {
		if b != nil {
			b.Fatal(err)
		}
		panic(err)
	}
}
