package meter

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// citusPulled says that sql plans as an INSERT … SELECT the coordinator
// evaluates itself ("pull to coordinator") from rows that read no
// distributed table: no distributed job, no subplan; the coordinator then
// sends each row to its shard.
func citusPulled(t *testing.T, db pgdb.Querier, sql string, args ...any) {
	t.Helper()
	var plan []map[string]any
	require.NoError(t, db.QueryRow(context.Background(), "EXPLAIN (FORMAT JSON, COSTS OFF) "+sql, args...).Scan(&plan))
	top, _ := plan[0]["Plan"].(map[string]any)
	b, _ := json.Marshal(plan)
	require.Equal(t, "Citus INSERT ... SELECT", top["Custom Plan Provider"], "%s", b)
	require.Equal(t, "pull to coordinator", top["INSERT/SELECT method"], "%s", b)
	require.NotContains(t, string(b), "Distributed Query", "the rows read no distributed table")
	require.NotContains(t, string(b), "Subplan", "no subplan")
}

// A group of buckets of a distributed database, with a tenant of each of
// its first buckets.
func aGroup(t *testing.T, db pgdb.Querier) (buckets []int16, tenants []string) {
	t.Helper()
	shards, err := tenantbucket.ReadShards(context.Background(), db)
	require.NoError(t, err)
	require.True(t, shards.Distributed())
	g := shards.GroupOf(tenantbucket.Of("acme"))
	for i := 0; len(tenants) < 3; i++ {
		if tn := fmt.Sprintf("tenant-%d", i); shards.GroupOf(tenantbucket.Of(tn)) == g {
			tenants = append(tenants, tn)
		}
	}
	return shards.Buckets(g), tenants
}

// Every statement ingest and cancellation run names its shard: the keys
// and the ledger rows are pulled through the coordinator to the one shard
// of their group (an INSERT … SELECT from unnest is planned so: its rows
// are the coordinator's to evaluate, the keys' ids from the coordinator's
// sequence and the closed months from its own table); every other
// statement is one task.
func TestIngestAndCancelStatementsAreOneShards(t *testing.T) {
	t.Parallel()
	db := testdb.NewDistributed(t)
	group, tenants := aGroup(t, db)
	buckets := make([]int16, len(tenants))
	for i, tn := range tenants {
		buckets[i] = tenantbucket.Of(tn)
	}
	ids := []string{"e1", "e2", "e3"}
	features := []string{"api", "api", "api"}
	values := []int64{1, 2, 3}
	at := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	stamps := []time.Time{at, at, at}
	tenant, bucket := tenants[0], buckets[0]

	t.Run("ingest keys", func(t *testing.T) {
		citusPulled(t, db, sqlIngestKeys, pgx.NamedArgs{"tenants": tenants, "buckets": buckets, "ids": ids, "timestamps": stamps})
	})
	t.Run("ingest rows", func(t *testing.T) {
		citusPulled(t, db, sqlIngestRows, pgx.NamedArgs{"rows": []int64{1, 2, 3}, "tenants": tenants, "ids": ids, "features": features,
			"values": values, "at": stamps, "given": []bool{true, true, false}, "buckets": buckets})
	})
	tasks := []struct {
		name string
		sql  string
		args []any
	}{
		{"ingest existing", sqlExisting, []any{pgx.NamedArgs{"tenants": tenants, "buckets": buckets, "ids": ids,
			"timestamps": stamps, "group": distinctBuckets(buckets)}}},
		{"ingest existing, the group's list", sqlExisting, []any{pgx.NamedArgs{"tenants": tenants, "buckets": buckets, "ids": ids,
			"timestamps": stamps, "group": group}}},
		{"cancel: the key", sqlCancelKey, []any{tenant, "e1", bucket}},
		{"cancel: lock the event", sqlCancelLock, []any{tenant, "e1", bucket}},
		{"cancel: the cancellation", sqlCancelled, []any{int64(1), bucket}},
		{"cancel: mark the event", sqlCancelMark, []any{int64(1), at, bucket}},
		{"cancel: record it", sqlCancelRecord, []any{tenant, "e1", int64(1), CancelWithdrawn, nil, int64(7), int64(8), "token:ops", bucket}},
		{"cancel: the rows left in the root item", sqlCancelLeft, []any{int64(7), bucket}},
		{"cancel: the adjustment's deadline", sqlCancelDeadline, []any{pgx.NamedArgs{"window": cancelWindow, "margin": DefaultCancelMargin,
			"id": int64(7), "bucket": bucket}}},
	}
	for _, tc := range tasks {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, []int{1}, testdb.CitusTasks(t, db, tc.sql, tc.args...))
		})
	}
}

