package app_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/testkit/pgbouncer"
	"github.com/tallymeter/tally/internal/testkit/testcert"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

func TestWorkloadPoolsCutStatementsAtTheirOwnTimeoutsAndKeepTheirSizes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := map[string]string{"TALLY_DATABASE_URL": testdb.URL(t), "TALLY_READ_TIMEOUT": "300ms",
		"TALLY_POOL_INGEST": "3", "TALLY_POOL_EXPORT": "4", "TALLY_POOL_RIVER": "5", "TALLY_POOL_READS": "2"}
	fs := flag.NewFlagSet("pools", flag.ContinueOnError)
	load := config.Flags(fs, func(k string) string { return env[k] })
	require.NoError(t, fs.Parse(nil))
	cfg, err := load()
	require.NoError(t, err)
	db, err := app.Open(ctx, cfg, slog.New(slog.DiscardHandler), false)
	require.NoError(t, err)
	defer db.Close()
	pools, err := db.OpenPools(ctx, cfg)
	require.NoError(t, err)
	defer pools.Close()

	show := func(p *pgxpool.Pool, name string) string {
		var v string
		require.NoError(t, p.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&v))
		return v
	}
	for _, c := range []struct {
		name          string
		pool          *pgxpool.Pool
		size          int32
		timeout, idle string
	}{
		{"ingest", pools.Ingest, 3, "20s", "20s"},
		{"export", pools.Export, 4, "1min", "30s"},
		{"river", pools.River, 5, "1min", "30s"},
		{"reads", pools.Reads, 2, "300ms", "300ms"},
	} {
		require.Equal(t, c.size, c.pool.Config().MaxConns, c.name)
		require.Equal(t, c.timeout, show(c.pool, "statement_timeout"), c.name)
		require.Equal(t, c.idle, show(c.pool, "idle_in_transaction_session_timeout"), c.name)
		require.Equal(t, "off", show(c.pool, "jit"), "%s: no statement of Tally's pays a JIT compilation (pgsession)", c.name)
		require.Equal(t, "0", show(c.pool, "max_parallel_workers_per_gather"), "%s: nor a parallel worker's start", c.name)
	}
	require.Equal(t, "0", show(db.Pool, "statement_timeout"), "migrations and the operator commands have no timeout")
	require.Equal(t, "off", show(db.Pool, "jit"))
	require.Equal(t, "0", show(db.Pool, "max_parallel_workers_per_gather"))
	conn, err := app.Connect(ctx, cfg)
	require.NoError(t, err)
	defer conn.Close()
	require.Equal(t, "off", show(conn, "jit"))

	_, err = pools.Reads.Exec(ctx, "SELECT pg_sleep(2)")
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "a read running past the read timeout is cut: %v", err)
	require.Equal(t, "57014", pgErr.Code, "query_canceled")
	_, err = pools.Ingest.Exec(ctx, "SELECT pg_sleep(0.5)")
	require.NoError(t, err, "ingest's timeout is its own")
}

// With TALLY_DATABASE_OWNER_URL, DB.Pool (migrations, operator commands)
// connects as the owner and the workload pools as TALLY_DATABASE_URL's
// role, a member of the runtime role.
func TestOwnerURLMigratesAndTheWorkloadsConnectAsTheRuntimeRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ownerURL := testdb.URL(t)
	var suffix [4]byte
	_, _ = rand.Read(suffix[:])
	role := "app_runtime_" + hex.EncodeToString(suffix[:])
	admin, err := pgxpool.New(ctx, ownerURL)
	require.NoError(t, err)
	defer admin.Close()
	_, err = admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN PASSWORD 'pw' IN ROLE tally_runtime")
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })
	u, err := url.Parse(ownerURL)
	require.NoError(t, err)
	u.User = url.UserPassword(role, "pw")

	env := map[string]string{"TALLY_DATABASE_URL": u.String(), "TALLY_DATABASE_OWNER_URL": ownerURL}
	fs := flag.NewFlagSet("owner", flag.ContinueOnError)
	load := config.Flags(fs, func(k string) string { return env[k] })
	require.NoError(t, fs.Parse(nil))
	cfg, err := load()
	require.NoError(t, err)
	db, err := app.Open(ctx, cfg, slog.New(slog.DiscardHandler), false)
	require.NoError(t, err)
	defer db.Close()
	pools, err := db.OpenPools(ctx, cfg)
	require.NoError(t, err)
	defer pools.Close()
	user := func(p *pgxpool.Pool) string {
		var v string
		require.NoError(t, p.QueryRow(ctx, "SELECT current_user").Scan(&v))
		return v
	}
	require.NotEqual(t, role, user(db.Pool))
	for _, p := range []*pgxpool.Pool{pools.Ingest, pools.Export, pools.River, pools.Reads} {
		require.Equal(t, role, user(p))
	}
	_, err = pools.Ingest.Exec(ctx, "DELETE FROM usage_events")
	require.ErrorContains(t, err, "permission denied")
}

