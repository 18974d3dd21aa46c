package migrations_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/doctor"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/migrations"
)

// citusSeed is a small history written before the tables are distributed,
// as docs/citus/seed.sql's with the bucket: 40 tenants (half with a
// period anchor), 2,000 events staged into one item per tenant, a third
// of the items leased and half of those accepted, and 100 events not
// staged yet.
const citusSeed = `BEGIN;
INSERT INTO tenant_mappings (tenant, stripe_customer_id, period_anchor, version, updated_by)
SELECT 'ten' || g, 'cus_ten' || g, CASE WHEN g % 2 = 0 THEN '2026-01-15T00:00:00Z'::timestamptz END, g, 'seed' FROM generate_series(1, 40) g;
INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given, bucket)
SELECT 'ten' || (g % 40 + 1), 'ev' || g, 'api_calls', g % 7 + 1, statement_timestamp() - g * interval '1 second', true, tally_bucket('ten' || (g % 40 + 1))
FROM generate_series(1, 2100) g;
INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant, bucket)
SELECT id, occurred_at, md5(event_id)::uuid, tenant, bucket FROM usage_events;
INSERT INTO outbox_item_bodies (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, payload, bucket)
SELECT t, 'usage_window', 'w1', 'stripe_meter_event_stream', 'acct_1', 'test', 1,
  jsonb_build_object('identifier', 'tly_' || encode(sha256(tally_utf8(t || '|usage_window|w1|stripe_meter_event_stream|acct_1|test|1')), 'hex'),
                     'value', s.v, 'timestamp', 1765000000, 'customer', 'cus_' || t, 'event_name', 'api_calls', 'period', '2026-12-01T00:00:00Z'),
  tally_bucket(t)
FROM (SELECT tenant AS t, sum(value) AS v FROM usage_events GROUP BY tenant) s;
INSERT INTO outbox_item_states (id, exporter, mode, ordering_key, state, created_at, bucket)
SELECT id, exporter, mode, ordering_key, 'pending', created_at, bucket FROM outbox_item_bodies;
UPDATE usage_events e SET item_id = b.id, staged_at = clock_timestamp() FROM outbox_item_bodies b
WHERE b.tenant_key = e.tenant AND e.event_id NOT IN (SELECT 'ev' || g FROM generate_series(1, 100) g);
UPDATE outbox_item_states SET state = 'leased', lease_owner = 'seed', leased_at = clock_timestamp(),
    lease_expires_at = clock_timestamp() + interval '1 minute', lease_token = 1, attempts = 1, first_attempt_at = clock_timestamp()
WHERE id % 3 = 0;
INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused, bucket)
SELECT id, 1, 'seed', leased_at, 'accepted', 'accepted', false, bucket FROM outbox_item_states WHERE state = 'leased' AND id % 6 = 0;
UPDATE outbox_item_states SET state = 'accepted', accepted_at = clock_timestamp(), lease_expires_at = NULL
WHERE state = 'leased' AND id % 6 = 0;
COMMIT`

// contents reads every table Distribute places, each as its row count and
// a digest of its rows in order: equal contents are equal rows, the
// completeness counters' included.
func contents(t *testing.T, db *pgxpool.Pool) map[string]string {
	t.Helper()
	out := map[string]string{}
	for name, p := range migrations.Placements {
		if p == migrations.Local {
			continue
		}
		var n int64
		var digest string
		err := db.QueryRow(context.Background(), "SELECT count(*), coalesce(md5(string_agg(r::text, '|' ORDER BY r::text)), '') FROM "+
			pgx.Identifier{name}.Sanitize()+" r").Scan(&n, &digest)
		require.NoError(t, err, name)
		out[name] = fmt.Sprintf("%d rows, %s", n, digest)
	}
	return out
}

