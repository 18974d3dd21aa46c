package main

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// tally report completeness --verify names every key where the counters
// differ from the ledger and exits 1; --repair rewrites the month from the
// ledger, audited; --verify then finds nothing. The wrong calls are refused
// (exit 2).
func TestCompletenessVerifyAndRepairCommands(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	code, _, errs := tally(t, url, "migrate")
	require.Equal(t, 0, code, errs)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	at := time.Now().UTC().Add(-time.Hour)
	month := at.Format("2006-01")
	_, err = pool.Exec(ctx, `INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given, bucket)
		VALUES ('acme', 'a', 'api', 5, $1, true, tally_bucket('acme')), ('acme', 'b', 'api', 6, $1, true, tally_bucket('acme'))`, at)
	require.NoError(t, err)

	for _, args := range [][]string{
		{"report", "completeness", "--period", month, "--verify", "--repair"},
		{"report", "completeness", "--period", month, "--verify", "--tenant", "acme"},
		{"report", "completeness", "--verify"},
	} {
		code, _, _ := tally(t, url, args...)
		require.Equal(t, 2, code, "%v", args)
	}

	code, out, errs := tally(t, url, "report", "completeness", "--period", month, "--verify")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, "0 keys differ")

	_, err = pool.Exec(ctx, `UPDATE completeness_counters SET unstaged_events = unstaged_events - 1 WHERE tenant = 'acme'`)
	require.NoError(t, err)
	code, out, _ = tally(t, url, "report", "completeness", "--period", month, "--verify")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "2 keys differ", "unstaged, and pending, of which it is a part")
	require.Regexp(t, `acme\s+api\s+\S+\s+unstaged\s+1 events, 11\s+2 events, 11`, out)

	code, out, errs = tally(t, url, "report", "completeness", "--period", month, "--repair")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, "2 keys differed and were rewritten from the ledger")
	code, out, errs = tally(t, url, "report", "completeness", "--period", month, "--verify", "--format", "json")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, `"drift_keys": 0`)
	var audited int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM audit_log WHERE action = 'completeness.repair' AND subject = $1`,
		"completeness:"+month).Scan(&audited))
	require.Equal(t, 1, audited)
}
