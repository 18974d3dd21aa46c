package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/embeddedpg"
	"github.com/tallymeter/tally/internal/pgsession"
	"github.com/tallymeter/tally/migrations"
)

// EnvRequireCitus names the variable that, set to 1, makes a test on
// Citus fail, instead of skipping, when `make citus` has not built Citus.
// CI sets it.
const EnvRequireCitus = "TALLY_REQUIRE_CITUS"

// CitusWorkers is how many workers the tests' Citus cluster has.
const CitusWorkers = 2

// citusServer is the tests' Citus cluster: a coordinator and CitusWorkers
// workers, one per test process, started on first use.
type citusServer struct {
	cluster  *embeddedpg.Cluster
	dir      string
	nodes    []*pgxpool.Pool // on each node's maintenance database, the coordinator first
	template string          // on every node, connections not allowed
	prefix   string
	skip     string // why there is none: `make citus` has not run
	err      error
}

var (
	citusOnce sync.Once
	citusSrv  citusServer
)

// NewCitus is New on the tests' Citus cluster: a pool on the coordinator,
// in a fresh database private to t, on every node, with the extension on
// every node, the workers added and the migrations applied (on the
// coordinator). The pool is closed and the database dropped on every node
// when t ends. Without Citus built (`make citus`), it skips t, or fails it
// when EnvRequireCitus is 1.
func NewCitus(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return citusPool(t, CitusURL(t))
}

// citusPool is a pool on the Citus database at u, closed when t ends.
func citusPool(t testing.TB, u string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testdb: connecting: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// CitusURL is URL on the tests' Citus cluster: the coordinator's URL of a
// fresh database like NewCitus's.
func CitusURL(t testing.TB) string {
	t.Helper()
	CitusCluster(t)
	return citusCopy(t, citusSrv.template)
}

// citusCopy creates a fresh database private to t on every node from
// template, with pgsession's defaults and then settings (statements with
// one %s for the database's name), dropped when t ends, and returns the
// coordinator's URL of it.
func citusCopy(t testing.TB, template string, settings ...string) string {
	t.Helper()
	name := fmt.Sprintf("%s_%d", citusSrv.prefix, counter.Add(1))
	id := pgx.Identifier{name}.Sanitize()
	ctx := context.Background()
	for _, admin := range citusSrv.nodes {
		if _, err := admin.Exec(ctx, "CREATE DATABASE "+id+
			" TEMPLATE "+pgx.Identifier{template}.Sanitize()+" STRATEGY FILE_COPY"); err != nil {
			t.Fatalf("testdb: creating database %s: %v", name, err)
		}
		for _, s := range pgsession.Statements(name) {
			if _, err := admin.Exec(ctx, s); err != nil {
				t.Fatalf("testdb: setting database %s's session defaults: %v", name, err)
			}
		}
		for _, s := range settings {
			if _, err := admin.Exec(ctx, fmt.Sprintf(s, id)); err != nil {
				t.Fatalf("testdb: setting database %s's defaults: %v", name, err)
			}
		}
	}
	t.Cleanup(func() {
		if err := dropCitusDatabase(name); err != nil {
			t.Errorf("testdb: dropping database %s: %v", name, err)
		}
	})
	return citusSrv.cluster.URL(name)
}

// dropCitusDatabase drops name on every node. Citus's maintenance daemons,
// which WITH (FORCE) does not end, connect to every database with the
// extension on every node, the workers' to each other's: the database
// first takes no new connections anywhere, then each node drops it,
// tried again while a daemon is still on its way out.
func dropCitusDatabase(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	id := pgx.Identifier{name}.Sanitize()
	for _, admin := range citusSrv.nodes {
		if _, err := admin.Exec(ctx, "ALTER DATABASE "+id+" ALLOW_CONNECTIONS false"); err != nil {
			return err
		}
	}
	for _, admin := range citusSrv.nodes {
		for attempt := 1; ; attempt++ {
			_, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+id+" WITH (FORCE)")
			var pgErr *pgconn.PgError
			if err == nil || !errors.As(err, &pgErr) || pgErr.Code != objectInUse || attempt == dropAttempts {
				if err != nil {
					return err
				}
				break
			}
			time.Sleep(dropRetryDelay)
		}
	}
	return nil
}

// How often, and how far apart, a drop of a database a daemon still uses
// is tried again; objectInUse is the SQLSTATE of that refusal.
const (
	dropAttempts   = 50
	dropRetryDelay = 100 * time.Millisecond
	objectInUse    = "55006"
)

