// Package testdb gives every test its own migrated PostgreSQL database on a
// real server: one throwaway cluster per test process (started on first use
// from the machine's PostgreSQL binaries) or the server at
// TALLY_TEST_DATABASE_URL when that is set. Each database is a copy of a
// template migrated once per process, so a test gets a fresh schema in tens
// of milliseconds and may run with t.Parallel(). NewCitus does the same on
// a throwaway Citus cluster, a coordinator and two workers, built from the
// PostgreSQL with Citus that `make citus` builds (citus.go).
//
// It is for tests only and never mocks the database. It drops only the
// databases it created.
package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/embeddedpg"
	"github.com/tallymeter/tally/internal/pgsession"
	"github.com/tallymeter/tally/migrations"
)

// EnvURL names the variable that points the tests at an existing server
// instead of a throwaway cluster. Its user needs CREATEDB.
const EnvURL = "TALLY_TEST_DATABASE_URL"

// EnvDurable names the variable that, set to 1, starts the tests' own
// cluster with the embedded default's durability — fsync and
// synchronous_commit on, on the disk under the temporary directory, not
// tmpfs — instead of a throwaway one: for the benchmarks of `make
// bench-durable`, which measure what a commit costs where the data is kept.
const EnvDurable = "TALLY_TEST_DURABLE"

type server struct {
	cluster  *embeddedpg.Cluster // nil when EnvURL is used
	dir      string              // the cluster's temporary directory
	base     *url.URL            // any database on the server; the path is replaced
	admin    *pgxpool.Pool       // on the maintenance database
	template string
	strategy string // " STRATEGY FILE_COPY" on PostgreSQL 15 and later
	prefix   string // of every database name this process creates
	err      error
}

var (
	once    sync.Once
	srv     server
	counter atomic.Int64
)

// Main runs the package's tests and then stops the throwaway cluster and
// removes its files. Call it from TestMain:
//
//	func TestMain(m *testing.M) { testdb.Main(m) }
func Main(m *testing.M) {
	code := m.Run()
	shutdown()
	os.Exit(code)
}

// New returns a pool on a fresh, migrated database private to t. The pool is
// closed and the database dropped when t ends. With EnvEngine=citus the
// database is distributed on the tests' Citus cluster (DistributedURL).
func New(t testing.TB) *pgxpool.Pool {
	t.Helper()
	u := URL(t)
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testdb: connecting: %v", err)
	}
	t.Cleanup(pool.Close) // runs before URL's cleanup drops the database
	return pool
}

// URLOf returns the URL of the database pool (from New) is on, for tests
// that need connections of their own beside the pool.
func URLOf(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	cc := pool.Config().ConnConfig
	if c := citusSrv.cluster; c != nil && int(cc.Port) == c.Port() {
		return c.URL(cc.Database)
	}
	return withDatabase(srv.base, cc.Database)
}

// URL returns the URL of a fresh, migrated database private to t, dropped
// when t ends. Use it for code that opens its own connections. With
// EnvEngine=citus it is DistributedURL's.
func URL(t testing.TB) string {
	t.Helper()
	if OnCitus() {
		return DistributedURL(t)
	}
	once.Do(start)
	if srv.err != nil {
		t.Fatalf("testdb: %v", srv.err)
	}
	name := fmt.Sprintf("%s_%d", srv.prefix, counter.Add(1))
	ctx := context.Background()
	if _, err := srv.admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+
		" TEMPLATE "+pgx.Identifier{srv.template}.Sanitize()+srv.strategy); err != nil {
		t.Fatalf("testdb: creating database %s: %v", name, err)
	}
	// A copy does not inherit its template's defaults: set pgsession's, as
	// the migrations did on the template.
	for _, s := range pgsession.Statements(name) {
		if _, err := srv.admin.Exec(ctx, s); err != nil {
			t.Fatalf("testdb: setting database %s's session defaults: %v", name, err)
		}
	}
	t.Cleanup(func() {
		if _, err := srv.admin.Exec(context.Background(),
			"DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("testdb: dropping database %s: %v", name, err)
		}
	})
	return withDatabase(srv.base, name)
}

