package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// Serve runs the service on db until ctx ends: the HTTP API on cfg.Listen,
// the outbox maintenance loop, a deliverer per exporter, and River with the
// periodic staging, reconcile and Stripe events listing jobs (inserted by
// River's leader alone). Its services
// start in this order and stop in reverse:
//
//	destination lookup → embedded cluster watch → outbox maintenance →
//	deliverers (v1, stream, adjustments) → River → HTTP
//
// It shuts down gracefully, bounded by cfg.ShutdownTimeout (the HTTP
// server's and River's stops; the loops end when their sends and passes
// do). ready, if not nil, receives the bound address once the listener is
// open.
func Serve(ctx context.Context, cfg config.Config, db *DB, p *Parts, logger *slog.Logger, ready func(addr string)) error {
	if err := checkStart(ctx, cfg, db, logger); err != nil {
		return err
	}
	if err := p.Registry.Register(newHeartbeats(db.Pool, p.Outbox)); err != nil {
		return err
	}
	pools, err := db.OpenPools(ctx, cfg)
	if err != nil {
		return err
	}
	// Closed once every service has stopped (or never started).
	defer pools.Close()
	deliverers, err := newDeliverers(cfg, pools, p, logger)
	if err != nil {
		return err
	}
	events, backfill, err := newStripeEvents(cfg, p, logger)
	if err != nil {
		return err
	}
	p.Gate = newGate(cfg, pools, p, logger)
	rc, err := newRiver(cfg, pools, p, backfill, logger)
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	node := newServices(cancel)
	list := []service{newLoop(func(ctx context.Context) { p.Resolver.Run(ctx, logger) })}
	if c := p.Resolver.Connected(); c != nil {
		// Probes the connected accounts Stripe refused, until access is back.
		list = append(list, newLoop(c.Run))
	}
	if watch := clusterWatch(db, node, logger); watch != nil {
		list = append(list, watch)
	}
	list = append(list, newLoop(func(ctx context.Context) {
		_ = p.Outbox.RunMaintenance(ctx, pools.Export, cfg.MaintenanceInterval, logger)
	}))
	for _, d := range deliverers {
		// A deliverer stops claiming when ctx ends, lets the claims and
		// the sends in flight finish and records their outcomes before it
		// returns.
		list = append(list, newLoop(func(ctx context.Context) { _ = d.Run(ctx) }))
	}
	web := &webServer{cfg: cfg, db: db, pools: pools, parts: p, events: events, backfill: backfill, logger: logger, ready: ready,
		enqueue: func(ctx context.Context, tx pgx.Tx, runID int64) error {
			_, err := rc.InsertTx(ctx, tx, reconcile.Args{RunID: runID}, nil)
			return err
		}}
	list = append(list, riverService{rc}, web)
	if err := node.start(ctx, list...); err != nil {
		return err
	}

	select {
	case <-ctx.Done():
	case err := <-web.failed:
		node.abort(ctx, web)
		return fmt.Errorf("http server: %w", err)
	}
	logger.Info("shutting down")
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownTimeout)
	defer scancel()
	return node.stop(sctx)
}

// checkStart does what comes before any service starts: it seeds the
// configured admin token (a new value replaces the previous one; a revoked
// value stays revoked, and the node starts without it), says once that
// export is stalled without a key, and refuses a restricted key that could
// not send a feature's items.
func checkStart(ctx context.Context, cfg config.Config, db *DB, logger *slog.Logger) error {
	if cfg.AdminToken != "" {
		seeded, err := auth.SeedAdminToken(ctx, db.Pool, cfg.AdminToken)
		switch {
		case errors.Is(err, auth.ErrSeedRevoked):
			logger.Error("TALLY_ADMIN_TOKEN is a revoked token and is not revived: no admin token from configuration on this node; set a new value, or manage admin tokens with tally tokens",
				"token", seeded.Name)
		case err != nil:
			return err
		case seeded.Created:
			logger.Info("TALLY_ADMIN_TOKEN is a new value: its admin token is created, the previous one revoked",
				"token", seeded.Name, "revoked", seeded.Revoked)
		}
	}
	if cfg.StripeAPIKey == "" {
		logger.Error("STRIPE_API_KEY is unset: export is stalled; usage is kept in the ledger as pending until a key is configured")
	}
	return refuseRestrictedStream(ctx, cfg, db.Pool)
}