// CitusCluster returns the tests' Citus cluster, started on first use,
// for tests that reach its workers (Cluster.Workers). It skips or fails t
// as NewCitus does.
func CitusCluster(t testing.TB) *embeddedpg.Cluster {
	t.Helper()
	citusOnce.Do(startCitus)
	if citusSrv.skip != "" {
		if os.Getenv(EnvRequireCitus) == "1" {
			t.Fatalf("testdb: %s=1 and %s", EnvRequireCitus, citusSrv.skip)
		}
		t.Skipf("testdb: %s", citusSrv.skip)
	}
	if citusSrv.err != nil {
		t.Fatalf("testdb: the Citus cluster: %v", citusSrv.err)
	}
	return citusSrv.cluster
}

// startCitus starts the tests' Citus cluster and builds its template: the
// migrated database, with the extension and the workers, copied by every
// test's database on every node. The copy carries Citus's metadata, which
// names the same nodes. Citus's maintenance daemon holds a session on
// every database with the extension, which a template may not have while
// it is copied: the template then takes no connections.
func startCitus() {
	bin, err := embeddedpg.FindCitus()
	if err != nil {
		citusSrv.skip = err.Error()
		return
	}
	citusSrv.err = func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		var suffix [4]byte
		_, _ = rand.Read(suffix[:])
		citusSrv.prefix = fmt.Sprintf("tally_citus_%d_%s", os.Getpid(), hex.EncodeToString(suffix[:]))
		citusSrv.template = citusSrv.prefix + "_template"
		dir, err := os.MkdirTemp(scratchRoot(), "tally-test-citus-")
		if err != nil {
			return err
		}
		citusSrv.dir = dir
		if err := os.Chmod(dir, 0o755); err != nil {
			return err
		}
		c, err := embeddedpg.Start(ctx, embeddedpg.Config{
			DataDir:   dir,
			Ephemeral: true,
			Workers:   CitusWorkers,
			BinDir:    bin,
			Logger:    slog.New(slog.DiscardHandler),
		})
		if err != nil {
			return err
		}
		citusSrv.cluster = c
		for _, n := range append([]*embeddedpg.Cluster{c}, c.Workers()...) {
			admin, err := pgxpool.New(ctx, n.URL("postgres"))
			if err != nil {
				return fmt.Errorf("connecting to the Citus node on port %d: %w", n.Port(), err)
			}
			citusSrv.nodes = append(citusSrv.nodes, admin)
		}
		if err := c.EnsureDatabase(ctx, citusSrv.template); err != nil {
			return err
		}
		pool, err := pgxpool.New(ctx, c.URL(citusSrv.template))
		if err != nil {
			return err
		}
		_, err = migrations.Apply(ctx, pool, nil)
		pool.Close()
		if err != nil {
			return fmt.Errorf("migrating the Citus template: %w", err)
		}
		for _, admin := range citusSrv.nodes {
			for _, s := range []string{
				"ALTER DATABASE " + pgx.Identifier{citusSrv.template}.Sanitize() + " ALLOW_CONNECTIONS false",
				"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = " + quote(citusSrv.template),
			} {
				if _, err := admin.Exec(ctx, s); err != nil {
					return fmt.Errorf("closing the Citus template: %w", err)
				}
			}
		}
		return nil
	}()
}

// shutdownCitus stops the tests' Citus cluster, if it started, and removes
// its files.
func shutdownCitus() {
	for _, admin := range citusSrv.nodes {
		admin.Close()
	}
	if citusSrv.cluster != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = citusSrv.cluster.Stop(ctx)
	}
	if citusSrv.dir != "" {
		_ = os.RemoveAll(citusSrv.dir)
	}
}

// RemoveWorkers removes every worker from the coordinator's metadata, one
// at a time. Citus's maintenance daemon may be syncing a fresh database's
// node rows at that moment, which fails the removal with "tuple
// concurrently deleted/updated": it is tried again.
func RemoveWorkers(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	rows, err := pool.Query(ctx, "SELECT nodename, nodeport FROM pg_dist_node WHERE groupid > 0")
	if err != nil {
		t.Fatalf("testdb: reading the workers: %v", err)
	}
	type node struct {
		name string
		port int32
	}
	nodes, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (node, error) {
		var n node
		return n, r.Scan(&n.name, &n.port)
	})
	if err != nil {
		t.Fatalf("testdb: reading the workers: %v", err)
	}
	for _, n := range nodes {
		for attempt := 1; ; attempt++ {
			_, err := pool.Exec(ctx, "SELECT citus_remove_node($1, $2)", n.name, n.port)
			if err == nil {
				break
			}
			if attempt == 20 || !strings.Contains(err.Error(), "tuple concurrently") {
				t.Fatalf("testdb: removing worker %s:%d: %v", n.name, n.port, err)
			}
			time.Sleep(250 * time.Millisecond)
		}
	}
}
