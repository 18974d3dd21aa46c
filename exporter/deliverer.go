package exporter

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgxlisten"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/outbox"
)

// NotifyChannel is the channel the outbox notifies when there is new work.
const NotifyChannel = "tally_outbox"

// DelivererConfig are a deliverer's knobs; zero values mean the defaults.
type DelivererConfig struct {
	// Workers is how many claim loops run. Defaults to 4.
	Workers int
	// Batch is the most items one claim takes. Defaults to 50.
	Batch int
	// InFlight bounds the sends in flight on this node. Defaults to 64.
	InFlight int
	// PollInterval is how often an idle worker looks for due work when no
	// notification woke it (retries fall due this way). Defaults to 1s.
	PollInterval time.Duration
	// FlushEvery is how long outcomes wait to be written together.
	// Defaults to 20ms.
	FlushEvery time.Duration
	// Policy is the claim's ordering policy. Defaults to outbox.PerKey.
	Policy outbox.Policy
	// RecordBatch is the most outcomes written in one transaction.
	// Defaults to 100.
	RecordBatch int
	// Owner prefixes the lease owner of every claim. Defaults to
	// hostname:pid.
	Owner string
	// Keys, when set, hears whether the provider refuses this node's key
	// (the Resolver: /readyz reports the stall).
	Keys KeyHealth
}

// KeyHealth hears what deliveries say about the API key.
type KeyHealth interface {
	// KeyRefused: a 401 or 403; true when that is news.
	KeyRefused(status int) bool
	// KeyWorks: an accepted delivery; true when the key was refused until now.
	KeyWorks() bool
}

func (c DelivererConfig) withDefaults() DelivererConfig {
	if c.Workers <= 0 {
		c.Workers = 4
	}
	if c.Batch <= 0 {
		c.Batch = 50
	}
	if c.InFlight <= 0 {
		c.InFlight = 64
	}
	if c.PollInterval <= 0 {
		c.PollInterval = time.Second
	}
	if c.RecordBatch <= 0 {
		c.RecordBatch = 100
	}
	if c.FlushEvery <= 0 {
		c.FlushEvery = 20 * time.Millisecond
	}
	if c.Owner == "" {
		host, _ := os.Hostname()
		c.Owner = host + ":" + strconv.Itoa(os.Getpid())
	}
	return c
}

// Deliverer moves outbox items to the provider: workers claim batches with
// the ordering policy, every send waits for the destination's limiter, and
// every outcome is written back through the outbox's transitions, in
// batches. New work wakes it through LISTEN/NOTIFY; PollInterval is the
// fallback.
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
	queue := time.Duration(float64(requestsIn(cfg.InFlight, exp)) / limiter.Rate() * float64(time.Second))
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

// requestsIn is how many requests n items in flight make with exp.
func requestsIn(n int, exp Exporter) int {
	if be := batchOf(exp); be != nil {
		return (n + be.MaxBatch() - 1) / be.MaxBatch()
	}
	return n
}

// Run delivers until ctx ends, then stops claiming, lets the sends in flight
// finish, writes their outcomes and returns.
func (d *Deliverer) Run(ctx context.Context) error {
	wake := make(chan struct{}, d.cfg.Workers)
	lctx, stopListening := context.WithCancel(context.WithoutCancel(ctx))
	defer stopListening()
	go d.listen(lctx, wake)

	slots := make(chan struct{}, d.cfg.InFlight)
	// gather lets one worker at a time wait for several slots: workers that
	// each held part of what they wait for would wait for ever.
	gather := make(chan struct{}, 1)
	outcomes := make(chan outbox.Outcome, d.cfg.InFlight)
	recorded := make(chan struct{})
	go func() {
		d.record(outcomes)
		close(recorded)
	}()

	var workers, sends sync.WaitGroup
	for i := 0; i < d.cfg.Workers; i++ {
		workers.Add(1)
		go func() {
			defer workers.Done()
			d.work(ctx, fmt.Sprintf("%s:%d", d.cfg.Owner, i), slots, gather, outcomes, &sends, wake)
		}()
	}
	workers.Wait()
	sends.Wait()
	close(outcomes)
	<-recorded
	return nil
}

