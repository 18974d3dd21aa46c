package outbox

import "github.com/prometheus/client_golang/prometheus"

// metrics are the outbox's own series. None carries a tenant label: that is
// unbounded cardinality.
type metrics struct {
	stale       *prometheus.CounterVec
	transitions *prometheus.CounterVec
	items       *prometheus.GaugeVec
	oldest      prometheus.Gauge
	staged      *prometheus.CounterVec
	quarantined *prometheus.CounterVec
	late        prometheus.Counter
}

func newMetrics() *metrics {
	return &metrics{
		stale: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_outbox_stale_writes_total",
			Help: "Conditional outbox writes that affected zero rows (a stale lease, an expected state or mapping that no longer held), by transition. A steady stream on accept, retry, mark_uncertain, reject or quarantine means leases expire while work is in flight: raise the lease. On claim, a PerKey claim lost a key to a concurrent claimer (its lease refused by the unique index) and looked again. On fail_accepted, an error report named an item that had left accepted meanwhile.",
		}, []string{"transition"}),
		transitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_outbox_transitions_total",
			Help: "Outbox items moved, by transition and the state they landed in.",
		}, []string{"transition", "state"}),
		items: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tally_outbox_items",
			Help: "Outbox items by state, sampled by the maintenance pass.",
		}, []string{"state"}),
		staged: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_outbox_staged_total",
			Help: "Items staged (stage and stage_quarantined), by subject kind: usage_window (a window or a supplement) or usage_event (a count feature's event). Counted when the enqueue ran; a rolled-back transaction counts too.",
		}, []string{"kind"}),
		quarantined: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_outbox_quarantined_total",
			Help: "Items quarantined, at staging (stage_quarantined), at claim or on Stripe's answer (quarantine), or on Stripe's asynchronous error report (fail_accepted, or accept when the report came while the item was in flight), by reason.",
		}, []string{"reason"}),
		late: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tally_outbox_late_items_total",
			Help: "Items staged after their billing period's invoice closed (the period's end plus the invoice grace): quarantined period_closed, or sent under TALLY_LATE_USAGE=send, where Stripe records them on no invoice. Counted when the enqueue ran.",
		}),
		oldest: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tally_outbox_oldest_pending_age_seconds",
			Help: "Age of the oldest item not yet answered (pending or leased), sampled by the maintenance pass.",
		}),
	}
}

// zero creates the series whose labels are known up front, at 0, so that
// a scrape shows them (and an alert's rate() has a baseline) before the
// first event.
func (m *metrics) zero() *metrics {
	for _, e := range Transitions {
		if len(e.From) > 0 {
			m.stale.WithLabelValues(string(e.Transition))
		}
	}
	for _, r := range []Reason{ReasonFeatureUnmapped, ReasonNoCustomer, ReasonNoAccount, ReasonAccountMismatch,
		ReasonModeMismatch, ReasonTimestampWindow, ReasonMeterNotFound, ReasonCustomerNotFound, ReasonCountValue,
		ReasonPeriodClosed} {
		m.quarantined.WithLabelValues(string(r))
	}
	for _, k := range []string{SubjectUsageWindow, SubjectUsageEvent} {
		m.staged.WithLabelValues(k)
	}
	return m
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.stale, m.transitions, m.items, m.oldest, m.staged, m.quarantined, m.late} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

func (m *metrics) staleWrites(transition Transition, n int) {
	if n > 0 {
		m.stale.WithLabelValues(string(transition)).Add(float64(n))
	}
}

// enqueued counts a staged item of kind, and its quarantine reason if any.
func (m *metrics) enqueued(kind string, reason Reason, late bool) {
	m.staged.WithLabelValues(kind).Inc()
	if late {
		m.late.Inc()
	}
	if reason != "" {
		m.quarantined.WithLabelValues(string(reason)).Inc()
	}
}

// quarantinedFor counts an item quarantined by a transition out of leased
// or accepted.
func (m *metrics) quarantinedFor(reason Reason) {
	m.quarantined.WithLabelValues(string(reason)).Inc()
}

func (m *metrics) moved(transition Transition, state State) {
	m.transitions.WithLabelValues(string(transition), string(state)).Inc()
}
