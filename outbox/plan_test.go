package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// TestClaimNeverReadsTheLeasedKeyIndexWhole keeps migration 25's point: the
// "oldest expired leases" half of a claim must find them by the range scan
// of leased_expiry, not by reading every entry of leased_key (a heap fetch
// of every leased item on every claim), which the planner chose when its
// statistics held one leased row — the table analysed while nothing was
// leased, as it usually is. With leased_key's predicate requiring a key,
// only a probe of one key can use it. It fails on migration 24's schema.
func TestClaimNeverReadsTheLeasedKeyIndexWhole(t *testing.T) {
	t.Parallel()
	ctx, pool, store := planDB(t)
	enqueueCalls(t, pool, store, 0, 2000)
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE outbox_item_states"); err != nil {
		t.Fatal(err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	for range 4 { // 400 live leases, none expired
		if _, err := store.Claim(ctx, conn.Conn(), ClaimOptions{Owner: "plan", Limit: 100, Policy: PerKey, Lease: time.Hour}); err != nil {
			t.Fatal(err)
		}
	}

	args := claimPlanArgs()
	for _, c := range claimPlanStatements {
		args["per_key"] = c.perKey
		// EXPLAIN without ANALYZE plans the statement and runs nothing.
		var plan []map[string]any
		if err := conn.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+c.sql, args).Scan(&plan); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		for _, n := range testdb.PlanNodes(plan[0]["Plan"]) {
			if n["Index Name"] == "outbox_item_states_leased_key" && n["Index Cond"] == nil {
				b, _ := json.Marshal(n)
				t.Errorf("%s: the plan reads leased_key whole: %s", c.name, b)
			}
		}
	}
}

// claimPlanStatements are the one-statement claims the plan tests
// explain, with whether each leases per key.
var claimPlanStatements = []struct {
	name, sql string
	perKey    bool
}{
	{"BestEffort", sqlClaimBestEffort, false},
	{"PerKey, first try", sqlClaimPerKeyOne, true},
}

// claimPlanArgs are the arguments of a claim of 100 at the defaults, but
// "per_key", which each statement sets.
func claimPlanArgs() pgx.NamedArgs {
	return pgx.NamedArgs{"owner": "plan", "limit": 100, "scan": 400, "lease": time.Hour, "max": DefaultMaxAttempts,
		"horizon": DefaultHorizon, "accept_past": 24 * time.Hour, "accept_future": time.Hour}
}

