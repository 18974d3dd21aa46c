package migrations_test

import (
	"context"
	"path/filepath"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/pgsession"
	"github.com/tallymeter/tally/internal/testkit/pgbouncer"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/migrations"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// emptyDatabase returns a pool on a database with no schema at all: testdb's
// databases come migrated, so this one is made beside it.
func emptyDatabase(t *testing.T) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	base := testdb.New(t)
	name := base.Config().ConnConfig.Database + "_empty"
	_, err := base.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" TEMPLATE template0")
	require.NoError(t, err)
	cfg := base.Config().Copy()
	cfg.ConnConfig.Database = name
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		pool.Close()
		_, _ = base.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
	})
	return pool
}

func TestApplyFromEmptyConcurrentlyThenIdempotent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := emptyDatabase(t)
	require.ErrorIs(t, migrations.Check(ctx, pool), migrations.ErrBehind)

	// Nodes starting together: the advisory lock lets one migrate, and the
	// others find nothing to do.
	var (
		wg      sync.WaitGroup
		results = make([]migrations.Result, 4)
		errs    = make([]error, 4)
	)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = migrations.Apply(ctx, pool, nil)
		}()
	}
	wg.Wait()
	var tally, river int
	for i := range results {
		require.NoError(t, errs[i])
		tally += results[i].TallyApplied
		river += results[i].RiverApplied
		require.Positive(t, results[i].TallyVersion)
	}
	files, err := filepath.Glob("*.sql")
	require.NoError(t, err)
	require.Equal(t, len(files)+1, tally, "Tally's migrations, the SQL files and the session settings' (Go), applied exactly once")
	require.Positive(t, river)
	require.NoError(t, migrations.Check(ctx, pool))

	again, err := migrations.Apply(ctx, pool, nil)
	require.NoError(t, err)
	require.Zero(t, again.TallyApplied)
	require.Zero(t, again.RiverApplied)

	var n int
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM river_job").Scan(&n))
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM outbox_items").Scan(&n))
}

// TestApplySetsTheSessionDefaults: migrating a database makes pgsession's
// settings its defaults, so that every later session has them without a
// startup parameter, through a pooler or not.
func TestApplySetsTheSessionDefaults(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := emptyDatabase(t)
	_, err := migrations.Apply(ctx, pool, nil)
	require.NoError(t, err)
	var settings []string
	require.NoError(t, pool.QueryRow(ctx, `SELECT s.setconfig FROM pg_db_role_setting s
		JOIN pg_database d ON d.oid = s.setdatabase WHERE d.datname = current_database() AND s.setrole = 0`).Scan(&settings))
	for _, s := range pgsession.Settings() {
		require.Contains(t, settings, s.Name+"="+s.Value)
	}
}

// TestApplyNeedsNoSuperuser: a role that owns the database but is no
// superuser, as on a managed Postgres, migrates it, owns every table and
// sets the session defaults.
func TestApplyNeedsNoSuperuser(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	base := testdb.New(t)
	role := base.Config().ConnConfig.Database + "_owner"
	_, err := base.Exec(ctx, "CREATE ROLE "+role+" LOGIN PASSWORD 'pw' NOSUPERUSER")
	require.NoError(t, err)
	_, err = base.Exec(ctx, "CREATE DATABASE "+role+" OWNER "+role+" TEMPLATE template0")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = base.Exec(context.Background(), "DROP DATABASE IF EXISTS "+role+" WITH (FORCE)")
		_, _ = base.Exec(context.Background(), "DROP ROLE IF EXISTS "+role)
	})
	cfg := base.Config().Copy()
	cfg.ConnConfig.Database, cfg.ConnConfig.User, cfg.ConnConfig.Password = role, role, "pw"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	_, err = migrations.Apply(ctx, pool, nil)
	require.NoError(t, err)
	owners, err := migrations.TableOwners(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, migrations.Ownership{Owners: []string{role}}, owners)
	pool.Reset()
	missing, err := pgsession.Missing(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, missing)
}

// TestApplyFromEmptyThroughPgBouncer: nodes starting together migrate an
// empty database through PgBouncer in transaction mode, one at a time: the
// lock is a transaction's, and no statement is prepared.
func TestApplyFromEmptyThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	empty := emptyDatabase(t)
	direct := testdb.URLOf(t, empty)
	cfg, err := pgxpool.ParseConfig(pgbouncer.Start(t, direct).URL(direct))
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe // as TALLY_DATABASE_POOLED
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	var (
		wg      sync.WaitGroup
		results = make([]migrations.Result, 3)
		errs    = make([]error, 3)
	)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = migrations.Apply(ctx, pool, nil)
		}()
	}
	wg.Wait()
	var tally int
	for i := range results {
		require.NoError(t, errs[i])
		tally += results[i].TallyApplied
	}
	files, err := filepath.Glob("*.sql")
	require.NoError(t, err)
	require.Equal(t, len(files)+1, tally, "applied exactly once")
	require.NoError(t, migrations.Check(ctx, pool))
	// A session that starts now has the defaults (the pooler's server
	// connections opened before keep theirs until it replaces them).
	empty.Reset()
	missing, err := pgsession.Missing(ctx, empty)
	require.NoError(t, err)
	require.Empty(t, missing)
}