// work is one claim loop.
func (d *Deliverer) work(ctx context.Context, owner string, slots, gather chan struct{}, outcomes chan<- outbox.Outcome,
	sends *sync.WaitGroup, wake <-chan struct{}) {
	idle := func() {
		t := time.NewTimer(d.cfg.PollInterval)
		defer t.Stop()
		select {
		case <-ctx.Done():
		case <-wake:
		case <-t.C:
		}
	}
	for ctx.Err() == nil {
		dest, err := d.dest()
		if err != nil {
			idle() // export is stalled; items stay pending
			continue
		}
		// Reserve send slots: wait for the first (a batch exporter: for a
		// full request's worth, one worker at a time), take what else is
		// free.
		want := 1
		if be := d.batch; be != nil {
			want = min(be.MaxBatch(), d.cfg.Batch, d.cfg.InFlight)
		}
		n, ok := d.reserve(ctx, slots, gather, want)
		if !ok {
			return
		}
		for n < d.cfg.Batch {
			select {
			case slots <- struct{}{}:
				n++
				continue
			default:
			}
			break
		}
		prepaid := 0
		if be := d.batch; be != nil {
			// Take the requests' slots at the limiter first, then claim no
			// more items than they carry: leased items must not wait at the
			// limiter (a slot unused because the claim found less is lost).
			calls, err := d.limiter.Take(ctx, (n+be.MaxBatch()-1)/be.MaxBatch())
			if err != nil {
				for ; n > 0; n-- {
					<-slots
				}
				return
			}
			for ; n > calls*be.MaxBatch(); n-- {
				<-slots
			}
			prepaid = calls
		}
		past, future := d.exporter.Accepts()
		leases, err := d.store.Claim(ctx, d.pool, outbox.ClaimOptions{
			Owner: owner, Limit: n, Policy: d.cfg.Policy, AcceptPast: past, AcceptFuture: future,
			Exporter: d.exporter.Name(),
		})
		for i := len(leases); i < n; i++ {
			<-slots
		}
		if err != nil {
			if ctx.Err() == nil {
				d.logger.ErrorContext(ctx, "claiming outbox items failed", "error", err)
			}
			idle()
			continue
		}
		if len(leases) == 0 {
			idle()
			continue
		}
		if be := d.batch; be != nil {
			d.sendBatches(be, leases, dest, slots, outcomes, sends, prepaid)
			continue
		}
		for _, l := range leases {
			sends.Add(1)
			go func() {
				defer sends.Done()
				defer func() { <-slots }()
				outcomes <- d.deliver(l, dest)
			}()
		}
	}
}

// reserve waits until it holds want send slots, or ctx ends (then it holds
// none and says so). Waiting for more than one, it first takes gather, so
// that only one worker at a time holds part of what it waits for: the
// slots freed by the sends in flight then all reach it.
func (d *Deliverer) reserve(ctx context.Context, slots, gather chan struct{}, want int) (int, bool) {
	if want > 1 {
		select {
		case gather <- struct{}{}:
			defer func() { <-gather }()
		case <-ctx.Done():
			return 0, false
		}
	}
	for n := 0; n < want; {
		select {
		case slots <- struct{}{}:
			n++
		case <-ctx.Done():
			for ; n > 0; n-- {
				<-slots
			}
			return 0, false
		}
	}
	return want, true
}

// sendBatches checks the leases against this node (T6) and sends the rest
// in requests of up to MaxBatch items, each on its own goroutine; every item
// holds its send slot until its outcome is out.
func (d *Deliverer) sendBatches(be BatchExporter, leases []outbox.Lease, dest Destination, slots chan struct{},
	outcomes chan<- outbox.Outcome, sends *sync.WaitGroup, prepaid int) {
	ready := leases[:0:0]
	for _, l := range leases {
		if o, ok := claimCheck(l, dest, be.Name()); ok {
			o.Lease = l
			d.metrics.outcome(o)
			outcomes <- o
			<-slots
			continue
		}
		ready = append(ready, l)
	}
	for batch := range slices.Chunk(ready, be.MaxBatch()) {
		paid := prepaid > 0
		prepaid--
		sends.Add(1)
		go func() {
			defer sends.Done()
			for _, o := range d.deliverBatch(be, batch, paid) {
				outcomes <- o
				<-slots
			}
		}()
	}
}

// deliverBatch sends a batch of checked leases on a context of its own, like
// deliver, and reads the flow-control and key signals of its outcomes.
func (d *Deliverer) deliverBatch(be BatchExporter, batch []outbox.Lease, paid bool) []outbox.Outcome {
	ctx, cancel := context.WithTimeout(context.Background(), d.timeout+d.cfg.PollInterval+
		time.Duration(float64(requestsIn(d.cfg.InFlight, be))/d.limiter.Rate()*float64(time.Second)))
	defer cancel()
	start := time.Now()
	// The first request goes on the slot taken before the claim; any more
	// (a split, a renewed session) wait for their own.
	wait := func(ctx context.Context) error {
		if paid {
			paid = false
			return nil
		}
		return d.limiter.Wait(ctx)
	}
	out := be.SendBatch(ctx, batch, wait)
	d.metrics.sent(outbox.Outcome{}, time.Since(start))
	slowed, ok := false, false
	for i := range out {
		o := &out[i]
		o.Lease = batch[i]
		switch {
		case o.Kind == outbox.RateLimited && !slowed:
			d.limiter.Slow(start)
			slowed = true
		case (o.Error.Status != 0 || o.Kind == outbox.Accepted) && !ok:
			d.limiter.Ok()
			ok = true
		}
		d.metrics.outcome(*o)
	}
	if len(out) > 0 {
		d.keySignal(out[0])
	}
	return out
}

