package app

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// tally_reconcile_open_discrepancies counts the open discrepancies of every
// run by kind, read from the database at scrape time: a discrepancy a later
// run cleared is not counted, every kind has a series (0 when none).
func TestOpenDiscrepanciesGauge(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	ob, err := outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO reconcile_runs (status, trigger, requested_by, settle)
		VALUES ('succeeded', 'command', 't', '0'), ('succeeded', 'command', 't', '0')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name, meter, customer,
			hour, formula, expected, provider, expected_items, uncertain_items, explained_by, explanation, cleared_by_run)
		VALUES (1, 'acct_1', 'test', 'api', 'mtr_1', 'cus_1', '2026-11-30T01:00:00Z', 'sum', 5, 9, '{}', '{}', '{}', 'unexplained', 2),
		       (2, 'acct_1', 'test', 'api', 'mtr_1', 'cus_1', '2026-11-30T01:00:00Z', 'sum', 5, 9, '{}', '{}', '{}', 'unexplained', NULL),
		       (2, 'acct_1', 'test', 'api', 'mtr_1', 'cus_1', '2026-11-30T02:00:00Z', 'sum', 5, 8, '{}', '{}', '{}', 'unexplained', NULL),
		       (2, 'acct_1', 'test', 'api', 'mtr_1', 'cus_2', '2026-11-30T02:00:00Z', 'sum', 5, 1, '{}', '{}', '{}', 'unexplained', NULL)`)
	require.NoError(t, err)
	require.NoError(t, testutil.CollectAndCompare(newHeartbeats(pool, ob), strings.NewReader(`
# HELP tally_reconcile_open_discrepancies Discrepancies with Stripe open now, of every reconcile run (unresolved, and no later run compared the hour again), by kind: stripe_has_more (Stripe counts more than Tally: a customer may be billed too much), stripe_has_less (usage not billed), summaries_refused (Stripe refused a key's summaries). Read from the database: the same on every node.
# TYPE tally_reconcile_open_discrepancies gauge
tally_reconcile_open_discrepancies{kind="stripe_has_less"} 1
tally_reconcile_open_discrepancies{kind="stripe_has_more"} 2
tally_reconcile_open_discrepancies{kind="summaries_refused"} 0
`), "tally_reconcile_open_discrepancies"))
}
