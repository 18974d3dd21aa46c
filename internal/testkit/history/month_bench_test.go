package history_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/archive"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/benchstat"
	"github.com/tallymeter/tally/internal/testkit/history"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// EnvMonthEvents sets BenchmarkMonth's large month: its events (default
// 100 million).
const envMonthEvents = "TALLY_MONTH_EVENTS"

// smallMonth is the events of the month every figure is compared with.
const smallMonth = 1_000_000

// The disk a month takes, per event and per item, with indexes and the
// margin a load's sorts and WAL need on top: what the refusal to start
// counts, from the figures BenchmarkMonth prints.
const (
	diskPerEvent = 400  // ledger row, its key, the archive's share
	diskPerItem  = 3000 // item, state, attempt, completeness aggregate
	diskSlack    = 8 << 30
)

// monthDisk is the free space a month of events needs.
func monthDisk(events, items int64) int64 {
	return events*diskPerEvent + items*diskPerItem
}

// BenchmarkMonth loads a month of TALLY_MONTH_EVENTS events (100 million
// by default) and a month of 1 million by COPY, the same tenants, features
// and hourly items in each, into two databases of a durable cluster on
// disk; refuses to start when the disk has not the room; and then runs, on
// each month, alternating: the completeness report, a staging pass of ten
// windows and one of a day's windows, a reconcile run, claim and accept,
// the maintenance pass before and beside a backlog of a million pending
// items, and the commands of the month's close (the report, its --verify,
// archive, archive verify and archive detach) as processes of their own,
// with each one's peak RSS. It prints each figure for both months and their
// ratio, and the bytes of each event and item.
//
//	make bench-month
func BenchmarkMonth(b *testing.B) {
	events := int64(100_000_000)
	if v := os.Getenv(envMonthEvents); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < smallMonth {
			b.Fatalf("%s: a whole number of at least %d, got %q", envMonthEvents, smallMonth, v)
		}
		events = n
	}
	now := time.Now().UTC()
	cur := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC)
	month := cur.AddDate(0, -2, 0) // over, and so is the month after it: it may be detached
	period, before := month.Format("2006-01"), month.AddDate(0, -1, 0).Format("2006-01")
	items := history.MonthItems(month)

	need := monthDisk(events, items) + monthDisk(smallMonth, items) + diskSlack
	free, err := freeBytes(os.TempDir())
	if err != nil {
		b.Fatalf("the free space of %s: %v", os.TempDir(), err)
	}
	fmt.Printf("\nmonth %s: %d events and %d events, %d items each; needs %.1f GB free in %s, has %.1f GB\n",
		period, events, int64(smallMonth), items, gb(need), os.TempDir(), gb(free))
	if os.Getenv(testdb.EnvURL) == "" && free < need {
		b.Fatalf("not enough disk: %.1f GB free in %s, the months need %.1f GB (set TMPDIR to a larger disk, or %s lower)",
			gb(free), os.TempDir(), gb(need), envMonthEvents)
	}
	tally := buildTally(b)

	ctx := context.Background()
	small, big := newRig(ctx, b, now), newRig(ctx, b, now)
	sizes := map[*rig]int64{small: smallMonth, big: events}
	for _, r := range []*rig{small, big} {
		l, err := history.LoadMonth(ctx, r.pool, month, sizes[r])
		must(b, err)
		fmt.Printf("%d events: COPY, keys and recount %s (%.0f events/s), VACUUM ANALYZE %s\n", sizes[r],
			l.Copy.Round(time.Second), float64(sizes[r])/l.Copy.Seconds(), l.Vacuum.Round(time.Second))
		printBytes(ctx, b, r.pool, month, sizes[r], items)
	}
	for _, r := range []*rig{small, big} {
		r.prepare(ctx, b)
		_, err := r.pool.Exec(ctx, "ANALYZE")
		must(b, err)
	}
	b.ResetTimer()

	fmt.Printf("\n%-52s %12s %12s %8s\n", "operation (median)", "1M events", "large", "ratio")
	row := func(name string, s, l time.Duration) {
		fmt.Printf("%-52s %12s %12s %7.2fx\n", name, s.Round(10*time.Microsecond), l.Round(10*time.Microsecond),
			float64(l)/float64(s))
	}
	each := func(name string, n int, op func(*rig) time.Duration) {
		var ss, ls []time.Duration
		for range n {
			ss, ls = append(ss, op(small)), append(ls, op(big))
		}
		row(name, benchstat.Median(ss), benchstat.Median(ls))
	}
	report := func(r *rig) time.Duration { return r.report(ctx, b, period) }
	each("completeness report of the month (counters)", readReps, report)
	each("reconcile run over a fresh hour (100 items)", reps, func(r *rig) time.Duration { return r.reconcile(ctx, b) })
	each("staging pass (10 new windows)", reps, func(r *rig) time.Duration { return r.stagePass(ctx, b) })
	each("staging pass of a day's windows (24,000 windows)", 1, func(r *rig) time.Duration { return r.stageDay(ctx, b) })
	each("claim 100 and accept them (of 500 pending)", reps, func(r *rig) time.Duration { return r.claimAccept(ctx, b) })
	each("maintenance pass (sweep and gauge)", readReps, func(r *rig) time.Duration { return r.gauge(ctx, b) })
	for _, r := range []*rig{small, big} {
		r.backlog(ctx, b, 1_000_000)
	}
	each("sweep beside 1M pending items", readReps, func(r *rig) time.Duration { return r.sweep(ctx, b) })
	each("maintenance pass beside 1M pending items", readReps, func(r *rig) time.Duration { return r.gauge(ctx, b) })
	each("claim 100 and accept them beside 1M pending", reps, func(r *rig) time.Duration { return r.claimAccept(ctx, b) })

	// The month's close, each command a process of its own.
	fmt.Printf("\n%-52s %12s %12s %8s %10s %10s\n", "command (one run)", "1M events", "large", "ratio", "RSS 1M", "RSS large")
	before0 := map[*rig]quarantine.Completeness{}
	for _, r := range []*rig{small, big} {
		c, err := newReports(b).Completeness(ctx, r.pool, period, "", true)
		must(b, err)
		before0[r] = c
		r.env = []string{"TALLY_DATABASE_URL=" + testdb.URLOf(b, r.pool), "TALLY_ARCHIVE_URL=" + b.TempDir(),
			"TALLY_LOG_LEVEL=error"}
	}
	for _, c := range []struct {
		name string
		args []string
	}{
		{"tally report completeness (counters)", []string{"report", "completeness", "--period", period, "--format", "json"}},
		{"tally archive (the month before: empty)", []string{"archive", before}},
		{"tally archive verify (the month before)", []string{"archive", "verify", before}},
		{"tally archive", []string{"archive", period}},
		{"tally archive verify", []string{"archive", "verify", period}},
		{"tally report completeness --verify", []string{"report", "completeness", "--period", period, "--verify"}},
		{"tally archive detach", []string{"archive", "detach", period}},
		{"tally report completeness (after the detach)", []string{"report", "completeness", "--period", period, "--format", "json"}},
	} {
		s, l := command(b, tally, small, c.args), command(b, tally, big, c.args)
		if l.failed != "" { // the audit's statement bound: printed, and the close goes on
			fmt.Printf("%-52s %12s %12s %8s %9.0fM %9.0fM\n", c.name, s.took.Round(time.Millisecond), "failed after "+
				l.took.Round(time.Second).String(), "", float64(s.peak)/(1<<20), float64(l.peak)/(1<<20))
			fmt.Printf("  %s\n", l.failed)
			continue
		}
		fmt.Printf("%-52s %12s %12s %7.2fx %9.0fM %9.0fM\n", c.name, s.took.Round(time.Millisecond), l.took.Round(time.Millisecond),
			float64(l.took)/float64(s.took), float64(s.peak)/(1<<20), float64(l.peak)/(1<<20))
		b.ReportMetric(float64(l.peak)/(1<<20), strings.ReplaceAll(strings.Join(c.args[:min(2, len(c.args))], "_"), "-", "")+"_peak_MB")
	}
	var ss, ls []time.Duration
	for range readReps {
		ss, ls = append(ss, small.report(ctx, b, period)), append(ls, big.report(ctx, b, period))
	}
	row("completeness report of the month, after the detach", benchstat.Median(ss), benchstat.Median(ls))
	for _, r := range []*rig{small, big} {
		c, err := newReports(b).Completeness(ctx, r.pool, period, "", true)
		must(b, err)
		if !reflect.DeepEqual(c.Lines, before0[r].Lines) {
			b.Fatalf("the report of %s changed with the detach of its month (%d events)", period, sizes[r])
		}
	}
	fmt.Println()
}

