package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/embeddedpg"
	"github.com/tallymeter/tally/migrations"
)

const (
	// embeddedDatabase is the database Tally uses inside its embedded
	// cluster.
	embeddedDatabase = "tally"
	// defaultMaxConns sizes DB.Pool unless the URL sets pool_max_conns;
	// serve's workloads have pools of their own (Pools).
	defaultMaxConns = 24
	// clusterStopTimeout bounds stopping the embedded cluster.
	clusterStopTimeout = 30 * time.Second
	// connectMaxConns sizes the pool of Connect: a diagnosis needs few.
	connectMaxConns = 4
	// connectPingTimeout bounds Connect's first ping.
	connectPingTimeout = 5 * time.Second
)

// DB is an open, migrated database, and the embedded cluster behind it when
// there is one.
type DB struct {
	// Pool is the pool of migrations, the operator commands and the
	// node's own checks (start, readiness, heartbeats): no statement
	// timeout. Serve runs its workloads on Pools of their own.
	Pool    *pgxpool.Pool
	cluster *embeddedpg.Cluster
	logger  *slog.Logger
	// url is the database's URL, the one serve's workload pools connect
	// to: the runtime role's. Pool connects as the owner (ownerURL), who
	// migrates; both are one role on a single-role install.
	url, ownerURL string
	// pooled says url and ownerURL go through a transaction-mode pooler;
	// directURL, when set, reaches Postgres past it as url's role.
	pooled    bool
	directURL string
}

// runtimeLogin is the login role the nodes connect to the embedded cluster
// as, a member of migrations.RuntimeRole.
const runtimeLogin = "tally_app"

// Done is closed when the embedded cluster stops; nil (never ready) for an
// external database.
func (d *DB) Done() <-chan struct{} {
	if d.cluster == nil {
		return nil
	}
	return d.cluster.Done()
}

// Close closes the pool and stops the embedded cluster, if any.
func (d *DB) Close() {
	d.Pool.Close()
	if d.cluster != nil {
		ctx, cancel := context.WithTimeout(context.Background(), clusterStopTimeout)
		defer cancel()
		if err := d.cluster.Stop(ctx); err != nil {
			d.logger.Error("stopping the embedded postgres", "error", err)
		}
	}
}

// Open connects to cfg.DatabaseURL or, when it is empty, to the embedded
// cluster in cfg.DataDir: with attach, the one a running `tally serve` or
// `tally dev` started there, if any; otherwise it starts (or reuses) it.
// Then it applies every migration, as the owner (cfg.DatabaseOwnerURL, or
// the same role). Pool connects as the owner; serve's workload pools as
// cfg.DatabaseURL's role or, on the embedded cluster it started, as
// runtimeLogin, which holds only the runtime role's privileges.
func Open(ctx context.Context, cfg config.Config, logger *slog.Logger, attach bool) (*DB, error) {
	d := &DB{logger: logger}
	url := cfg.DatabaseURL
	if cfg.DatabaseOwnerURL != "" && url != "" {
		url = cfg.DatabaseOwnerURL
	}
	if url == "" && attach {
		attached, ok, err := attachEmbedded(cfg)
		if err != nil {
			return nil, err
		}
		if ok {
			url = attached
		}
	}
	if url == "" {
		ecfg, err := embeddedConfig(cfg, logger)
		if err != nil {
			return nil, err
		}
		c, err := embeddedpg.Start(ctx, ecfg)
		if err != nil {
			return nil, err
		}
		d.cluster = c
		if err := c.EnsureDatabase(ctx, embeddedDatabase); err != nil {
			d.stopCluster()
			return nil, err
		}
		url = c.URL(embeddedDatabase)
	}
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		d.stopCluster()
		// The URL may hold a password: never echo it.
		return nil, errors.New("TALLY_DATABASE_URL is not a valid Postgres URL")
	}
	if !strings.Contains(url, "pool_max_conns") {
		// pgxpool's default (4 on small machines) starves a command that
		// drives a domain part as serve would (dev's set-up, benchmarks).
		pcfg.MaxConns = defaultMaxConns
	}
	d.pooled, d.directURL = cfg.DatabasePooled, cfg.DatabaseDirectURL
	if _, err := pgxpool.ParseConfig(d.directURL); d.directURL != "" && err != nil {
		d.stopCluster()
		return nil, errors.New("TALLY_DATABASE_DIRECT_URL is not a valid Postgres URL")
	}
	pooledMode(pcfg, url, d.pooled)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		d.stopCluster()
		return nil, fmt.Errorf("connecting to Postgres: %w", err)
	}
	d.Pool, d.url, d.ownerURL = pool, url, url
	res, err := migrations.Apply(ctx, pool, logger)
	if err != nil {
		d.Close()
		return nil, err
	}
	placed := false
	if d.cluster != nil && cfg.EmbeddedWorkers > 0 {
		// The embedded Citus cluster is Tally's own: its tables are placed
		// as they must be, which does nothing once they are.
		dist, err := migrations.Distribute(ctx, pool, logger)
		if err != nil {
			d.Close()
			return nil, err
		}
		if placed = dist.Changed(); placed {
			logger.Info("tables placed", "placement", dist.String())
		}
	}
	if res.TallyApplied > 0 || placed {
		// The sessions opened before a migration or the placement set the
		// database's session defaults (pgsession) lack them.
		pool.Reset()
	}
	switch {
	case cfg.DatabaseURL != "":
		d.url = cfg.DatabaseURL
	case d.cluster != nil:
		if d.url, err = d.cluster.EnsureLoginRole(ctx, embeddedDatabase, runtimeLogin, migrations.RuntimeRole); err != nil {
			d.Close()
			return nil, err
		}
	}
	logger.Info("database ready", "schema_version", res.TallyVersion,
		"applied", res.TallyApplied, "river_applied", res.RiverApplied, "embedded", d.cluster != nil)
	return d, nil
}

