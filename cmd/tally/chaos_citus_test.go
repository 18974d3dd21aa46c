package main

import (
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/tenantbucket"
)

// TestChaosOnCitus is TestChaos on a Citus coordinator with two workers,
// Tally's tables distributed (`make citus`): the same nodes SIGKILLed, the
// same faults and usage, a worker restarted at a third of the run and, at
// two thirds, the shard group of a tenant's bucket moved to the other
// worker under load — and the same end checks: nothing lost, nothing
// billed twice, conservation, Stripe's aggregates equal to the ledger's.
func TestChaosOnCitus(t *testing.T) {
	if testing.Short() || os.Getenv("TALLY_CITUS_CHAOS_TEST") == "" {
		// Three servers and three nodes on the machine's cores: beside
		// the other packages' tests it would slow their timing-sensitive
		// runs, and they its shard move. make test runs it on its own.
		t.Skip("loads the machine: set TALLY_CITUS_CHAOS_TEST=1 (make citus-load runs it alone)")
	}
	requireCitus(t)
	r := newChaosRun(t)
	r.citus = true
	r.run()
	r.checkMoved()
}

// checkMoved checks that the shard group moved is where the move put it.
func (r *chaosRun) checkMoved() {
	r.t.Helper()
	require.NotEmpty(r.t, r.moved, "a shard group was moved")
	var port int
	require.NoError(r.t, r.pool.QueryRow(r.ctx, `SELECT p.nodeport FROM pg_dist_shard_placement p
		WHERE p.shardid = get_shard_id_for_distribution_column('outbox_item_states', $1::smallint)`,
		tenantbucket.Of("c00")).Scan(&port))
	require.Contains(r.t, r.moved, fmt.Sprintf("to %d ", port))
}