// planDB is a fresh database and a Store with the default configuration.
func planDB(t *testing.T) (context.Context, *pgxpool.Pool, *Store) {
	t.Helper()
	store, err := New(Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	pool := testdb.New(t)
	// Autovacuum analyses a table after a tenth of it changed, which a
	// test's backlog always is: off, the statistics stay as the test set
	// them, as on a table too large for its backlog to trigger one.
	if _, err := pool.Exec(context.Background(), "ALTER TABLE outbox_item_states SET (autovacuum_enabled = off)"); err != nil {
		t.Fatal(err)
	}
	return context.Background(), pool, store
}

// backlogUnseen is a fresh database whose state table was analysed while
// it held leased items only (leased, a multiple of 100), and which then
// got a backlog of pending items its statistics have not seen: how
// autovacuum leaves a large table, which it analyses only after a tenth
// of it changed.
func backlogUnseen(t *testing.T, leased, backlog int) (context.Context, *pgxpool.Pool, *Store) {
	t.Helper()
	ctx, pool, store := planDB(t)
	enqueueCalls(t, pool, store, 0, leased)
	for range leased / 100 {
		if _, err := store.Claim(ctx, pool, ClaimOptions{Owner: "plan", Limit: 100, Policy: BestEffort, Lease: time.Hour}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE outbox_item_states"); err != nil {
		t.Fatal(err)
	}
	enqueueCalls(t, pool, store, leased, backlog)
	return ctx, pool, store
}

// enqueueCalls enqueues n pending items in one transaction, each of its own
// customer (an ordering key each), numbered from from.
func enqueueCalls(t *testing.T, pool *pgxpool.Pool, store *Store, from, n int) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for i := from; i < from+n; i++ {
		it := NewItem{
			Identity: Identity{TenantKey: "acme", SubjectKind: SubjectUsageEvent, SubjectRef: fmt.Sprintf("event:calls:e%d", i),
				Exporter: "stripe_meter_events", DestinationAccount: "acct_123", Mode: ModeTest, MappingVersion: 1},
			Payload: Payload{Customer: fmt.Sprintf("cus_%d", i), EventName: "calls", Value: 1, Timestamp: 1796000000,
				Feature: "calls", Period: "2026-11-01T00:00:00Z"},
		}
		if _, err := store.Enqueue(ctx, tx, it); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// explained is one claim statement as EXPLAIN ANALYZE ran it: the state
// rows it read (returned, removed by a filter or an index recheck, over
// every loop) and its plan as JSON.
type explained struct {
	read float64
	plan []byte
}

// explainClaims runs every claim statement of claimPlanStatements, with
// filter applied and args (per_key set for each), under EXPLAIN ANALYZE in
// a transaction it rolls back, by statement name.
func explainClaims(t *testing.T, ctx context.Context, pool *pgxpool.Pool, filter claimFilter, args pgx.NamedArgs) map[string]explained {
	t.Helper()
	out := map[string]explained{}
	for _, c := range claimPlanStatements {
		args["per_key"] = c.perKey
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var plan []map[string]any
		err = tx.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+filter.apply(c.sql), pgx.QueryExecModeExec, args).Scan(&plan)
		_ = tx.Rollback(ctx)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		var e explained
		for _, n := range testdb.PlanNodes(plan[0]["Plan"]) {
			if rel, _ := n["Relation Name"].(string); rel == "outbox_item_states" {
				rows, _ := n["Actual Rows"].(float64)
				loops, _ := n["Actual Loops"].(float64)
				removed, _ := n["Rows Removed by Filter"].(float64)
				recheck, _ := n["Rows Removed by Index Recheck"].(float64)
				e.read += (rows + removed + recheck) * max(loops, 1)
			}
		}
		e.plan, _ = json.Marshal(plan)
		out[c.name] = e
	}
	return out
}

// TestGaugeReadsOneEntryForTheOldestPending keeps the gauge's oldest
// pending item one index entry away whatever the statistics say: asked
// as min(created_at), the planner read every pending entry to find the
// smallest where its statistics said almost nothing was pending (the table
// analysed before a backlog, as here), a million reads for a backlog of a
// million on every GET /v1/outbox/summary and maintenance pass.
func TestGaugeReadsOneEntryForTheOldestPending(t *testing.T) {
	t.Parallel()
	ctx, pool, _ := backlogUnseen(t, 1000, 3000)

	var below, items int64
	if err := pool.QueryRow(ctx, sqlGaugeSettled).Scan(&below, &items); err != nil {
		t.Fatal(err)
	}
	var plan []map[string]any
	if err := pool.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+sqlGauge, pgx.QueryExecModeExec,
		pgx.NamedArgs{"below": below, "items": items}).Scan(&plan); err != nil {
		t.Fatal(err)
	}
	var found bool
	for _, n := range testdb.PlanNodes(plan[0]["Plan"]) {
		if n["Node Type"] != "Limit" {
			continue
		}
		for _, c := range testdb.PlanNodes(n)[1:] {
			if c["Index Name"] == "outbox_item_states_pending_created" {
				found = true
				if rows, _ := c["Actual Rows"].(float64); rows > 1 {
					t.Errorf("the oldest pending item took %v index entries", rows)
				}
			}
		}
	}
	if !found {
		b, _ := json.Marshal(plan)
		t.Errorf("no Limit over pending_created: the oldest pending item is found by reading every pending entry: %s", b)
	}
}

// TestClaimReadsNoBacklogItWillNotLease keeps a claim's cost independent of
// the backlog when the statistics have not seen it (the table analysed
// while nothing was pending, then a backlog: the usual case, since
// autovacuum analyses a large table only after a tenth of it changed).
// The claim must lease its rows by the primary key, and pick them from the
// head of pending_due in its order: planned for "one pending row", the
// lease's UPDATE read every pending item through a BitmapOr of the
// pending and leased partial indexes and filtered them by id (6,000 rows
// removed for a claim of 100 in BenchmarkHistory, growing with every
// claim), and the pick could read pending_created whole and sort it.
func TestClaimReadsNoBacklogItWillNotLease(t *testing.T) {
	t.Parallel()
	ctx, pool, _ := backlogUnseen(t, 200, 3000)

	for name, e := range explainClaims(t, ctx, pool, claimFilter{}, claimPlanArgs()) {
		// The pick reads about the 100 it leases (PerKey also the keys'
		// other items it steps over: one each here), the lease 100 more.
		if e.read > 600 {
			t.Errorf("%s: %v state rows read to lease 100 of a backlog of 3,000: %s", name, e.read, e.plan)
		}
	}
}