// tablesPlaced returns the tables of Placements that must be p, by name.
func tablesPlaced(p migrations.Placement) []string {
	var out []string
	for name, want := range migrations.Placements {
		if want == p {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// Distribute on a seeded database places every table as Placements says,
// with every row and counter as it was, leaves no copy of the rows on the
// coordinator and the triggers on; the doctor then finds the engine as it
// must be, and a second run changes nothing.
func TestDistributeInPlace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewCitus(t)
	_, err := pool.Exec(ctx, citusSeed)
	require.NoError(t, err)
	var ingested, unstaged, pending int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT sum(ingested_events), sum(unstaged_events), sum(pending_events)
		FROM completeness_counters`).Scan(&ingested, &unstaged, &pending))
	require.Equal(t, []int64{2100, 100, 1700}, []int64{ingested, unstaged, pending}, "the seed's counters")
	before := contents(t, pool)

	res, err := migrations.Distribute(ctx, pool, nil)
	require.NoError(t, err)
	require.True(t, res.Changed())
	require.Equal(t, tablesPlaced(migrations.Reference), sorted(res.Reference))
	require.Equal(t, tablesPlaced(migrations.Distributed), sorted(res.Distributed))
	require.Equal(t, "outbox_item_bodies", res.Distributed[0], "the anchor of the co-location group first")
	require.NotEmpty(t, res.Emptied)
	require.True(t, res.AnchorDropped)
	require.True(t, res.TriggersAllowed)
	require.True(t, res.PoolCapped)
	require.Contains(t, res.CustomPlans, "completeness_bump(completeness_delta[])")
	require.Contains(t, res.String(), "8 tables distributed by bucket in 32 shards")
	var generic int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_proc
		WHERE 'plan_cache_mode=force_generic_plan' = ANY (proconfig)`).Scan(&generic))
	require.Zero(t, generic, "no function keeps a generic plan on Citus")

	e, err := migrations.ReadEngine(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, e.Misplaced())
	var engine doctor.Result
	for _, r := range doctor.Run(ctx, doctor.Deps{Pool: pool}) {
		if r.Check == "engine" {
			engine = r
		}
	}
	require.Equal(t, doctor.OK, engine.Status, "%+v", engine)
	require.Contains(t, engine.Detail, "8 distributed, 8 reference")

	var shards, groups int
	require.NoError(t, pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'outbox_item_bodies'::regclass),
			(SELECT count(DISTINCT colocationid) FROM pg_dist_partition WHERE logicalrelid = ANY ($1::text[]::regclass[]))`,
		tablesPlaced(migrations.Distributed)).Scan(&shards, &groups))
	require.Equal(t, migrations.DistributedShards, shards)
	require.Equal(t, 1, groups, "every distributed table in one co-location group")

	require.Equal(t, before, contents(t, pool), "rows or counters changed in the distribution")
	var leftover int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT sum(pg_relation_size(d.rel)
			+ coalesce((SELECT sum(pg_relation_size(t.relid)) FROM pg_partition_tree(d.rel) t WHERE t.level > 0), 0))
		FROM unnest($1::text[]::regclass[]) AS d(rel)`, tablesPlaced(migrations.Distributed)).Scan(&leftover))
	require.Zero(t, leftover, "the coordinator keeps a copy of the distributed rows")

	// The triggers are on again: the ledger refuses a TRUNCATE, and a new
	// event counts once.
	_, err = pool.Exec(ctx, "TRUNCATE usage_events")
	require.ErrorContains(t, err, "rows are never deleted")
	ingestedOf := func() (n int64) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(sum(ingested_events), 0) FROM completeness_counters
			WHERE tenant = 'ten1' AND bucket = tally_bucket('ten1')`).Scan(&n))
		return n
	}
	was := ingestedOf()
	_, err = pool.Exec(ctx, `INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given, bucket)
		VALUES ('ten1', 'after', 'api_calls', 1, statement_timestamp(), true, tally_bucket('ten1'))`)
	require.NoError(t, err)
	require.Equal(t, was+1, ingestedOf())

	again, err := migrations.Distribute(ctx, pool, nil)
	require.NoError(t, err)
	require.False(t, again.Changed(), "%+v", again)
	require.Contains(t, again.String(), "every table is already where it must be")

	// A new session uses one connection per worker for a statement, and
	// an operator's own value is left alone.
	poolSize := func() string {
		conn, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
		require.NoError(t, err)
		defer conn.Close(ctx)
		var v string
		require.NoError(t, conn.QueryRow(ctx, "SHOW citus.max_adaptive_executor_pool_size").Scan(&v))
		return v
	}
	require.Equal(t, "1", poolSize())
	var db string
	require.NoError(t, pool.QueryRow(ctx, "SELECT current_database()").Scan(&db))
	_, err = pool.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{db}.Sanitize()+" SET citus.max_adaptive_executor_pool_size = 4")
	require.NoError(t, err)
	again, err = migrations.Distribute(ctx, pool, nil)
	require.NoError(t, err)
	require.False(t, again.Changed(), "%+v", again)
	require.Equal(t, "4", poolSize())
}

func sorted(s []string) []string {
	return slices.Sorted(slices.Values(s))
}

// Without a worker there is nowhere to put a shard: Distribute says so and
// changes nothing.
func TestDistributeRefusesWithoutWorkers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewCitus(t)
	testdb.RemoveWorkers(t, pool)

	_, err := migrations.Distribute(ctx, pool, nil)
	require.ErrorIs(t, err, migrations.ErrCannotDistribute)
	require.ErrorContains(t, err, "no active worker is registered on the coordinator")
	e, err := migrations.ReadEngine(ctx, pool)
	require.NoError(t, err)
	require.Len(t, e.Misplaced(), len(tablesPlaced(migrations.Distributed))+len(tablesPlaced(migrations.Reference)))
}

// A schema without the tenant bucket cannot be distributed by it:
// Distribute names the tables without it and the migration that adds it.
func TestDistributeRefusesWithoutTheBucket(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewCitus(t)
	_, err := pool.Exec(ctx, "ALTER TABLE completeness_items DROP COLUMN IF EXISTS bucket CASCADE")
	require.NoError(t, err)

	_, err = migrations.Distribute(ctx, pool, nil)
	require.ErrorIs(t, err, migrations.ErrCannotDistribute)
	require.ErrorContains(t, err, "completeness_items")
	require.ErrorContains(t, err, "predates the tenant bucket (migration 48)")
	e, err := migrations.ReadEngine(ctx, pool)
	require.NoError(t, err)
	require.Len(t, e.Misplaced(), len(tablesPlaced(migrations.Distributed))+len(tablesPlaced(migrations.Reference)))
}

// A table placed otherwise by hand is not moved: Distribute names it and
// changes nothing.
func TestDistributeRefusesATableMisplacedByHand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewCitus(t)
	_, err := pool.Exec(ctx, "SELECT create_reference_table('stripe_event_listings')")
	require.NoError(t, err)

	_, err = migrations.Distribute(ctx, pool, nil)
	require.ErrorIs(t, err, migrations.ErrCannotDistribute)
	require.ErrorContains(t, err, "stripe_event_listings is reference, must be local")
	e, err := migrations.ReadEngine(ctx, pool)
	require.NoError(t, err)
	require.Len(t, e.Misplaced(), len(tablesPlaced(migrations.Distributed))+len(tablesPlaced(migrations.Reference))+1)
}

// On plain PostgreSQL there is nothing to distribute, and Distribute says so.
func TestDistributeOnPlainPostgres(t *testing.T) {
	t.Parallel()
	res, err := migrations.Distribute(context.Background(), testdb.New(t), nil)
	require.NoError(t, err)
	require.Empty(t, res.Engine.Citus)
	require.False(t, res.Changed())
	require.Regexp(t, `^PostgreSQL 15\.\d+: nothing to distribute$`, res.String())
}