// clusterWatch is the service that halts the node when the embedded
// cluster stops unexpectedly; nil for an external database.
func clusterWatch(db *DB, node *services, logger *slog.Logger) service {
	done := db.Done()
	if done == nil {
		return nil
	}
	return newLoop(func(ctx context.Context) {
		select {
		case <-done:
			err := errors.New("the embedded postgres stopped unexpectedly")
			logger.Error(err.Error())
			node.halt(err)
		case <-ctx.Done():
		}
	})
}

// newDeliverers makes one deliverer per exporter, each claiming only its
// own items: v1 one item per call and per key at a time, sized by
// TALLY_DELIVERY_*, the v2 stream in batches of 100 regardless of key
// (the stream has no per-key concurrency rule), sized by TALLY_STREAM_*
// (config.Config.DelivererConfigs), and meter event adjustments
// (cancellations) one per call and per key, across deliverers, sized by
// the exporter's defaults; each under its own class of the budget. All
// run whatever TALLY_EXPORTER says, since a feature mapping may name
// either exporter and any node may cancel. None without a key.
func newDeliverers(cfg config.Config, pools *Pools, p *Parts, logger *slog.Logger) ([]*exporter.Deliverer, error) {
	client := p.Resolver.Client()
	if client == nil {
		return nil, nil
	}
	v1cfg, streamCfg := cfg.DelivererConfigs()
	v1cfg.Keys, streamCfg.Keys = p.Resolver, p.Resolver
	// Items of tenants mapped to a connected account go there, with
	// Stripe-Account; the mappings say which accounts those are.
	connected := p.Resolver.Connected()
	connected.SetSource(func(ctx context.Context) ([]string, error) { return mappings.Accounts(ctx, pools.Export) })
	v1cfg.Accounts, streamCfg.Accounts = connected, connected
	// Claims skip the event names whose meters are all deactivated, and
	// accepts record their meter. Adjustments are not held back: each must
	// reach Stripe within 24 hours of its event, and Stripe cancels an event
	// by identifier whatever its meter became.
	v1cfg.Meters, streamCfg.Meters = p.Meters, p.Meters
	// New work wakes the claim loops through a session of pools.Listen;
	// without one (behind a pooler, no direct URL) they poll.
	v1cfg.Listen, streamCfg.Listen = pools.Listen, pools.Listen
	v1cfg.PollOnly, streamCfg.PollOnly = pools.Listen == nil, pools.Listen == nil
	// Cancellations staged for the v1 exporter before adjustments had their
	// own are still its items: their calls wait for the Adjust class.
	v1, err := exporter.NewDeliverer(v1cfg, p.Outbox, pools.Export,
		exporter.NewStripeV1(client, cfg.StripeTimeout).ForAccounts(p.Resolver.Header).PaceAdjustments(p.AdjustLimiter),
		cfg.StripeTimeout, p.Resolver.Destination, p.Limiter, logger, p.Registry)
	if err != nil {
		return nil, err
	}
	adjustCfg := exporter.DelivererConfig{Workers: exporter.DefaultAdjustWorkers, Batch: exporter.DefaultAdjustBatch,
		InFlight: exporter.AdjustInFlight(p.AdjustLimiter.Rate()), Policy: outbox.PerKey, PollInterval: cfg.PollInterval,
		Keys: p.Resolver, Accounts: connected, Listen: pools.Listen, PollOnly: pools.Listen == nil}
	adjust, err := exporter.NewDeliverer(adjustCfg, p.Outbox, pools.Export,
		exporter.NewStripeAdjustments(client, cfg.StripeTimeout).ForAccounts(p.Resolver.Header).PaceProbes(p.AdjustLimiter),
		cfg.StripeTimeout, p.Resolver.Destination, p.AdjustLimiter, logger, p.Registry)
	if err != nil {
		return nil, err
	}
	stream := exporter.NewStripeStream(client, cfg.StripeTimeout).ForAccounts(p.Resolver.Header)
	if err := p.Registry.Register(stream.Collector()); err != nil {
		return nil, err
	}
	v2, err := exporter.NewDeliverer(streamCfg, p.Outbox, pools.Export, stream, cfg.StripeTimeout, p.Resolver.Destination, p.StreamLimiter, logger, p.Registry)
	if err != nil {
		return nil, err
	}
	return []*exporter.Deliverer{v1, v2, adjust}, nil
}