// keySignal tells KeyHealth what an outcome says about the API key.
func (d *Deliverer) keySignal(o outbox.Outcome) {
	k := d.cfg.Keys
	if k == nil {
		return
	}
	switch {
	case o.Error.Code == codeAuth && k.KeyRefused(o.Error.Status):
		d.logger.Error("Stripe refused the API key: export is stalled until the key is fixed; items are retried with backoff",
			"status", o.Error.Status)
	case o.Kind == outbox.Accepted && k.KeyWorks():
		d.logger.Info("Stripe accepts the API key again: export resumed")
	}
}

// deliver checks a leased item against this node (T6) and sends it. The send
// runs on a context of its own, bounded by the request timeout, so that a
// shutdown lets it finish and records its outcome.
func (d *Deliverer) deliver(l outbox.Lease, dest Destination) outbox.Outcome {
	if o, ok := claimCheck(l, dest, d.exporter.Name()); ok {
		o.Lease = l
		d.metrics.outcome(o)
		return o
	}
	ctx, cancel := context.WithTimeout(context.Background(), d.timeout+d.cfg.PollInterval+
		time.Duration(float64(d.cfg.InFlight)/d.limiter.Rate()*float64(time.Second)))
	defer cancel()
	if err := d.limiter.Wait(ctx); err != nil {
		return outbox.Outcome{Lease: l, Kind: outbox.Retry, Refused: true,
			Error: outbox.ErrorInfo{Code: "limiter", Message: "the rate limiter gave no slot before the deadline"}}
	}
	start := time.Now()
	o := d.exporter.Send(ctx, l)
	o.Lease = l
	d.metrics.sent(o, time.Since(start))
	if o.Kind == outbox.RateLimited {
		d.limiter.Slow(start)
	} else if o.Error.Status != 0 || o.Kind == outbox.Accepted {
		d.limiter.Ok()
	}
	d.keySignal(o)
	d.metrics.outcome(o)
	return o
}

// claimCheck is T6: an item staged for another account, mode or exporter
// than this node's, or one that cannot be sent as it stands, is quarantined
// without being sent.
func claimCheck(l outbox.Lease, dest Destination, exporter string) (outbox.Outcome, bool) {
	q := func(r outbox.Reason, msg string) (outbox.Outcome, bool) {
		return outbox.Outcome{Kind: outbox.Quarantined, Reason: r, Error: outbox.ErrorInfo{Code: string(r), Message: msg}}, true
	}
	switch {
	case dest.Account == "":
		return q(outbox.ReasonNoAccount, "this node has no destination account (STRIPE_ACCOUNT)")
	case l.DestinationAccount != dest.Account:
		return q(outbox.ReasonAccountMismatch, "staged for another account than this node exports to")
	case l.Mode != dest.Mode:
		return q(outbox.ReasonModeMismatch, "staged for another mode than this node exports to")
	case l.Payload.EventName == "":
		return q(outbox.ReasonFeatureUnmapped, "no meter event name")
	case l.Payload.Customer == "":
		return q(outbox.ReasonNoCustomer, "no Stripe customer")
	case l.TimestampOutside:
		return q(outbox.ReasonTimestampWindow, "the timestamp is outside what Stripe accepts")
	case !ValueFits(l.Payload.Value):
		return q(outbox.ReasonValueDigits, "the value has more digits than Stripe accepts (15); it is never sent or truncated")
	case l.Exporter != exporter:
		// Not a mapping problem: another node's exporter sends it. Put it back
		// without an attempt's refusal being its fault.
		return outbox.Outcome{Kind: outbox.Retry, Refused: true,
			Error: outbox.ErrorInfo{Code: "exporter_mismatch", Message: "staged for another exporter than this node runs"}}, true
	}
	return outbox.Outcome{}, false
}