// citusDirName is the directory of the data directory that holds the
// embedded Citus cluster (cfg.EmbeddedWorkers): beside the plain cluster,
// never in it, since a database with the extension no longer runs on a
// server without Citus.
const citusDirName = "citus"

// CitusDataDir is where the embedded Citus cluster of the data directory
// dataDir lives.
func CitusDataDir(dataDir string) string { return filepath.Join(dataDir, citusDirName) }

// embeddedConfig is the embedded cluster of cfg: a plain server in the
// data directory, or with cfg.EmbeddedWorkers a Citus coordinator and its
// workers in CitusDataDir, from the PostgreSQL with Citus `make citus`
// built.
func embeddedConfig(cfg config.Config, logger *slog.Logger) (embeddedpg.Config, error) {
	if cfg.EmbeddedWorkers == 0 {
		return embeddedpg.Config{DataDir: cfg.DataDir, Logger: logger}, nil
	}
	bin, err := embeddedpg.FindCitus()
	if err != nil {
		return embeddedpg.Config{}, fmt.Errorf("TALLY_EMBEDDED_WORKERS=%d: %w", cfg.EmbeddedWorkers, err)
	}
	return embeddedpg.Config{DataDir: CitusDataDir(cfg.DataDir), Workers: cfg.EmbeddedWorkers, BinDir: bin, Logger: logger}, nil
}

// attachEmbedded is embeddedpg.Attach on the cluster a running serve or
// dev started in the data directory, plain or Citus, whichever runs:
// an operator command beside it need not repeat TALLY_EMBEDDED_WORKERS.
// The kind cfg names is looked for first.
func attachEmbedded(cfg config.Config) (string, bool, error) {
	dirs := []string{cfg.DataDir, CitusDataDir(cfg.DataDir)}
	if cfg.EmbeddedWorkers > 0 {
		dirs[0], dirs[1] = dirs[1], dirs[0]
	}
	for _, dir := range dirs {
		if u, ok, err := embeddedpg.Attach(dir, embeddedDatabase); err != nil || ok {
			return u, ok, err
		}
	}
	return "", false, nil
}

func (d *DB) stopCluster() {
	if d.cluster != nil {
		ctx, cancel := context.WithTimeout(context.Background(), clusterStopTimeout)
		defer cancel()
		_ = d.cluster.Stop(ctx)
	}
}

// ErrNoEmbedded says no embedded cluster runs in the data directory.
var ErrNoEmbedded = errors.New("no TALLY_DATABASE_URL, and no tally serve or dev runs an embedded cluster in the data directory")

// Connect opens a pool on cfg.DatabaseURL or on the embedded cluster a
// running serve or dev started in cfg.DataDir — without starting a cluster
// or applying migrations: what a diagnosis needs.
func Connect(ctx context.Context, cfg config.Config) (*pgxpool.Pool, error) {
	url := cfg.DatabaseURL
	if url == "" {
		attached, ok, err := attachEmbedded(cfg)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, ErrNoEmbedded
		}
		url = attached
	}
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, errors.New("TALLY_DATABASE_URL is not a valid Postgres URL")
	}
	pcfg.MaxConns = connectMaxConns
	pooledMode(pcfg, url, cfg.DatabasePooled)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to Postgres: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, connectPingTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			return nil, fmt.Errorf("postgres refused the connection: %s (%s)", pgErr.Message, pgErr.Code)
		}
		return nil, errors.New("postgres did not answer (is it running, is the host and port right?)")
	}
	return pool, nil
}

// pooledMode makes pcfg, parsed from url, fit a transaction-mode pooler
// when pooled: consecutive transactions of one client may run on different
// server connections, so a statement prepared on one may be missing on the
// next, and PgBouncer before 1.21 forwards no protocol-level prepared
// statements at all. Statements are then described and run unnamed
// (pgx's cache_describe: one round trip, the description cached per
// client connection) unless the URL names default_query_exec_mode.
func pooledMode(pcfg *pgxpool.Config, url string, pooled bool) {
	if pooled && !strings.Contains(url, "default_query_exec_mode") {
		pcfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	}
}