// newStripeEvents makes the recorder of Stripe's events, which the event
// destination's route and the listing share, and the listing (the
// Backfill, paced by the Reads class of the destination's budget, as
// reconciliation). Both are nil without a key; with a restricted key the
// listing reads the meters alone.
func newStripeEvents(cfg config.Config, p *Parts, logger *slog.Logger) (*reconcile.Events, *reconcile.Backfill, error) {
	b := p.Resolver.Budget()
	if b == nil {
		return nil, nil, nil
	}
	connected := func(ctx context.Context, q pgdb.Querier) ([]string, error) { return mappings.Accounts(ctx, q) }
	events, err := reconcile.NewEvents(reconcile.EventsConfig{Outbox: p.Outbox, Destination: p.Resolver.Destination,
		Connected: connected, Logger: logger, Registry: p.Registry})
	if err != nil {
		return nil, nil, err
	}
	restricted := config.RestrictedKey(cfg.StripeAPIKey)
	if restricted {
		// Stripe's v2 API, which lists events, takes only secret keys
		// (docs/stripe.md); tally doctor says so. The listing still
		// reads the meters.
		logger.Warn("STRIPE_API_KEY is a restricted key: Stripe's error reports are not listed (GET /v2/core/events takes only secret keys)")
	}
	backfill, err := reconcile.NewBackfill(reconcile.BackfillConfig{Events: events, Key: cfg.StripeAPIKey, APIBase: cfg.StripeAPIBase,
		Account: cfg.StripeAccount, Destination: p.Resolver.Destination, Connected: connected, Limiter: b.Reads(),
		Logger: logger, Metrics: p.StripeMetrics, Registry: p.Registry, Meters: p.Meters, MetersOnly: restricted})
	if err != nil {
		return nil, nil, err
	}
	return events, backfill, nil
}

