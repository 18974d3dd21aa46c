// Package app wires Tally's parts into the commands of cmd/tally: it opens
// the database (starting the embedded cluster when no URL is configured),
// migrates it, and runs the service until its context ends.
//
// It owns process lifecycle only: no SQL of its own beyond creating the
// embedded cluster's database, no domain logic.
package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/embeddedpg"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/migrations"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// embeddedDatabase is the database Tally uses inside its embedded cluster.
const embeddedDatabase = "tally"

// defaultMaxConns sizes a node's pool unless the URL sets pool_max_conns.
const defaultMaxConns = 24

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
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
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
		if err := ensureDatabase(ctx, c); err != nil {
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
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = d.cluster.Stop(ctx)
	}
}

func ensureDatabase(ctx context.Context, c *embeddedpg.Cluster) error {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return fmt.Errorf("connecting to the embedded postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", embeddedDatabase).Scan(&exists); err != nil {
		return fmt.Errorf("reading the embedded postgres' databases: %w", err)
	}
	if !exists {
		if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{embeddedDatabase}.Sanitize()); err != nil {
			return fmt.Errorf("creating database %s: %w", embeddedDatabase, err)
		}
	}
	return nil
}

// Parts are the domain parts a node runs, built from its configuration.
type Parts struct {
	Registry *prometheus.Registry
	Outbox   *outbox.Store
	Mappings *mappings.Store
	Stager   *meter.Stager
	Ingester *meter.Ingester
	Requeuer *quarantine.Requeuer
	Resolver *exporter.Resolver
	API      *api.Metrics
	// Limiter paces v1 meter events to the destination account, the
	// Events class of its budget (exporter.Budget, which Resolver keeps:
	// reconciliation's reads and every other call have classes of their
	// own); nil without a key.
	Limiter *exporter.Limiter
	// StreamLimiter paces the v2 meter event stream's requests, the Stream
	// class of the budget; nil without a key.
	StreamLimiter *exporter.Limiter
	// Reconciler is nil without a key.
	Reconciler *reconcile.Reconciler
}

// Build makes the parts from cfg, with their metrics on a fresh registry.
func Build(cfg config.Config) (*Parts, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	ob, err := outbox.New(cfg.Outbox, reg)
	if err != nil {
		return nil, err
	}
	stripeMetrics, err := stripeapi.NewRequestMetrics(reg)
	if err != nil {
		return nil, err
	}
	rates := exporter.Rates{Events: cfg.RateTest, Stream: cfg.StreamRateTest, Basic: cfg.BasicRateTest}
	if mode, err := stripeapi.ModeOfKey(cfg.StripeAPIKey); err == nil && mode == stripeapi.ModeLive {
		rates = exporter.Rates{Events: cfg.RateLive, Stream: cfg.StreamRateLive, Basic: cfg.BasicRateLive}
	}
	res, err := exporter.NewResolver(exporter.Settings{Key: cfg.StripeAPIKey, APIBase: cfg.StripeAPIBase,
		MeterEventsBase: cfg.StripeMeterEventsBase, Account: cfg.StripeAccount, Exporter: cfg.Exporter, Metrics: stripeMetrics,
		Rates: rates})
	if err != nil {
		return nil, err
	}
	maps := &mappings.Store{RestrictedKey: config.RestrictedKey(cfg.StripeAPIKey)}
	if c := res.Client(); c != nil {
		maps.Checker = mappings.StripeMeters{Client: c}
	}
	// The stager, in the ingest path too, reads the destination Resolve or
	// Run found; it never waits for Stripe.
	stager := &meter.Stager{Outbox: ob, Grace: cfg.WindowGrace, Target: func(context.Context) (meter.Target, bool) {
		d, err := res.Destination()
		if err != nil {
			return meter.Target{}, false
		}
		return meter.Target{Exporter: d.Exporter, Account: d.Account, Mode: d.Mode,
			AcceptPast: exporter.StripeAcceptPast, AcceptFuture: exporter.StripeAcceptFuture,
			MaxValue: stripeapi.MaxValue}, true
	}}
	apiMetrics, err := api.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	var limiter, streamLimiter *exporter.Limiter
	var rec *reconcile.Reconciler
	if b := res.Budget(); b != nil {
		limiter, streamLimiter = b.Events(), b.Stream()
		// Reconciliation's reads have a class of their own in the
		// account's budget: its 429s slow its reads, never export.
		if rec, err = reconcile.New(reconcile.Config{Outbox: ob, Key: cfg.StripeAPIKey, APIBase: cfg.StripeAPIBase,
			Account: cfg.StripeAccount, Destination: res.Destination, Limiter: b.Reads(),
			Metrics: stripeMetrics, Registry: reg}); err != nil {
			return nil, err
		}
	}
	return &Parts{
		Registry: reg, Outbox: ob, Mappings: maps, Stager: stager,
		Ingester: &meter.Ingester{Stager: stager},
		Requeuer: &quarantine.Requeuer{Outbox: ob, Stager: stager},
		Resolver: res, API: apiMetrics, Limiter: limiter, StreamLimiter: streamLimiter, Reconciler: rec,
	}, nil
}