// report times the completeness report of period as a node's API answers
// it, computed afresh.
func (r *rig) report(ctx context.Context, b *testing.B, period string) time.Duration {
	reports := newReports(b)
	start := time.Now()
	c, err := reports.Completeness(ctx, r.pool, period, "", true)
	took := time.Since(start)
	must(b, err)
	if len(c.Lines) != len(history.Tenants)*len(history.Features) || !c.Holds {
		b.Fatalf("the report of %s has %d lines, holds %v", period, len(c.Lines), c.Holds)
	}
	return took
}

// newReports is a node's report of the month (Reports), answering a
// detached month from its archive, computed for every request.
func newReports(b *testing.B) *quarantine.Reports {
	r, err := quarantine.NewReports(0, prometheus.NewRegistry())
	must(b, err)
	r.Archived = archive.DetachedReport
	return r
}

// stageDay posts four events in every window of a day of the month before
// the fresh hour's (every tenant, every feature, 24 hours), then times the
// staging pass that stages them, two parts at once as two workers do.
func (r *rig) stageDay(ctx context.Context, b *testing.B) time.Duration {
	day := r.fresh.Add(-48 * time.Hour).Truncate(24 * time.Hour)
	evs := make([]meter.Event, 0, 1000)
	for h := range 24 {
		for _, t := range history.Tenants {
			for _, f := range history.Features {
				for j := range 4 {
					at := day.Add(time.Duration(h)*time.Hour + time.Duration(j)*11*time.Minute)
					evs = append(evs, meter.Event{ID: fmt.Sprintf("day-%d-%s-%d", h, f, j), Tenant: t, Feature: f, Value: 2, Timestamp: &at})
				}
			}
			if len(evs) >= 1000 {
				r.post(ctx, b, evs)
				evs = evs[:0]
			}
		}
	}
	r.post(ctx, b, evs)
	parts := meter.Parts(2)
	results := make([]meter.PassResult, len(parts))
	errs := make(chan error, len(parts))
	start := time.Now()
	for i, p := range parts {
		go func() {
			var err error
			results[i], err = r.stager.PassPart(ctx, r.pool, p)
			errs <- err
		}()
	}
	for range parts {
		must(b, <-errs)
	}
	took := time.Since(start)
	if n := results[0].Items + results[1].Items; n != 24*len(history.Tenants)*len(history.Features) {
		b.Fatalf("staging a day made %d items", n)
	}
	return took
}