// record writes outcomes in batches: every FlushEvery, or at RecordBatch.
func (d *Deliverer) record(outcomes <-chan outbox.Outcome) {
	t := time.NewTicker(d.cfg.FlushEvery)
	defer t.Stop()
	var batch []outbox.Outcome
	flush := func() {
		if len(batch) == 0 {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		batch = d.latestPerItem(batch)
		res, err := d.store.Record(ctx, d.pool, batch)
		if err != nil {
			// The items stay leased until their leases expire; the resend
			// carries the same identifier, so the provider deduplicates it.
			d.logger.Error("recording delivery outcomes failed; their items will be claimed again", "items", len(batch), "error", err)
		}
		for _, r := range res {
			if errors.Is(r.Err, outbox.ErrStaleLease) {
				d.logger.Warn("a delivery outcome was fenced out: the item was claimed again meanwhile", "item", r.ID)
			}
		}
		batch = batch[:0]
	}
	for {
		select {
		case o, ok := <-outcomes:
			if !ok {
				flush()
				return
			}
			batch = append(batch, o)
			if len(batch) >= d.cfg.RecordBatch {
				flush()
			}
		case <-t.C:
			flush()
		}
	}
}

// latestPerItem keeps, of several outcomes for one item in a batch, the
// one of its latest lease: the item was claimed again while an outcome of
// its earlier lease still waited here, and that one would be fenced out
// anyway (outbox.Record refuses a batch naming an item twice, which would
// lose the whole batch).
func (d *Deliverer) latestPerItem(batch []outbox.Outcome) []outbox.Outcome {
	at := make(map[int64]int, len(batch))
	out := batch[:0]
	for _, o := range batch {
		i, seen := at[o.Lease.ID]
		switch {
		case !seen:
			at[o.Lease.ID] = len(out)
			out = append(out, o)
		case o.Lease.LeaseToken > out[i].Lease.LeaseToken:
			d.logger.Warn("a delivery outcome was fenced out: the item was claimed again meanwhile", "item", o.Lease.ID)
			out[i] = o
		default:
			d.logger.Warn("a delivery outcome was fenced out: the item was claimed again meanwhile", "item", o.Lease.ID)
		}
	}
	return out
}

// listen wakes workers on each notification; it reconnects after errors.
func (d *Deliverer) listen(ctx context.Context, wake chan<- struct{}) {
	l := &pgxlisten.Listener{
		Connect: func(ctx context.Context) (*pgx.Conn, error) {
			return pgx.ConnectConfig(ctx, d.pool.Config().ConnConfig)
		},
		LogError: func(ctx context.Context, err error) {
			if ctx.Err() == nil {
				d.logger.Warn("listening for outbox notifications failed; polling meanwhile", "error", err)
			}
		},
		ReconnectDelay: 5 * time.Second,
	}
	l.Handle(NotifyChannel, pgxlisten.HandlerFunc(func(context.Context, *pgconn.Notification, *pgx.Conn) error {
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

// deliveryMetrics are the deliverer's series: no tenant label.
type deliveryMetrics struct {
	deliveries *prometheus.CounterVec
	duration   prometheus.Histogram
	rate       prometheus.GaugeFunc
}

// newDeliveryMetrics makes the series of one exporter's deliverer: every
// series carries the exporter's name, so that a node's two deliverers (v1
// and the v2 stream) register side by side.
func newDeliveryMetrics(l *Limiter, exporter string) *deliveryMetrics {
	labels := prometheus.Labels{"exporter": exporter}
	return &deliveryMetrics{
		deliveries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "tally_deliveries_total",
			Help:        "Delivery attempts by outcome (accepted, retry, rate_limited, uncertain, rejected, quarantined) and exporter.",
			ConstLabels: labels,
		}, []string{"outcome"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:        "tally_delivery_duration_seconds",
			Help:        "Duration of one send to the provider: one call (v1), or one batch's calls (the v2 stream).",
			Buckets:     prometheus.ExponentialBuckets(0.005, 2, 12),
			ConstLabels: labels,
		}),
		rate: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "tally_export_limiter_rate",
			Help:        "The destination's current limiter rate per exporter, in requests a second (halved on 429, recovering gradually).",
			ConstLabels: labels,
		}, l.Rate),
	}
}

func (m *deliveryMetrics) register(reg prometheus.Registerer) error {
	for _, k := range []outbox.OutcomeKind{outbox.Accepted, outbox.Retry, outbox.RateLimited, outbox.Uncertain, outbox.Rejected, outbox.Quarantined} {
		m.deliveries.WithLabelValues(k.String())
	}
	for _, c := range []prometheus.Collector{m.deliveries, m.duration, m.rate} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

func (m *deliveryMetrics) outcome(o outbox.Outcome) {
	m.deliveries.WithLabelValues(o.Kind.String()).Inc()
}

// sent observes one call's duration; the call itself is counted by
// endpoint and status in stripeapi's tally_stripe_requests_total.
func (m *deliveryMetrics) sent(_ outbox.Outcome, d time.Duration) {
	m.duration.Observe(d.Seconds())
}