func withDatabase(base *url.URL, name string) string {
	u := *base
	u.Path = "/" + name
	return u.String()
}

func start() {
	srv.err = func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		var suffix [4]byte
		_, _ = rand.Read(suffix[:])
		srv.prefix = fmt.Sprintf("tally_test_%d_%s", os.Getpid(), hex.EncodeToString(suffix[:]))
		srv.template = srv.prefix + "_template"

		if env := os.Getenv(EnvURL); env != "" {
			u, err := url.Parse(env)
			if err != nil {
				return fmt.Errorf("%s is not a URL: %w", EnvURL, err)
			}
			srv.base = u
		} else {
			durable := os.Getenv(EnvDurable) == "1"
			root := scratchRoot()
			if durable {
				root = os.TempDir()
			}
			dir, err := os.MkdirTemp(root, "tally-test-pg-")
			if err != nil {
				return err
			}
			srv.dir = dir
			// The cluster runs as an unprivileged user when the tests run as
			// root; it must be able to enter the directory.
			if err := os.Chmod(dir, 0o755); err != nil {
				return err
			}
			c, err := embeddedpg.Start(ctx, embeddedpg.Config{
				DataDir:   dir,
				Ephemeral: !durable,
				Logger:    slog.New(slog.DiscardHandler),
			})
			if err != nil {
				return err
			}
			srv.cluster = c
			if srv.base, err = url.Parse(c.URL("postgres")); err != nil {
				return err
			}
		}

		admin, err := pgxpool.New(ctx, withDatabase(srv.base, strings.TrimPrefix(srv.base.Path, "/")))
		if err != nil {
			return fmt.Errorf("connecting to the test server: %w", err)
		}
		srv.admin = admin
		var version int
		if err := admin.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
			return fmt.Errorf("reading the server version: %w", err)
		}
		if version >= 150000 {
			// The file copy beats WAL-logging the copy for small databases.
			srv.strategy = " STRATEGY FILE_COPY"
		}
		return buildTemplate(ctx)
	}()
}

func buildTemplate(ctx context.Context) error {
	if _, err := srv.admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{srv.template}.Sanitize()); err != nil {
		return fmt.Errorf("creating the template: %w", err)
	}
	pool, err := pgxpool.New(ctx, withDatabase(srv.base, srv.template))
	if err != nil {
		return err
	}
	_, err = migrations.Apply(ctx, pool, nil)
	pool.Close()
	if err != nil {
		return fmt.Errorf("migrating the template: %w", err)
	}
	return nil
}

func shutdown() {
	shutdownCitus()
	if srv.admin != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if srv.cluster == nil {
			// A shared server: drop what this process made.
			rows, err := srv.admin.Query(ctx, "SELECT datname FROM pg_database WHERE starts_with(datname, $1)", srv.prefix)
			if err == nil {
				names, _ := pgx.CollectRows(rows, pgx.RowTo[string])
				for _, n := range names {
					_, _ = srv.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{n}.Sanitize()+" WITH (FORCE)")
				}
			}
		}
		srv.admin.Close()
	}
	if srv.cluster != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = srv.cluster.Stop(ctx)
	}
	if srv.dir != "" {
		_ = os.RemoveAll(srv.dir)
	}
}

// PlanNodes returns a node of EXPLAIN (FORMAT JSON)'s plan and every node
// under it, for tests that count what a statement read.
func PlanNodes(n any) []map[string]any {
	m, ok := n.(map[string]any)
	if !ok {
		return nil
	}
	out := []map[string]any{m}
	if subs, ok := m["Plans"].([]any); ok {
		for _, s := range subs {
			out = append(out, PlanNodes(s)...)
		}
	}
	return out
}