// The session bounds of the workload pools: how long one statement may run,
// and how long a session may sit idle inside a transaction. Reads are the
// shortest (config.DefaultReadTimeout, TALLY_READ_TIMEOUT, 15 s); ingest (20 s) answers a
// client waiting on it; export and River run passes and batches.
const (
	ingestStatementTimeout = 20 * time.Second
	exportStatementTimeout = 60 * time.Second
	riverStatementTimeout  = 60 * time.Second
	// idleInTransactionTimeout ends a session left idle inside a
	// transaction (a stuck client of the pool), releasing its locks; no
	// workload waits on anything but Postgres inside one.
	idleInTransactionTimeout = 30 * time.Second
)

// Pools are serve's connection pools, one per workload, all to the one
// database, so that no workload can take another's connections: a burst of
// reports waits on Reads while ingest, export and River's leader election
// go on. Each session has its pool's statement_timeout and
// idle_in_transaction_session_timeout.
type Pools struct {
	// Ingest serves the API's writes: usage, mapping changes, requeues,
	// recoveries, the webhook.
	Ingest *pgxpool.Pool
	// Export serves the deliverers, the outbox maintenance pass and
	// River's jobs (staging, reconciliation).
	Export *pgxpool.Pool
	// River is River's own: leader election, notifications, fetches,
	// completions.
	River *pgxpool.Pool
	// Reads serves the reports, the console and the API's GETs.
	Reads *pgxpool.Pool
	// Listen is what the deliverers' listeners connect with: a session
	// past any pooler. Nil when the database is pooled and no direct URL
	// was given: then River runs poll-only and the deliverers poll.
	Listen *pgx.ConnConfig
}

// OpenPools opens serve's workload pools on d's database, sized and bounded
// by cfg.Pools. They connect lazily: nothing is dialled until a workload
// asks. On a pooled database River's pool connects past the pooler when
// there is a direct URL: its leader and its notifications need a session.
func (d *DB) OpenPools(ctx context.Context, cfg config.Config) (*Pools, error) {
	p := &Pools{}
	riverURL, riverPooled := d.url, d.pooled
	if d.pooled && d.directURL != "" {
		riverURL, riverPooled = d.directURL, false
	}
	for _, w := range []struct {
		dst     **pgxpool.Pool
		url     string
		pooled  bool
		size    int
		timeout time.Duration
	}{
		{&p.Ingest, d.url, d.pooled, cfg.Pools.Ingest, ingestStatementTimeout},
		{&p.Export, d.url, d.pooled, cfg.Pools.Export, exportStatementTimeout},
		{&p.River, riverURL, riverPooled, cfg.Pools.River, riverStatementTimeout},
		{&p.Reads, d.url, d.pooled, cfg.Pools.Reads, cfg.Pools.ReadTimeout},
	} {
		pool, err := workloadPool(ctx, w.url, w.pooled, w.size, w.timeout)
		if err != nil {
			p.Close()
			return nil, err
		}
		*w.dst = pool
	}
	switch {
	case !d.pooled:
		p.Listen = p.Export.Config().ConnConfig
	case d.directURL != "":
		p.Listen = p.River.Config().ConnConfig
	}
	return p, nil
}

// workloadPool is one pool of size connections on url whose sessions cut a
// statement after timeout and a transaction left idle after
// idleInTransactionTimeout (or timeout, when shorter). Behind a pooler
// (pooled) a session's bounds cannot be sent, since a pooler refuses such
// startup parameters; the pooler's own (PgBouncer's query_timeout and
// idle_transaction_timeout) or the role's stand for them
// (docs/operations.md).
func workloadPool(ctx context.Context, url string, pooled bool, size int, timeout time.Duration) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		// Open parsed it already; the URL may hold a password: never echo it.
		return nil, errors.New("TALLY_DATABASE_URL is not a valid Postgres URL")
	}
	pcfg.MaxConns = int32(size)
	pooledMode(pcfg, url, pooled)
	if !pooled {
		params := pcfg.ConnConfig.RuntimeParams
		params["statement_timeout"] = strconv.FormatInt(timeout.Milliseconds(), 10)
		params["idle_in_transaction_session_timeout"] = strconv.FormatInt(min(timeout, idleInTransactionTimeout).Milliseconds(), 10)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to Postgres: %w", err)
	}
	return pool, nil
}

// Close closes the pools that are open.
func (p *Pools) Close() {
	for _, pool := range []*pgxpool.Pool{p.Ingest, p.Export, p.River, p.Reads} {
		if pool != nil {
			pool.Close()
		}
	}
}
