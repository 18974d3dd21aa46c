package testdb_test

import (
	"context"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/migrations"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// A database of NewCitus is migrated on the coordinator, has the
// extension on every node, and its metadata names both workers.
func TestCitusDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewCitus(t)
	res, err := migrations.Apply(ctx, pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.TallyApplied != 0 || res.RiverApplied != 0 || res.TallyVersion == 0 {
		t.Fatalf("the database was not migrated: a second Apply gave %+v", res)
	}
	var workers int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_dist_node WHERE groupid > 0 AND isactive").Scan(&workers); err != nil {
		t.Fatal(err)
	}
	if workers != testdb.CitusWorkers {
		t.Fatalf("%d active workers, want %d", workers, testdb.CitusWorkers)
	}
	database := pool.Config().ConnConfig.Database
	for _, w := range testdb.CitusCluster(t).Workers() {
		conn, err := pgx.Connect(ctx, w.URL(database))
		if err != nil {
			t.Fatal(err)
		}
		var version string
		err = conn.QueryRow(ctx, "SELECT extversion FROM pg_extension WHERE extname = 'citus'").Scan(&version)
		_ = conn.Close(ctx)
		if err != nil {
			t.Fatalf("the worker on port %d: %v", w.Port(), err)
		}
	}
}

// What Tally's claims rest on, on a distributed table: a SELECT … FOR
// UPDATE SKIP LOCKED with the distribution key is routed to one shard,
// and one across shards is refused.
func TestCitusRowLocks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewCitus(t)
	for _, sql := range []string{
		"CREATE TABLE claims (tenant int, id bigint, due timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (tenant, id))",
		"SELECT create_distributed_table('claims', 'tenant')",
		"INSERT INTO claims (tenant, id) SELECT g % 16, g FROM generate_series(1, 200) g",
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	rows, err := pool.Query(ctx, "EXPLAIN SELECT id FROM claims WHERE tenant = $1 AND due <= statement_timestamp() ORDER BY due LIMIT 10 FOR UPDATE SKIP LOCKED", 7)
	if err != nil {
		t.Fatal(err)
	}
	plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(plan, "\n"), "Task Count: 1") {
		t.Fatalf("the routed claim is not one task:\n%s", strings.Join(plan, "\n"))
	}
	_, err = pool.Exec(ctx, "SELECT id FROM claims WHERE due <= statement_timestamp() LIMIT 10 FOR UPDATE")
	if err == nil || !strings.Contains(err.Error(), "could not run distributed query with FOR UPDATE/SHARE commands") {
		t.Fatalf("a claim across shards: got %v, want Citus's refusal", err)
	}
}

// The URL of a Citus database names the coordinator, where its pool is.
func TestCitusURL(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(testdb.CitusURL(t))
	if err != nil {
		t.Fatal(err)
	}
	if want := testdb.CitusCluster(t).Port(); u.Port() == "" || u.Port() != strconv.Itoa(want) {
		t.Fatalf("URL port %s, want the coordinator's %d", u.Port(), want)
	}
}

// CitusTasks counts a plan's tasks: one for a statement routed by its
// distribution key, one per shard for one that fans out, and a job per
// subplan.
func TestCitusTasks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewCitus(t)
	_, err := pool.Exec(ctx, `CREATE TABLE planned (bucket smallint NOT NULL, id bigint NOT NULL, PRIMARY KEY (bucket, id));
		SELECT create_distributed_table('planned', 'bucket', shard_count => 4)`)
	require.NoError(t, err)

	require.Equal(t, []int{1}, testdb.CitusTasks(t, pool, `UPDATE planned SET id = id WHERE bucket = $1 AND id = $2`, 7, 1))
	require.Equal(t, []int{4}, testdb.CitusTasks(t, pool, `SELECT count(*) FROM planned`))
	require.Equal(t, []int{1, 4}, testdb.CitusTasks(t, pool,
		`SELECT * FROM planned WHERE bucket = 7 AND id IN (SELECT max(id) FROM planned)`))
}

// A database of NewDistributed has Tally's tables where Placements says,
// copied from a template distributed once; URLOf names its coordinator.
func TestDistributedDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewDistributed(t)
	e, err := migrations.ReadEngine(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, e.Misplaced())
	require.Equal(t, []int{1}, testdb.CitusTasks(t, pool,
		`SELECT id FROM outbox_item_states WHERE bucket = $1 AND id = $2 FOR UPDATE SKIP LOCKED`, int16(7), int64(1)))

	var on string
	require.NoError(t, pool.QueryRow(ctx, `SHOW citus.enable_unsafe_triggers`).Scan(&on))
	require.Equal(t, "on", on, "a copy keeps the distributed tables' trigger setting")
	u, err := url.Parse(testdb.URLOf(t, pool))
	require.NoError(t, err)
	require.Equal(t, strconv.Itoa(testdb.CitusCluster(t).Port()), u.Port())
}