// claimAccept enqueues 500 fresh pending items, then times a claim of 100
// and the record of their acceptance.
func (r *rig) claimAccept(ctx context.Context, b *testing.B) time.Duration {
	r.enqueue(ctx, b, "bench-accept")
	start := time.Now()
	leases, err := r.store.Claim(ctx, r.pool, outbox.ClaimOptions{Owner: "bench", Limit: 100, Policy: outbox.BestEffort})
	must(b, err)
	outcomes := make([]outbox.Outcome, len(leases))
	for i, l := range leases {
		outcomes[i] = outbox.Outcome{Lease: l, Kind: outbox.Accepted, ProviderRef: "req_bench"}
	}
	_, err = r.store.Record(ctx, r.pool, outcomes)
	took := time.Since(start)
	must(b, err)
	if len(leases) != 100 {
		b.Fatalf("claimed %d, want 100", len(leases))
	}
	return took
}

func (r *rig) sweep(ctx context.Context, b *testing.B) time.Duration {
	start := time.Now()
	_, err := r.store.Sweep(ctx, r.pool)
	must(b, err)
	return time.Since(start)
}

// backlog copies n pending items that were never sent (a Stripe outage's
// backlog) into the outbox, then settles the gauge over them.
func (r *rig) backlog(ctx context.Context, b *testing.B, n int64) {
	var next int64
	must(b, r.pool.QueryRow(ctx, `SELECT nextval(pg_get_serial_sequence('outbox_item_bodies', 'id'))`).Scan(&next))
	created := r.fresh.Add(-2 * time.Hour)
	conn, err := r.pool.Acquire(ctx)
	must(b, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, "SET session_replication_role = replica")
	must(b, err)
	defer func() { _, _ = conn.Exec(context.Background(), "RESET session_replication_role") }()
	var i int64
	_, err = conn.Conn().CopyFrom(ctx, pgx.Identifier{"outbox_item_bodies"}, []string{"id", "tenant_key", "subject_kind",
		"subject_ref", "exporter", "destination_account", "mode", "mapping_version", "payload", "created_at", "bucket"},
		pgx.CopyFromFunc(func() ([]any, error) {
			if i >= n {
				return nil, nil
			}
			t := history.Tenants[i%int64(len(history.Tenants))]
			id := outbox.Identity{TenantKey: t, SubjectKind: outbox.SubjectUsageWindow, SubjectRef: fmt.Sprintf("usage:backlog:%d", i),
				Exporter: history.Exporter, DestinationAccount: history.Account, Mode: history.Mode, MappingVersion: 1}
			p, _ := json.Marshal(outbox.Payload{Customer: history.Customer(t), EventName: history.Features[0], Value: 1,
				Timestamp: created.Unix(), Identifier: id.Identifier(), Feature: history.Features[0],
				Period: r.fresh.Format("2006-01") + "-01T00:00:00Z"})
			i++
			return []any{next + i - 1, t, string(outbox.SubjectUsageWindow), id.SubjectRef,
				history.Exporter, history.Account, string(history.Mode), 1, p, created, tenantbucket.Of(t)}, nil
		}))
	must(b, err)
	i = 0
	_, err = conn.Conn().CopyFrom(ctx, pgx.Identifier{"outbox_item_states"}, []string{"id", "exporter", "mode",
		"ordering_key", "state", "attempts", "next_attempt_at", "created_at", "updated_at", "bucket"},
		pgx.CopyFromFunc(func() ([]any, error) {
			if i >= n {
				return nil, nil
			}
			t := history.Tenants[i%int64(len(history.Tenants))]
			i++
			return []any{next + i - 1, history.Exporter, string(history.Mode),
				history.Account + "|" + history.Customer(t) + "|" + history.Features[0], string(outbox.StatePending), 0,
				created, created, created, tenantbucket.Of(t)}, nil
		}))
	must(b, err)
	_, err = conn.Exec(ctx, `SELECT setval(pg_get_serial_sequence('outbox_item_bodies', 'id'), $1)`, next+n-1)
	must(b, err)
	_, err = conn.Exec(ctx, "VACUUM ANALYZE outbox_item_bodies, outbox_item_states")
	must(b, err)
	r.settle(ctx, b)
}