// Serve runs the service on db until ctx ends: the HTTP API on cfg.Listen,
// the outbox maintenance loop, and River with the periodic staging job
// (inserted by River's leader alone). It shuts down gracefully, bounded by
// cfg.ShutdownTimeout. ready, if not nil, receives the bound address once
// the listener is open.
func Serve(ctx context.Context, cfg config.Config, db *DB, p *Parts, logger *slog.Logger, ready func(addr string)) error {
	if cfg.AdminToken != "" {
		if err := auth.EnsureAdminToken(ctx, db.Pool, cfg.AdminToken); err != nil {
			return err
		}
	}
	if cfg.StripeAPIKey == "" {
		logger.Error("STRIPE_API_KEY is unset: export is stalled; usage is kept in the ledger as pending until a key is configured")
	}
	if err := refuseRestrictedStream(ctx, cfg, db.Pool); err != nil {
		return err
	}
	go p.Resolver.Run(ctx)
	if err := p.Registry.Register(newHeartbeats(db.Pool, p.Outbox)); err != nil {
		return err
	}

	// One deliverer per exporter, each claiming only its own items: v1 one
	// item per call and per key at a time, the v2 stream in batches of 100
	// regardless of key (the stream has no per-key concurrency rule), each
	// under its own limiter. Both run whatever TALLY_EXPORTER says, since a
	// feature mapping may name either.
	var deliverers []*exporter.Deliverer
	if client := p.Resolver.Client(); client != nil {
		v1, err := exporter.NewDeliverer(exporter.DelivererConfig{
			Workers: cfg.DeliveryWorkers, Batch: cfg.DeliveryBatch, InFlight: cfg.DeliveryInFlight,
			PollInterval: cfg.PollInterval, Keys: p.Resolver,
		}, p.Outbox, db.Pool, exporter.NewStripeV1(client, cfg.StripeTimeout), cfg.StripeTimeout,
			p.Resolver.Destination, p.Limiter, logger, p.Registry)
		if err != nil {
			return err
		}
		stream := exporter.NewStripeStream(client, cfg.StripeTimeout)
		if err := p.Registry.Register(stream.Collector()); err != nil {
			return err
		}
		v2, err := exporter.NewDeliverer(exporter.DelivererConfig{
			Workers: cfg.DeliveryWorkers, Batch: min(cfg.StreamInFlight, 1000), InFlight: cfg.StreamInFlight,
			RecordBatch: 1000, Policy: outbox.BestEffort, PollInterval: cfg.PollInterval, Keys: p.Resolver,
		}, p.Outbox, db.Pool, stream, cfg.StripeTimeout, p.Resolver.Destination, p.StreamLimiter, logger, p.Registry)
		if err != nil {
			return err
		}
		deliverers = append(deliverers, v1, v2)
	}

	riverLevel := slog.LevelWarn // River's own progress only when debugging
	if cfg.LogLevel == "debug" {
		riverLevel = slog.LevelDebug
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, &meter.StageWorker{Stager: p.Stager, DB: db.Pool, Logger: logger})
	river.AddWorker(workers, &reconcile.Worker{Reconciler: p.Reconciler, DB: db.Pool, Settle: cfg.ReconcileSettle, Logger: logger})
	periodic := []*river.PeriodicJob{meter.PeriodicStage(cfg.StageInterval)}
	if job, err := reconcile.Periodic(cfg.ReconcileSchedule); err != nil {
		return err
	} else if job != nil && p.Reconciler != nil {
		periodic = append(periodic, job)
	}
	rc, err := river.NewClient(riverpgxv5.New(db.Pool), &river.Config{
		Queues: map[string]river.QueueConfig{
			river.QueueDefault:  {MaxWorkers: 2},
			reconcile.QueueName: {MaxWorkers: 1}, // a run takes long; it must not hold up staging
		},
		Workers:      workers,
		PeriodicJobs: periodic,
		Logger:       slog.New(quieter{logger.Handler(), riverLevel}).With("component", "river"),
	})
	if err != nil {
		return fmt.Errorf("starting River: %w", err)
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg       sync.WaitGroup
		dbFailed error
	)
	if done := db.Done(); done != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case <-done:
				dbFailed = errors.New("the embedded postgres stopped unexpectedly")
				logger.Error(dbFailed.Error())
				cancel()
			case <-ctx.Done():
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = p.Outbox.RunMaintenance(ctx, db.Pool, cfg.MaintenanceInterval, logger)
	}()
	for _, d := range deliverers {
		// A deliverer stops claiming when ctx ends, lets the sends in
		// flight finish and records their outcomes before wg is done.
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = d.Run(ctx)
		}()
	}
	if err := rc.Start(ctx); err != nil {
		cancel()
		wg.Wait()
		return fmt.Errorf("starting River: %w", err)
	}

	var enqueue func(ctx context.Context, tx pgx.Tx, runID int64) error
	if p.Reconciler != nil {
		enqueue = func(ctx context.Context, tx pgx.Tx, runID int64) error {
			_, err := rc.InsertTx(ctx, tx, reconcile.Args{RunID: runID}, nil)
			return err
		}
	}
	con, err := console.New(console.Deps{Pool: db.Pool, Outbox: p.Outbox, Mappings: p.Mappings, Requeuer: p.Requeuer,
		Reconcile: enqueue, Settle: cfg.ReconcileSettle, Logger: logger})
	if err != nil {
		cancel()
		_ = rc.Stop(context.WithoutCancel(ctx))
		wg.Wait()
		return err
	}
	handler := api.New(api.Options{
		Console: con.Handler(),
		Logger:  logger,
		Ready: []api.Check{
			{Name: "database", Func: func(ctx context.Context) error {
				if err := db.Pool.Ping(ctx); err != nil {
					return errors.New("unreachable")
				}
				return nil
			}},
			{Name: "schema", Func: func(ctx context.Context) error {
				if err := migrations.Check(ctx, db.Pool); err != nil {
					if errors.Is(err, migrations.ErrBehind) {
						return err
					}
					return errors.New("unreadable")
				}
				return nil
			}},
			// Export stalls visibly but does not take the node out of
			// service: ingest and the reports go on.
			{Name: "export", Func: p.Resolver.Check, Degraded: true},
		},
		Metrics: promhttp.HandlerFor(p.Registry, promhttp.HandlerOpts{}),
		V1: &api.Deps{Pool: db.Pool, Outbox: p.Outbox, Mappings: p.Mappings, Ingester: p.Ingester,
			Requeuer: p.Requeuer, Metrics: p.API, Reconcile: &api.ReconcileDeps{
				Enabled: p.Reconciler != nil, Settle: cfg.ReconcileSettle,
				Enqueue: func(ctx context.Context, tx pgx.Tx, runID int64) error {
					_, err := rc.InsertTx(ctx, tx, reconcile.Args{RunID: runID}, nil)
					return err
				}},
			Webhook: webhookDeps(cfg, p)},
	})
	srv := &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      60 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		cancel()
		_ = rc.Stop(context.WithoutCancel(ctx))
		wg.Wait()
		return fmt.Errorf("listening on %s: %w", cfg.Listen, err)
	}
	logger.Info("tally listening", "addr", "http://"+ln.Addr().String())
	if ready != nil {
		ready(ln.Addr().String())
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()

	select {
	case <-ctx.Done():
	case err := <-serveErr:
		cancel()
		_ = rc.Stop(context.WithoutCancel(ctx))
		wg.Wait()
		return fmt.Errorf("http server: %w", err)
	}
	logger.Info("shutting down")
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownTimeout)
	defer scancel()
	err = srv.Shutdown(sctx)
	if rerr := rc.Stop(sctx); rerr != nil && err == nil {
		err = rerr
	}
	wg.Wait()
	if dbFailed != nil {
		return dbFailed
	}
	if err != nil {
		return fmt.Errorf("shutting down: %w", err)
	}
	return nil
}

