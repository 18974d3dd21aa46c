package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// enqueueNamed enqueues n pending items of event name on account, each of
// its own customer, numbered from from, for exporter.
func enqueueNamed(t *testing.T, pool *pgxpool.Pool, store *Store, account, eventName, exporter string, from, n int) {
	t.Helper()
	ctx := context.Background()
	items := make([]NewItem, 0, n)
	for i := from; i < from+n; i++ {
		items = append(items, NewItem{
			Identity: Identity{TenantKey: "acme", SubjectKind: SubjectUsageEvent, SubjectRef: fmt.Sprintf("event:%s:e%d", eventName, i),
				Exporter: exporter, DestinationAccount: account, Mode: ModeTest, MappingVersion: 1},
			Payload: Payload{Customer: fmt.Sprintf("cus_%d", i), EventName: eventName, Value: 1, Timestamp: 1796000000,
				Feature: eventName, Period: "2026-11-01T00:00:00Z"},
		})
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { _, err := store.EnqueueBatch(ctx, tx, items); return err }); err != nil {
		t.Fatal(err)
	}
}

// claimRowsRead explains a claim of 100 of stripe_meter_events that skips
// skip, under each claim statement.
func claimRowsRead(t *testing.T, ctx context.Context, pool *pgxpool.Pool, skip []string) map[string]explained {
	t.Helper()
	args := claimPlanArgs()
	args["skip"] = skip
	return explainClaims(t, ctx, pool, claimFilter{exporter: "stripe_meter_events", skip: true}, args)
}

// A paused event name's backlog, due before every other item, is read by
// every claim that skips it until it is parked: parked, it costs a claim
// nothing. Park moves only the skipped keys' due items of its exporter,
// spends no attempt and changes no state; a second park finds nothing
// due; Unpark makes them due again, and a claim without the skip takes
// them. A skipped account parks all of its event names.
func TestParkSparesClaimsTheSkippedBacklog(t *testing.T) {
	t.Parallel()
	// The statistics have not seen the backlog, as on a large table; the
	// 200 leased items are of another account.
	ctx, pool, store := planDB(t)
	enqueueNamed(t, pool, store, "acct_other", "calls", "stripe_meter_events", 100000, 200)
	if _, err := store.Claim(ctx, pool, ClaimOptions{Owner: "plan", Limit: 200, Policy: BestEffort, Lease: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE outbox_item_states"); err != nil {
		t.Fatal(err)
	}
	const backlog = 3000
	enqueueNamed(t, pool, store, "acct_123", "calls", "stripe_meter_events", 0, backlog)
	enqueueNamed(t, pool, store, "acct_123", "calls", "stripe_meter_event_stream", backlog, 50)
	enqueueNamed(t, pool, store, "acct_123", "other", "stripe_meter_events", backlog+50, 100)
	skip := []string{MeterSkipKey("acct_123", "calls")}

	for name, e := range claimRowsRead(t, ctx, pool, skip) {
		if e.read < backlog {
			t.Errorf("%s: %v rows read before the park: the test's backlog is not in the claims' way", name, e.read)
		}
	}
	n, err := store.Park(ctx, pool, "stripe_meter_events", skip, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if n != backlog {
		t.Fatalf("parked %d, want the %d due items of the paused name and exporter", n, backlog)
	}
	for name, e := range claimRowsRead(t, ctx, pool, skip) {
		if e.read > 600 {
			t.Errorf("%s: %v state rows read to lease 100 beside a parked backlog of %d: %s", name, e.read, backlog, e.plan)
		}
	}
	var attempted, otherParked int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE attempts > 0 OR state <> 'pending'),
			count(*) FILTER (WHERE next_attempt_at > clock_timestamp() AND (exporter <> 'stripe_meter_events' OR ordering_key NOT LIKE '%|calls'))
		FROM outbox_item_states WHERE ordering_key LIKE 'acct\_123|%'`).Scan(&attempted, &otherParked); err != nil {
		t.Fatal(err)
	}
	if attempted != 0 || otherParked != 0 {
		t.Fatalf("%d items attempted or moved, %d items of other names or exporters parked", attempted, otherParked)
	}
	if n, err := store.Park(ctx, pool, "stripe_meter_events", skip, time.Minute); err != nil || n != 0 {
		t.Fatalf("a second park moved %d (%v): nothing is due", n, err)
	}

	if n, err := store.Unpark(ctx, pool, "stripe_meter_events", skip, time.Minute); err != nil || n != backlog {
		t.Fatalf("unparked %d (%v), want %d", n, err, backlog)
	}
	leases, err := store.Claim(ctx, pool, ClaimOptions{Owner: "t", Limit: 1000, Policy: BestEffort, Exporter: "stripe_meter_events"})
	if err != nil {
		t.Fatal(err)
	}
	if len(leases) != 1000 {
		t.Fatalf("claimed %d after the unpark, want 1000", len(leases))
	}

	// A stalled account: every name of it, this exporter's.
	if n, err := store.Park(ctx, pool, "stripe_meter_events", []string{"acct_123"}, time.Minute); err != nil || n != backlog-1000+100 {
		t.Fatalf("parked %d (%v) of the account, want %d", n, err, backlog-1000+100)
	}
}
