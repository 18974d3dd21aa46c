package outbox

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// TestSweepReadsNoBacklogNeverSent keeps the maintenance sweep's cost
// independent of the backlog: beside 6,000 pending items never sent, a
// sweep reads the items that have been attempted (the only ones it can
// move), both before and after the statistics have seen the backlog.
func TestSweepReadsNoBacklogNeverSent(t *testing.T) {
	t.Parallel()
	ctx, pool, store := backlogUnseen(t, 100, 6000)
	// Give the 100 leased items an answer that leaves them pending and
	// attempted: they are the sweep's candidates.
	if _, err := pool.Exec(ctx, `UPDATE outbox_item_states SET lease_expires_at = clock_timestamp() - interval '1 second'
		WHERE state = 'leased'`); err != nil {
		t.Fatal(err)
	}
	for _, analysed := range []bool{false, true} {
		if analysed {
			if _, err := pool.Exec(ctx, "VACUUM ANALYZE outbox_item_states"); err != nil {
				t.Fatal(err)
			}
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var plan []map[string]any
		err = tx.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+sweepSQL(tenantbucket.OneServer()), pgx.QueryExecModeExec,
			pgx.NamedArgs{"max": store.cfg.MaxAttempts, "horizon": time.Hour}).Scan(&plan)
		_ = tx.Rollback(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var read float64
		for _, n := range testdb.PlanNodes(plan[0]["Plan"]) {
			if n["Relation Name"] != "outbox_item_states" {
				continue
			}
			if n["Node Type"] == "Seq Scan" {
				t.Errorf("analysed %v: the sweep reads the states whole", analysed)
			}
			for _, k := range []string{"Actual Rows", "Rows Removed by Filter", "Rows Removed by Index Recheck"} {
				if v, ok := n[k].(float64); ok {
					loops, _ := n["Actual Loops"].(float64)
					read += v * max(loops, 1)
				}
			}
		}
		if read > 400 {
			b, _ := json.Marshal(plan)
			t.Errorf("analysed %v: the sweep read %v states beside 100 attempted items and 6,000 never sent: %s", analysed, read, b)
		}
	}
}