// newRiver makes the River client on its own pool: the staging worker and
// its periodic jobs (one per part of the tenants, TALLY_STAGE_WORKERS, run
// at once by as many workers of the default queue), the reconcile worker with its periodic job when there
// is a reconciler and a schedule, and the listing of Stripe's events
// (backfill, when there is a key) every cfg.ReportsInterval and once when
// River's leader starts, the nightly audit of the completeness
// counters, and, with a key, the hourly reading of the tenants' customer
// names the console shows. The jobs run on the export pool, so that a long
// pass never takes the connections River's leader election and fetches
// need.
func newRiver(cfg config.Config, pools *Pools, p *Parts, backfill *reconcile.Backfill, logger *slog.Logger) (*river.Client[pgx.Tx], error) {
	riverLevel := slog.LevelWarn // River's own progress only when debugging
	if cfg.LogLevel == "debug" {
		riverLevel = slog.LevelDebug
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, &meter.StageWorker{Stager: p.Stager, DB: pools.Export, Logger: logger})
	river.AddWorker(workers, &meter.MonthsWorker{DB: pools.Export, Logger: logger})
	river.AddWorker(workers, &reconcile.Worker{Reconciler: p.Reconciler, DB: pools.Export, Settle: cfg.ReconcileSettle, Logger: logger})
	river.AddWorker(workers, &reconcile.BackfillWorker{Backfill: backfill, DB: pools.Export, Logger: logger})
	river.AddWorker(workers, &quarantine.AuditWorker{DB: pools.Export, Metrics: p.Audits, Logger: logger})
	stageWorkers := meter.StageWorkers(cfg.StageWorkers, cfg.Pools.Export)
	periodic := append(meter.PeriodicStages(cfg.StageInterval, stageWorkers), meter.PeriodicMonths(), quarantine.PeriodicAudit())
	if job, err := reconcile.Periodic(cfg.ReconcileSchedule); err != nil {
		return nil, err
	} else if job != nil && p.Reconciler != nil {
		periodic = append(periodic, job)
	}
	if backfill != nil {
		periodic = append(periodic, reconcile.PeriodicBackfill(cfg.ReportsInterval))
	}
	if namer, ok := p.Mappings.Checker.(mappings.CustomerNamer); ok {
		river.AddWorker(workers, &mappings.NamesWorker{DB: pools.Export, Namer: namer, Logger: logger})
		periodic = append(periodic, mappings.PeriodicNames())
	}
	if p.Mappings.Subscriptions != nil {
		river.AddWorker(workers, &mappings.SubscriptionsWorker{DB: pools.Export, Store: p.Mappings, Lister: p.Mappings.Subscriptions, Logger: logger})
		periodic = append(periodic, mappings.PeriodicSubscriptions())
	}
	river.AddWorker(workers, &invoices.RecompareWorker{DB: pools.Export, Maps: p.Mappings, Logger: logger})
	periodic = append(periodic, invoices.PeriodicRecompare())
	if p.Gate != nil {
		river.AddWorker(workers, &invoices.GateWorker{Gate: p.Gate})
		periodic = append(periodic, invoices.PeriodicGates())
	}
	if c := p.Resolver.Client(); c != nil {
		l := &invoices.Listing{DB: pools.Export, Lister: invoices.Stripe{Client: c}, Logger: logger,
			Receiver: invoices.Receiver{Reader: invoices.Stripe{Client: c}, Maps: p.Mappings, Gate: p.Gate}}
		if lister := p.Mappings.Subscriptions; lister != nil {
			l.Subscriptions = func(ctx context.Context, db pgdb.Beginner, customer string) (int, error) {
				return p.Mappings.SyncCustomer(ctx, db, lister, customer)
			}
		}
		river.AddWorker(workers, &invoices.ListingWorker{Listing: l})
		periodic = append(periodic, invoices.PeriodicListing())
	}
	rc, err := river.NewClient(riverpgxv5.New(pools.River), &river.Config{
		Queues: map[string]river.QueueConfig{
			// The staging passes, one per part, all at once.
			river.QueueDefault:      {MaxWorkers: stageWorkers},
			reconcile.QueueName:     {MaxWorkers: 1}, // a run takes long; it must not hold up staging
			reconcile.BackfillQueue: {MaxWorkers: 1}, // nor the listing of Stripe's events, nor staging it
			quarantine.AuditQueue:   {MaxWorkers: 1}, // an audit reads whole months
			mappings.NamesQueue:     {MaxWorkers: 1}, // the customers' names wait for Stripe
			invoices.Queue:          {MaxWorkers: 1}, // comparing invoices reads counters, never urgent
		},
		Workers:      workers,
		PeriodicJobs: periodic,
		// Behind a transaction-mode pooler with no direct URL there is no
		// session to LISTEN on: River polls (pools.Listen).
		PollOnly: pools.Listen == nil,
		Logger:   slog.New(quieter{logger.Handler(), riverLevel}).With("component", "river"),
	})
	if err != nil {
		return nil, fmt.Errorf("starting River: %w", err)
	}
	return rc, nil
}

// refuseRestrictedStream refuses to start with a restricted key (rk_) when
// a feature mapping names the v2 stream: Stripe's v2 API takes only secret
// keys (docs/stripe.md), so its items could never be sent. (TALLY_EXPORTER
// and STRIPE_WEBHOOK_SECRET are refused with one by the configuration.)
func refuseRestrictedStream(ctx context.Context, cfg config.Config, q pgdb.Querier) error {
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

// newGate is the invoice gate on the export pool, holding drafts when
// TALLY_INVOICE_HOLD is on; nil without a key (no invoice is read).
func newGate(cfg config.Config, pools *Pools, p *Parts, logger *slog.Logger) *invoices.Gate {
	p.GateMetrics.Use(pools.Export)
	c := p.Resolver.Client()
	if c == nil {
		return nil
	}
	return &invoices.Gate{DB: pools.Export, Stager: p.Stager, Holder: invoices.Stripe{Client: c},
		Hold: cfg.InvoiceHold, HoldMax: cfg.InvoiceHoldMax, Metrics: p.GateMetrics, Logger: logger}
}
