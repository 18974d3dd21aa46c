package app

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/archive"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

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
	// StreamLimiter paces the v2 meter event stream's events, the Stream
	// class of the budget; nil without a key.
	StreamLimiter *exporter.Limiter
	// AdjustLimiter paces meter event adjustments (cancellations), the
	// Adjust class of the budget; nil without a key.
	AdjustLimiter *exporter.Limiter
	// Reconciler is nil without a key.
	Reconciler *reconcile.Reconciler
	// ReadLimit bounds the expensive reads of the API and the console
	// together: cfg.Pools.ReadsPerToken per token, and readsHeadroom
	// fewer than the reads pool's connections in all.
	ReadLimit *api.ReadLimiter
	// Reports answers the completeness report, in the API and the
	// console, from snapshots no older than cfg.Pools.ReportMaxAge.
	Reports *quarantine.Reports
	// Audits are the nightly completeness audit's metrics.
	Audits *quarantine.AuditMetrics
	// StripeMetrics counts every Stripe call by endpoint and status class.
	StripeMetrics *stripeapi.RequestMetrics
	// Meters is the directory of the destination accounts' meters, which
	// the listing refreshes: claims skip paused event names, accepts
	// record their meter. Nil without a key.
	Meters *exporter.MeterDirectory
	// GateMetrics are the invoice gate's; the gauge reads the database
	// once serve has its pools.
	GateMetrics *invoices.GateMetrics
	// Gate is the invoice gate; serve makes it, nil without a key.
	Gate *invoices.Gate
}

// readsHeadroom is how many connections of the reads pool the expensive
// reads leave to everything else on it: sign-ins, the overview, item pages,
// the API's other GETs.
const readsHeadroom = 2

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
	rates := exporter.Rates{Events: cfg.RateTest, Stream: cfg.StreamRateTest, Adjust: cfg.AdjustRateTest, Basic: cfg.BasicRateTest}
	if mode, err := stripeapi.ModeOfKey(cfg.StripeAPIKey); err == nil && mode == stripeapi.ModeLive {
		rates = exporter.Rates{Events: cfg.RateLive, Stream: cfg.StreamRateLive, Adjust: cfg.AdjustRateLive, Basic: cfg.BasicRateLive}
	}
	res, err := exporter.NewResolver(exporter.Settings{Key: cfg.StripeAPIKey, APIBase: cfg.StripeAPIBase,
		MeterEventsBase: cfg.StripeMeterEventsBase, Account: cfg.StripeAccount, Exporter: cfg.Exporter, Metrics: stripeMetrics,
		Rates: rates})
	if err != nil {
		return nil, err
	}
	if c := res.Connected(); c != nil {
		reg.MustRegister(c.Collector())
	}
	maps := &mappings.Store{RestrictedKey: config.RestrictedKey(cfg.StripeAPIKey)}
	if c := res.Client(); c != nil {
		maps.Checker = mappings.StripeMeters{Client: c}
		maps.Subscriptions = mappings.StripeMeters{Client: c}
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
			MaxValue: stripeapi.MaxValue, InvoiceGrace: cfg.InvoiceGrace, LateUsage: meter.LatePolicy(cfg.LateUsage)}, true
	}}
	apiMetrics, err := api.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	var meters *exporter.MeterDirectory
	if res.Client() != nil {
		meters = exporter.NewMeterDirectory()
	}
	var limiter, streamLimiter, adjustLimiter *exporter.Limiter
	var rec *reconcile.Reconciler
	if b := res.Budget(); b != nil {
		limiter, streamLimiter, adjustLimiter = b.Events(), b.Stream(), b.Adjust()
		// Reconciliation's reads have a class of their own in the
		// account's budget: its 429s slow its reads, never export.
		if rec, err = reconcile.New(reconcile.Config{Outbox: ob, Key: cfg.StripeAPIKey, APIBase: cfg.StripeAPIBase,
			Account: cfg.StripeAccount, Destination: res.Destination, Limiter: b.Reads(), InvoiceGrace: cfg.InvoiceGrace,
			Connected: func(ctx context.Context, db pgdb.Querier) ([]string, error) { return mappings.Accounts(ctx, db) },
			Metrics:   stripeMetrics, Registry: reg}); err != nil {
			return nil, err
		}
	}
	readLimit, err := api.NewReadLimiter(cfg.Pools.ReadsPerToken, max(1, cfg.Pools.Reads-readsHeadroom), reg)
	if err != nil {
		return nil, err
	}
	reports, err := quarantine.NewReports(cfg.Pools.ReportMaxAge, reg)
	if err != nil {
		return nil, err
	}
	reports.Timeout = cfg.Pools.ReportTimeout
	reports.Archived = archive.DetachedReport
	audits, err := quarantine.NewAuditMetrics(reg)
	if err != nil {
		return nil, err
	}
	gateMetrics, err := invoices.NewGateMetrics(reg)
	if err != nil {
		return nil, err
	}
	return &Parts{
		Registry: reg, Outbox: ob, Mappings: maps, Stager: stager,
		Ingester: &meter.Ingester{Stager: stager, MaxQuarantined: cfg.Quota.MaxQuarantined, GroupCommit: cfg.GroupCommit},
		Requeuer: &quarantine.Requeuer{Outbox: ob, Stager: stager},
		Resolver: res, API: apiMetrics, Limiter: limiter, StreamLimiter: streamLimiter, AdjustLimiter: adjustLimiter, Reconciler: rec,
		ReadLimit: readLimit, Reports: reports, Audits: audits, StripeMetrics: stripeMetrics, Meters: meters,
		GateMetrics: gateMetrics,
	}, nil
}
