package outbox

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
)

// TestAdjustmentClaimReadsNoMeterEventBacklog keeps the claims of the
// adjustments' deliverer (one exporter's items, named as a literal) off
// the backlog of meter events: they read the partial index of the
// adjustments' pending items (adjust_pending_due), not every pending item in due
// order to filter the few adjustments out — which they would do several
// times a second, whatever the backlog.
func TestAdjustmentClaimReadsNoMeterEventBacklog(t *testing.T) {
	t.Parallel()
	ctx, pool, store := backlogUnseen(t, 200, 3000)
	enqueueAdjustments(t, pool, store, 20)

	for name, e := range explainClaims(t, ctx, pool, claimFilter{exporter: "stripe_meter_event_adjustments"}, claimPlanArgs()) {
		// The 20 adjustments and their leases; under PerKey, for each, the
		// adjustments due before it (its key's earlier items): about 300,
		// growing with the adjustments a claim considers, never with the
		// backlog of meter events.
		if e.read > 500 {
			t.Errorf("%s: %v state rows read to lease 20 adjustments beside a backlog of 3,000 meter events: %s", name, e.read, e.plan)
		}
	}
}

// enqueueAdjustments enqueues n pending cancellations for the adjustments'
// exporter, each of its own customer.
func enqueueAdjustments(t *testing.T, pool interface {
	Begin(context.Context) (pgx.Tx, error)
}, store *Store, n int) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for i := range n {
		it := NewItem{
			Identity: Identity{TenantKey: "acme", SubjectKind: SubjectUsageCancellation, SubjectRef: fmt.Sprintf("cancel:%d", i),
				Exporter: "stripe_meter_event_adjustments", DestinationAccount: "acct_123", Mode: ModeTest, MappingVersion: 1},
			Payload: Payload{Customer: fmt.Sprintf("cus_adj_%d", i), EventName: "calls", Timestamp: 1796000000,
				Feature: "calls", Period: "2026-11-01T00:00:00Z", Cancels: "tly_" + fmt.Sprintf("%064d", i), CancelBy: 1796086400},
		}
		if _, err := store.Enqueue(ctx, tx, it); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}
