package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

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
	// defaultMaxConns sizes a node's pool unless the URL sets
	// pool_max_conns.
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
	Pool    *pgxpool.Pool
	cluster *embeddedpg.Cluster
	logger  *slog.Logger
}

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
// Then it applies every migration.
func Open(ctx context.Context, cfg config.Config, logger *slog.Logger, attach bool) (*DB, error) {
	d := &DB{logger: logger}
	url := cfg.DatabaseURL
	if url == "" && attach {
		attached, ok, err := embeddedpg.Attach(cfg.DataDir, embeddedDatabase)
		if err != nil {
			return nil, err
		}
		if ok {
			url = attached
		}
	}
	if url == "" {
		c, err := embeddedpg.Start(ctx, embeddedpg.Config{DataDir: cfg.DataDir, Logger: logger})
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
		// pgxpool's default (4 on small machines) starves a node: ingest
		// requests, deliverer claims and outcome batches, River and the
		// maintenance pass all hold connections.
		pcfg.MaxConns = defaultMaxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		d.stopCluster()
		return nil, fmt.Errorf("connecting to Postgres: %w", err)
	}
	d.Pool = pool
	res, err := migrations.Apply(ctx, pool, logger)
	if err != nil {
		d.Close()
		return nil, err
	}
	logger.Info("database ready", "schema_version", res.TallyVersion,
		"applied", res.TallyApplied, "river_applied", res.RiverApplied, "embedded", d.cluster != nil)
	return d, nil
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
		attached, ok, err := embeddedpg.Attach(cfg.DataDir, embeddedDatabase)
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
