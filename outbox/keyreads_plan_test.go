package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// TestKeyItemsReadsTheRangeNotTheKeysHistory keeps reconciliation's read of
// a key's open billing periods proportional to the items in them: beside
// 3,000 items of the same key in earlier months, KeyItems over one range
// reads that range's items (the key-and-time index), whatever the key's
// history, on the generic plan it runs on.
func TestKeyItemsReadsTheRangeNotTheKeysHistory(t *testing.T) {
	t.Parallel()
	ctx, pool, store := planDB(t)
	const key, month = "acct_123|cus_k|calls", int64(30 * 24 * 3600)
	now := int64(1796000000)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3050 {
		ts := now - month - int64(i)*3600 // history: the months before
		if i >= 3000 {
			ts = now - int64(i-3000)*3600 // the range read: the last 50 hours
		}
		it := NewItem{
			Identity: Identity{TenantKey: "acme", SubjectKind: SubjectUsageEvent, SubjectRef: fmt.Sprintf("event:calls:k%d", i),
				Exporter: "stripe_meter_events", DestinationAccount: "acct_123", Mode: ModeTest, MappingVersion: 1},
			Payload: Payload{Customer: "cus_k", EventName: "calls", Value: 1, Timestamp: ts, Feature: "calls",
				Period: "2026-11-01T00:00:00Z"},
		}
		if _, err := store.Enqueue(ctx, tx, it); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE outbox_item_bodies, outbox_item_states"); err != nil {
		t.Fatal(err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, sqlGenericPlanOn); err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = conn.Exec(ctx, sqlGenericPlanOff) }()
	args := pgx.NamedArgs{"key": key, "mode": "test", "settle": time.Hour, "from": now - 50*3600, "to": now + 3600}
	var plan []map[string]any
	if err := conn.QueryRow(context.Background(), "EXPLAIN (ANALYZE, FORMAT JSON) "+sqlKeyItems, args).Scan(&plan); err != nil {
		t.Fatal(err)
	}
	var read float64
	for _, n := range testdb.PlanNodes(plan[0]["Plan"]) {
		if n["Relation Name"] != "outbox_item_bodies" {
			continue
		}
		if n["Node Type"] == "Seq Scan" {
			t.Errorf("the bodies are read whole")
		}
		for _, k := range []string{"Actual Rows", "Rows Removed by Filter", "Rows Removed by Index Recheck"} {
			if v, ok := n[k].(float64); ok {
				loops, _ := n["Actual Loops"].(float64)
				read += v * max(loops, 1)
			}
		}
	}
	if read > 60 {
		t.Errorf("KeyItems read %v bodies for a range of 50 items beside 3,000 of the key's history", read)
	}
}