// On one server a batch is one sqlIngest; the pair sqlIngestKeys and
// sqlIngestRows, which a distributed database writes, stores the same
// ledger and keys and answers the same results, duplicates, changed
// content and closed months included.
func TestIngestPairsEqualOneStatement(t *testing.T) {
	t.Parallel()
	if testdb.OnCitus() {
		t.Skip("testdb.New is distributed: both write pairs")
	}
	ctx := context.Background()
	closed := time.Date(2025, 3, 10, 0, 0, 0, 0, time.UTC)
	at := func(d time.Duration) *time.Time { v := time.Now().UTC().Add(-d).Truncate(time.Microsecond); return &v }
	t1, t2 := at(2*time.Hour), at(3*time.Hour)
	batches := [][]Event{
		{{Tenant: "acme", ID: "a1", Feature: "api", Value: 1, Timestamp: t1}, {Tenant: "globex", ID: "g1", Feature: "api", Value: 2},
			{Tenant: "t1", ID: "x", Feature: "api", Value: 3, Timestamp: t2}, {Tenant: "acme", ID: "a1", Feature: "api", Value: 1, Timestamp: t1}},
		{{Tenant: "acme", ID: "a1", Feature: "api", Value: 1, Timestamp: t1}, {Tenant: "t1", ID: "y", Feature: "api", Value: 4, Timestamp: t2}},
		{{Tenant: "globex", ID: "g2", Feature: "api", Value: 5}, {Tenant: "t1", ID: "x", Feature: "api", Value: 9, Timestamp: t2}},
		{{Tenant: "acme", ID: "old", Feature: "api", Value: 6, Timestamp: &closed}, {Tenant: "globex", ID: "g3", Feature: "api", Value: 7}},
	}
	type outcome struct {
		res  []string
		rows []string
	}
	run := func(pairs bool) outcome {
		db := testdb.New(t)
		_, err := db.Exec(ctx, `INSERT INTO usage_closed_months (month, events, closed_by) VALUES ('2025-03-01', 0, 'test')`)
		require.NoError(t, err)
		in := &Ingester{pairs: pairs}
		var out outcome
		for _, b := range batches {
			var res Result
			err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
				var err error
				res, err = in.Ingest(ctx, tx, b)
				return err
			})
			out.res = append(out.res, fmt.Sprintf("%+v %v", res, err))
		}
		rows, err := db.Query(ctx, `SELECT e.tenant || ' ' || e.event_id || ' ' || e.feature || ' ' || e.value || ' ' || CASE WHEN e.timestamp_given THEN e.occurred_at::text ELSE 'now' END
			|| ' ' || e.timestamp_given || ' ' || e.bucket || ' ' || (k.occurred_at = e.occurred_at)
			FROM usage_events e JOIN usage_event_keys k ON k.event_row = e.id AND k.bucket = e.bucket ORDER BY 1`)
		require.NoError(t, err)
		out.rows, err = pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		var keys, ledger int
		require.NoError(t, db.QueryRow(ctx, `SELECT (SELECT count(*) FROM usage_event_keys), (SELECT count(*) FROM usage_events)`).Scan(&keys, &ledger))
		require.Equal(t, keys, ledger, "a ledger row for every key")
		return out
	}
	one, pairs := run(false), run(true)
	require.Len(t, one.rows, 4)
	require.Contains(t, one.res[2], "different content")
	require.Contains(t, one.res[3], PeriodClosed)
	require.Equal(t, one.res, pairs.res)
	require.Equal(t, one.rows, pairs.rows)
}
