package main

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// tally reconcile discrepancies lists the open discrepancies of the latest
// succeeded run, and tally reconcile resolve ID resolves one with a reason
// and a note: it is listed resolved (who, when, why) and not open; the
// wrong call is refused (exit 2) and a second resolution fails (exit 1).
func TestReconcileResolveCommand(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	code, _, errs := tally(t, url, "migrate")
	require.Equal(t, 0, code, errs)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	id := succeededRunWithDiscrepancy(t, ctx, pool)
	ref := strconv.FormatInt(id, 10)

	for _, args := range [][]string{
		{"reconcile", "resolve", ref, "--reason", "waived", "--note", "n"},
		{"reconcile", "resolve", ref, "--reason", "accept_tally"},
		{"reconcile", "resolve", "x", "--reason", "accept_tally", "--note", "n"},
		{"reconcile", "resolve", ref, "--reason", "accept_tally", "--note", "n", "--settle", "1h"},
		{"reconcile", "discrepancies", "--status", "closed"},
		{"reconcile", "--reason", "accept_tally"},
		{"reconcile", "resolve"},
	} {
		code, _, errs := tally(t, url, args...)
		require.Equal(t, 2, code, "%v: %s", args, errs)
	}

	// The run form is still tally reconcile's own.
	code, _, errs = tally(t, url, "reconcile", "--settle", "0s")
	require.Equal(t, 1, code, errs)
	require.Contains(t, errs, "no Stripe key")

	code, out, errs := tally(t, url, "reconcile", "discrepancies")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, "1 open discrepancies")
	require.Contains(t, out, "cus_acme")
	require.Contains(t, out, "open")

	code, out, errs = tally(t, url, "reconcile", "resolve", ref, "--reason", "credited_in_stripe", "--note", "credit note CN-7")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, "credited_in_stripe by cli:")
	require.Contains(t, out, "credit note CN-7")

	code, out, _ = tally(t, url, "reconcile", "discrepancies")
	require.Equal(t, 0, code)
	require.Contains(t, out, "0 open discrepancies")
	code, out, _ = tally(t, url, "reconcile", "discrepancies", "--status", "resolved", "--format", "json")
	require.Equal(t, 0, code)
	require.Contains(t, out, `"reason": "credited_in_stripe"`)
	require.Equal(t, 1, strings.Count(out, `"note": "credit note CN-7"`))

	code, _, errs = tally(t, url, "reconcile", "resolve", ref, "--reason", "accept_tally", "--note", "again")
	require.Equal(t, 1, code)
	require.Contains(t, errs, "resolved already")
}

// succeededRunWithDiscrepancy records a succeeded run with one discrepancy
// of no item, and returns the discrepancy's id.
func succeededRunWithDiscrepancy(t *testing.T, ctx context.Context, pool *pgxpool.Pool) int64 {
	t.Helper()
	var run, id int64
	require.NoError(t, pool.QueryRow(ctx, `INSERT INTO reconcile_runs (status, trigger, requested_by, settle, started_at,
			heartbeat_at, finished_at)
		VALUES ('succeeded', 'command', 'test', '0s', clock_timestamp(), clock_timestamp(), clock_timestamp()) RETURNING id`).Scan(&run))
	require.NoError(t, pool.QueryRow(ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name,
			meter, customer, hour, formula, expected, provider, difference, expected_items, uncertain_items, explained_by, explanation)
		VALUES ($1, 'acct_1', 'test', 'api', 'mtr_1', 'cus_acme', $2, 'sum', 5, 9, 4, '{}', '{}', '{}', 'unexplained')
		RETURNING id`, run, time.Now().UTC().Truncate(time.Hour)).Scan(&id))
	return id
}