// refuseRestrictedStream refuses to start with a restricted key (rk_) when
// a feature mapping names the v2 stream: Stripe's v2 API takes only secret
// keys (docs/stripe.md), so its items could never be sent. (TALLY_EXPORTER
// and STRIPE_WEBHOOK_SECRET are refused with one by the configuration.)
func refuseRestrictedStream(ctx context.Context, cfg config.Config, q mappings.Querier) error {
	if !config.RestrictedKey(cfg.StripeAPIKey) {
		return nil
	}
	names, err := mappings.FeaturesWithExporter(ctx, q, mappings.ExporterStripeMeterEventStream)
	if err != nil {
		return err
	}
	if len(names) > 0 {
		return fmt.Errorf("STRIPE_API_KEY is a restricted key (rk_…) and Stripe's v2 API takes only secret keys, "+
			"but features %s name %s: use a secret key (sk_…), or map them to %s",
			strings.Join(names, ", "), mappings.ExporterStripeMeterEventStream, mappings.ExporterStripeMeterEvents)
	}
	return nil
}

// NewLogger returns the process logger for cfg, writing to stderr.
func NewLogger(cfg config.Config) *slog.Logger {
	var level slog.Level
	_ = level.UnmarshalText([]byte(cfg.LogLevel))
	opts := &slog.HandlerOptions{Level: level}
	if cfg.LogFormat == "json" {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}

// webhookDeps are the event destination's: the secret, and Stripe to read
// full events from (none without a key).
func webhookDeps(cfg config.Config, p *Parts) *api.WebhookDeps {
	d := &api.WebhookDeps{Secret: cfg.StripeWebhookSecret}
	if c := p.Resolver.Client(); c != nil {
		d.Fetch = c.MeterErrorEvent
	}
	return d
}

// quieter passes on only records at or above min (and what the handler it
// wraps lets through): River reports its job counts at info every few
// seconds, which would drown the node's own log.
type quieter struct {
	slog.Handler
	min slog.Level
}

func (q quieter) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= q.min && q.Handler.Enabled(ctx, l)
}

func (q quieter) WithAttrs(as []slog.Attr) slog.Handler {
	return quieter{q.Handler.WithAttrs(as), q.min}
}
func (q quieter) WithGroup(n string) slog.Handler { return quieter{q.Handler.WithGroup(n), q.min} }

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
	pcfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to Postgres: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
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
