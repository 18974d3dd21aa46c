package meter

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// TestStagingNeverPlansOnTheBacklogIndex: a month whose statistics were
// gathered while nothing in it was unstaged, then thousands of unstaged
// rows arrive. Staging's lookups of one tenant's feature in a window must
// still be planned on the index of (tenant, feature, occurred_at), never on
// the backlog's index of every unstaged row by arrival, which would read
// the whole backlog for each window.
func TestStagingNeverPlansOnTheBacklogIndex(t *testing.T) {
	t.Parallel()
	pool := testdb.New(t)
	ctx := t.Context()
	var part string
	require.NoError(t, pool.QueryRow(ctx, `SELECT usage_events_month_name(date_trunc('month', now() AT TIME ZONE 'UTC')::date)`).Scan(&part))
	for _, s := range []string{
		"ALTER TABLE " + part + " SET (autovacuum_enabled = off)",
		// Staged rows only (their item's checks skipped), then statistics:
		// both partial indexes of unstaged rows look empty.
		"SET session_replication_role = replica",
		`INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given, item_id, staged_at, bucket)
			SELECT 't' || (i % 50), 's' || i, 'f' || (i % 4), 1, date_trunc('month', now()), true, 1, now(), tally_bucket('t' || (i % 50))
			FROM generate_series(1, 400) i`,
		"RESET session_replication_role",
		"ANALYZE " + part,
		`INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given, received_at, bucket)
			SELECT 't' || (i % 50), 'e' || i, 'f' || (i % 4), 1, date_trunc('month', now()) + (i % 3000) * interval '1 second',
				true, date_trunc('month', now()) + (i % 3000) * interval '1 second', tally_bucket('t' || (i % 50))
			FROM generate_series(1, 20000) i`,
	} {
		_, err := pool.Exec(ctx, s)
		require.NoError(t, err, s)
	}
	from := time.Now().UTC()
	from = time.Date(from.Year(), from.Month(), 1, 0, 0, 0, 0, time.UTC)
	for name, q := range map[string]struct {
		sql  string
		args pgx.NamedArgs
	}{
		"rows": {sqlBatchRows, pgx.NamedArgs{"tenants": []string{"t1", "t2"}, "features": []string{"f1", "f2"},
			"froms": []time.Time{from, from}, "tos": []time.Time{from.Add(time.Hour), from.Add(time.Hour)}, "grace": time.Minute}},
		"buckets": {sqlBatchBuckets, pgx.NamedArgs{"tenants": []string{"t1", "t2"}, "features": []string{"f1", "f2"},
			"widths": []time.Duration{time.Hour, time.Hour}, "grace": time.Minute, "origin": gridOrigin}},
	} {
		var plan []map[string]any
		var raw []byte
		require.NoError(t, pool.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+q.sql, q.args).Scan(&raw), name)
		require.NoError(t, json.Unmarshal(raw, &plan))
		var used []string
		for _, n := range testdb.PlanNodes(plan[0]["Plan"]) {
			if idx, ok := n["Index Name"].(string); ok && strings.HasPrefix(idx, part) {
				used = append(used, idx)
			}
		}
		require.NotEmpty(t, used, "%s: the month's partition is read by an index", name)
		for _, idx := range used {
			require.Contains(t, idx, "tenant_feature_occurred_at", "%s: planned on %s", name, idx)
		}
	}
}