// printBytes prints what month's ledger rows, their keys and items take,
// with their indexes, per event and per item.
func printBytes(ctx context.Context, b *testing.B, pool *pgxpool.Pool, month time.Time, events, items int64) {
	var ledger, keys, itemBytes, aggregates int64
	must(b, pool.QueryRow(ctx, `SELECT pg_total_relation_size(usage_events_month_name($1::date)),
		pg_total_relation_size('usage_event_keys'),
		pg_total_relation_size('outbox_item_bodies') + pg_total_relation_size('outbox_item_states')
			+ pg_total_relation_size('outbox_attempts'),
		pg_total_relation_size('completeness_items')`, month).Scan(&ledger, &keys, &itemBytes, &aggregates))
	fmt.Printf("  bytes with indexes: ledger %.0f and key %.0f an event; item (body, state, attempt) %.0f and its completeness aggregate %.0f an item; %.1f GB in all\n",
		float64(ledger)/float64(events), float64(keys)/float64(events), float64(itemBytes)/float64(items),
		float64(aggregates)/float64(items), gb(ledger+keys+itemBytes+aggregates))
}

// commandRun is one command's wall time and peak RSS, and why it failed.
type commandRun struct {
	took   time.Duration
	peak   int64 // bytes
	failed string
}

// command runs tally with args against r's database and fails unless it
// exits 0; the audit (--verify) may fail on its statement bound, which is
// a figure of its own.
func command(b *testing.B, tally string, r *rig, args []string) commandRun {
	b.Helper()
	c := exec.Command(tally, args...)
	c.Env = append(os.Environ(), r.env...)
	var buf bytes.Buffer
	c.Stdout, c.Stderr = &buf, &buf
	start := time.Now()
	err := c.Start()
	var run commandRun
	if err == nil {
		peak := watchPeak(c.Process.Pid)
		err = c.Wait()
		run = commandRun{took: time.Since(start), peak: peak(c.ProcessState)}
	}
	out := buf.Bytes()
	if err != nil {
		if slices.Contains(args, "--verify") && strings.Contains(string(out), "statement timeout") {
			run.failed = strings.TrimSpace(string(out))
			return run
		}
		b.Fatalf("tally %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return run
}

// buildTally builds the tally command into a temporary directory.
func buildTally(b *testing.B) string {
	b.Helper()
	bin := filepath.Join(b.TempDir(), "tally")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/tallymeter/tally/cmd/tally").CombinedOutput(); err != nil {
		b.Fatalf("building tally: %v\n%s", err, out)
	}
	return bin
}

func gb(n int64) float64 { return float64(n) / (1 << 30) }
