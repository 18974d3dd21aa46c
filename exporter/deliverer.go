package exporter

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgxlisten"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/outbox"
)

// NotifyChannel is the channel the outbox notifies when there is new work
// (outbox.NotifyChannel).
const NotifyChannel = outbox.NotifyChannel

// listenReconnectDelay is how long the listener waits before it reconnects
// after an error; the claim loops poll meanwhile.
const listenReconnectDelay = 5 * time.Second

// Deliverer moves outbox items to the provider: workers claim batches with
// the ordering policy, every send waits for the destination's limiter, and
// every outcome is written back through the outbox's transitions, in
// batches. New work wakes it through LISTEN/NOTIFY (unless PollOnly);
// PollInterval is the fallback.
//
// Its concerns have a file each: the configuration (deliverer_config.go),
// the claim loops (deliverer_claim.go), sending and the claim check
// (deliverer_send.go), writing outcomes (deliverer_record.go) and its
// series (deliverer_metrics.go).
type Deliverer struct {
	cfg      DelivererConfig
	store    *outbox.Store
	pool     *pgxpool.Pool
	exporter Exporter
	batch    BatchExporter // the exporter, when it sends in batches; else nil
	dest     func() (Destination, error)
	limiter  *Limiter
	logger   *slog.Logger
	metrics  *deliveryMetrics
	timeout  time.Duration
	// parking is what this deliverer parked of the keys its claims skip.
	parking parking
}

// NewDeliverer validates the configuration against the outbox's: a send
// (the limiter's queue plus the request timeout) must end well inside a
// lease, so that a re-claim never overlaps a live send, and the outbox's
// horizon must stay below the exporter's dedup window.
func NewDeliverer(cfg DelivererConfig, store *outbox.Store, pool *pgxpool.Pool, exp Exporter, timeout time.Duration,
	dest func() (Destination, error), limiter *Limiter, logger *slog.Logger, reg prometheus.Registerer) (*Deliverer, error) {
	cfg = cfg.withDefaults()
	oc := store.Config()
	if timeout <= 0 {
		timeout = DefaultRequestTimeout
	}
	// An item is a unit of the limiter: a v1 call, or a stream event.
	queue := time.Duration(float64(cfg.InFlight) / limiter.Rate() * float64(time.Second))
	if 2*(timeout+queue) > oc.Lease {
		return nil, fmt.Errorf("exporter: the lease %s must be at least twice a send's worst time (request timeout %s plus %s queued at the limiter's rate)",
			oc.Lease, timeout, queue.Round(time.Millisecond))
	}
	if oc.Horizon+oc.Lease >= exp.DedupWindow() {
		return nil, fmt.Errorf("exporter: the horizon %s plus the lease must stay below %s's dedup window %s", oc.Horizon, exp.Name(), exp.DedupWindow())
	}
	if logger == nil {
		logger = slog.Default()
	}
	m := newDeliveryMetrics(limiter, exp.Name())
	if reg != nil {
		if err := m.register(reg); err != nil {
			return nil, err
		}
	}
	return &Deliverer{cfg: cfg, store: store, pool: pool, exporter: exp, dest: dest, limiter: limiter,
		logger: logger, metrics: m, timeout: timeout, batch: batchOf(exp)}, nil
}

// batchOf is exp as a BatchExporter sending more than one item a request,
// or nil.
func batchOf(exp Exporter) BatchExporter {
	if be, ok := exp.(BatchExporter); ok && be.MaxBatch() > 1 {
		return be
	}
	return nil
}

// delivery is one Run of a deliverer: the channels its listener, claim
// loops, sends and recorder share. Run makes them, and closes outcomes once
// the claim loops and the sends are done.
type delivery struct {
	*Deliverer
	// wake carries the listener's notifications to idle claim loops: the
	// listener writes, the claim loops read. One slot per loop.
	wake chan struct{}
	// slots holds one token per send in flight, at most InFlight: a claim
	// loop puts one in per item before it claims, and the item's send (or
	// the claim check that stops it) takes it out once its outcome is out.
	slots chan struct{}
	// gather lets one claim loop at a time wait for several slots
	// (reserve): loops that each held part of what they wait for would
	// wait for ever.
	gather chan struct{}
	// outcomes carries every outcome to the recorder: the sends and the
	// claim checks write, the recorder reads.
	outcomes chan outbox.Outcome
	// sends counts the sends in flight; Run waits for them before it
	// closes outcomes.
	sends sync.WaitGroup
}

// Run delivers until ctx ends, then stops claiming, lets the claims and the
// sends in flight finish (a claim's leases are sent), writes their outcomes
// and returns.
func (d *Deliverer) Run(ctx context.Context) error {
	r := &delivery{
		Deliverer: d,
		wake:      make(chan struct{}, d.cfg.Workers),
		slots:     make(chan struct{}, d.cfg.InFlight),
		gather:    make(chan struct{}, 1),
		outcomes:  make(chan outbox.Outcome, d.cfg.InFlight),
	}
	lctx, stopListening := context.WithCancel(context.WithoutCancel(ctx))
	defer stopListening()
	if !d.cfg.PollOnly {
		go d.listen(lctx, r.wake)
	}

	recorded := make(chan struct{})
	go func() {
		d.record(r.outcomes)
		close(recorded)
	}()

	var workers sync.WaitGroup
	for i := 0; i < d.cfg.Workers; i++ {
		workers.Add(1)
		go func() {
			defer workers.Done()
			r.work(ctx, fmt.Sprintf("%s:%d", d.cfg.Owner, i))
		}()
	}
	workers.Wait()
	r.sends.Wait()
	close(r.outcomes)
	<-recorded
	return nil
}

// listen wakes workers on each notification; it reconnects after errors.
func (d *Deliverer) listen(ctx context.Context, wake chan<- struct{}) {
	l := &pgxlisten.Listener{
		Connect: func(ctx context.Context) (*pgx.Conn, error) {
			if d.cfg.Listen != nil {
				return pgx.ConnectConfig(ctx, d.cfg.Listen)
			}
			return pgx.ConnectConfig(ctx, d.pool.Config().ConnConfig)
		},
		LogError: func(ctx context.Context, err error) {
			if ctx.Err() == nil {
				d.logger.Warn("listening for outbox notifications failed; polling meanwhile", "error", err)
			}
		},
		ReconnectDelay: listenReconnectDelay,
	}
	l.Handle(NotifyChannel, pgxlisten.HandlerFunc(func(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
		d.store.Stir(n.Payload)
		for i := 0; i < cap(wake); i++ {
			select {
			case wake <- struct{}{}:
			default:
			}
		}
		return nil
	}))
	_ = l.Listen(ctx)
}
