package reconcile

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Defaults.
const (
	// DefaultSettle is how long an accepted item waits before a run compares
	// it: Stripe's summaries are eventually consistent.
	DefaultSettle = 2 * time.Hour
	// DefaultSchedule is when the periodic run starts: nightly, 02:00 UTC.
	DefaultSchedule = "0 2 * * *"
)

const (
	hour = int64(3600)
	// heartbeatEvery is how often a running run says it is alive;
	// staleAfter is how long without it makes a run interrupted, so that
	// another may start or resume it.
	heartbeatEvery = 15 * time.Second
	staleAfter     = 2 * time.Minute
	// confirmBatch bounds one confirm statement.
	confirmBatch = 1000
)

// ErrRunning refuses to start a run while another one works.
var ErrRunning = errcode.New(errcode.Conflict, "running", "reconcile: another run is in progress")

// ErrNotFound is a run id that does not exist.
var ErrNotFound = errcode.New(errcode.NotFound, "", "reconcile: no such run")

// Config builds a Reconciler.
type Config struct {
	Outbox *outbox.Store
	// Key, APIBase and Account are the Stripe settings (STRIPE_API_KEY,
	// STRIPE_API_BASE, STRIPE_ACCOUNT).
	Key, APIBase, Account string
	// Destination is where this node exports: a run compares the items
	// staged for it, and only those.
	Destination func() (exporter.Destination, error)
	// Connected, when set, lists the connected accounts tenant mappings
	// have named (mappings.Accounts): a run compares their items too, each
	// against its own account's meters and summaries.
	Connected func(ctx context.Context, db pgdb.Querier) ([]string, error)
	// InvoiceGrace is how long after a billing period ends its invoice
	// stays open (TALLY_INVOICE_GRACE); a tenant mapping's invoice_grace
	// overrides it. A run reads every hour of a period again until then.
	// Zero closes a period at its end.
	InvoiceGrace time.Duration
	// Limiter paces every Stripe call of a run (the account's limiter).
	Limiter *exporter.Limiter
	Logger  *slog.Logger
	// Metrics counts the reconciler's Stripe calls; Registry takes the
	// reconciler's own series. Both optional.
	Metrics  *stripeapi.RequestMetrics
	Registry prometheus.Registerer
	// RetryInitial and RetryMax shape the backoff of a read that failed
	// transiently (429, 5xx, no answer): the first wait, and how long a read
	// may keep failing before the run fails. Default 500ms and 2 minutes.
	RetryInitial, RetryMax time.Duration
}

// Reconciler compares accepted items with Stripe's event summaries and
// confirms (confirm) what they prove.
type Reconciler struct {
	cfg     Config
	client  *stripeapi.Client
	calls   atomic.Int64
	metrics *metrics
}

// metrics are the reconciler's series; no tenant label.
type metrics struct {
	runs          *prometheus.CounterVec
	confirmed     prometheus.Counter
	discrepancies prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_reconcile_runs_total",
			Help: "Reconcile runs this node worked to an end, by how they ended: succeeded, failed, interrupted.",
		}, []string{"status"}),
		confirmed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_reconcile_items_confirmed_total",
			Help: "Items moved from accepted to confirmed (confirm) on Stripe's evidence.",
		}),
		discrepancies: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_reconcile_discrepancies_total",
			Help: "Discrepancies found: hours where Stripe's summary and Tally's accepted items differ, and keys whose summaries Stripe refused (a customer or meter it does not know). A rerun finds an unresolved one again; numbers finance resolved are not counted again.",
		}),
	}
	for _, s := range []string{"succeeded", "failed", "interrupted"} {
		m.runs.WithLabelValues(s)
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.runs, m.confirmed, m.discrepancies} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

// New validates cfg and builds the reconciler; it makes no call. Without a
// key it is nil and no error: there is nothing to reconcile against.
func New(cfg Config) (*Reconciler, error) {
	if cfg.Key == "" {
		return nil, nil
	}
	if cfg.Outbox == nil || cfg.Destination == nil || cfg.Limiter == nil {
		return nil, errors.New("reconcile: Outbox, Destination and Limiter are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.RetryInitial <= 0 {
		cfg.RetryInitial = 500 * time.Millisecond
	}
	if cfg.RetryMax <= 0 {
		cfg.RetryMax = 2 * time.Minute
	}
	m, err := newMetrics(cfg.Registry)
	if err != nil {
		return nil, err
	}
	r := &Reconciler{cfg: cfg, metrics: m}
	c, err := stripeapi.New(stripeapi.Config{Key: cfg.Key, APIBase: cfg.APIBase, Account: cfg.Account,
		Metrics: cfg.Metrics,
		BeforeRequest: func(ctx context.Context) error {
			r.calls.Add(1)
			return cfg.Limiter.Wait(ctx)
		}})
	if err != nil {
		return nil, err
	}
	r.client = c
	return r, nil
}

// Options are a run's parameters.
type Options struct {
	// Settle: only accepted items older than this are compared (0: all;
	// callers pass TALLY_RECONCILE_SETTLE, by default DefaultSettle).
	// Negative is an error.
	Settle time.Duration
	// Since: only hours from this event time on (zero: all).
	Since time.Time
}

// Trigger says what started a run.
type Trigger string

// The triggers.
const (
	TriggerSchedule Trigger = "schedule"
	TriggerAPI      Trigger = "api"
	TriggerCommand  Trigger = "command"
)