// loadConfig is the configuration of env.
func loadConfig(t *testing.T, env map[string]string) config.Config {
	t.Helper()
	fs := flag.NewFlagSet("pools", flag.ContinueOnError)
	load := config.Flags(fs, func(k string) string { return env[k] })
	require.NoError(t, fs.Parse(nil))
	cfg, err := load()
	require.NoError(t, err)
	return cfg
}

// Behind PgBouncer in transaction mode (TALLY_DATABASE_POOLED) every pool
// runs its statements unnamed, the sessions have pgsession's settings
// without startup parameters, and what needs a session (River, LISTEN)
// connects to the direct URL, or, without one, polls.
func TestPooledPoolsRunThroughPgBouncerAndSessionsGoDirect(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct := testdb.URL(t)
	bouncer := pgbouncer.Start(t, direct)
	for _, withDirect := range []bool{false, true} {
		env := map[string]string{"TALLY_DATABASE_URL": bouncer.URL(direct), "TALLY_DATABASE_POOLED": "true"}
		if withDirect {
			env["TALLY_DATABASE_DIRECT_URL"] = direct
		}
		cfg := loadConfig(t, env)
		db, err := app.Open(ctx, cfg, slog.New(slog.DiscardHandler), false)
		require.NoError(t, err, "migrating through the pooler")
		pools, err := db.OpenPools(ctx, cfg)
		require.NoError(t, err)
		pooled := []*pgxpool.Pool{db.Pool, pools.Ingest, pools.Export, pools.Reads}
		if withDirect {
			require.NotNil(t, pools.Listen, "the deliverers listen past the pooler")
			directPort := pools.River.Config().ConnConfig.Port
			require.NotEqual(t, pools.Ingest.Config().ConnConfig.Port, directPort, "River's pool connects past the pooler")
			require.Equal(t, directPort, pools.Listen.Port)
			require.Equal(t, pgx.QueryExecModeCacheStatement, pools.River.Config().ConnConfig.DefaultQueryExecMode, "River's pool is a session's")
			require.Equal(t, "60000", pools.River.Config().ConnConfig.RuntimeParams["statement_timeout"])
		} else {
			require.Nil(t, pools.Listen, "no session to listen on: River and the deliverers poll")
			pooled = append(pooled, pools.River)
		}
		for _, p := range pooled {
			require.Equal(t, pgx.QueryExecModeCacheDescribe, p.Config().ConnConfig.DefaultQueryExecMode)
			require.Empty(t, p.Config().ConnConfig.RuntimeParams, "a pooler refuses startup parameters")
			// The same statement, again and again, from every connection:
			// a prepared statement would be missing on the next server
			// connection.
			for range 3 * p.Config().MaxConns {
				var jit string
				require.NoError(t, p.QueryRow(ctx, "SELECT current_setting('jit') FROM usage_events WHERE false UNION ALL SELECT current_setting($1)", "jit").Scan(&jit))
				require.Equal(t, "off", jit)
			}
		}
		pools.Close()
		db.Close()
	}
	require.Contains(t, bouncer.Log(), "login attempt")
}

// A pool verifies Postgres's certificate against the authority the URL
// names (sslmode=verify-full), as a managed Postgres is reached, and every
// session is encrypted; a certificate of another authority is refused.
func TestPoolsConnectWithVerifiedTLS(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tlsURL := testdb.TLS(t, testdb.URL(t))
	cfg := loadConfig(t, map[string]string{"TALLY_DATABASE_URL": tlsURL})
	db, err := app.Open(ctx, cfg, slog.New(slog.DiscardHandler), false)
	require.NoError(t, err)
	defer db.Close()
	pools, err := db.OpenPools(ctx, cfg)
	require.NoError(t, err)
	defer pools.Close()
	for _, p := range []*pgxpool.Pool{db.Pool, pools.Ingest, pools.Export, pools.River, pools.Reads} {
		var ssl bool
		require.NoError(t, p.QueryRow(ctx, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&ssl))
		require.True(t, ssl)
	}

	other := filepath.Join(t.TempDir(), "other-ca.pem")
	require.NoError(t, os.WriteFile(other, testcert.NewCA(t).Cert, 0o600))
	u, err := url.Parse(tlsURL)
	require.NoError(t, err)
	q := u.Query()
	q.Set("sslrootcert", other)
	u.RawQuery = q.Encode()
	_, err = app.Connect(ctx, loadConfig(t, map[string]string{"TALLY_DATABASE_URL": u.String()}))
	require.Error(t, err, "a server whose certificate another authority signed is refused")
}
