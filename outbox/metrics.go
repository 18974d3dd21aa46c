package outbox

import "github.com/prometheus/client_golang/prometheus"

// metrics are the outbox's own series. None carries a tenant label: that is
// unbounded cardinality.
type metrics struct {
	stale       *prometheus.CounterVec
	transitions *prometheus.CounterVec
	items       *prometheus.GaugeVec
	oldest      prometheus.Gauge
}

func newMetrics() *metrics {
	return &metrics{
		stale: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_outbox_stale_writes_total",
			Help: "Conditional outbox writes that affected zero rows (a stale lease, an expected state or mapping that no longer held), by transition. A steady stream on T2-T6 means leases expire while work is in flight: raise the lease.",
		}, []string{"transition"}),
		transitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tally_outbox_transitions_total",
			Help: "Outbox items moved, by transition and the state they landed in.",
		}, []string{"transition", "state"}),
		items: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tally_outbox_items",
			Help: "Outbox items by state, sampled by the maintenance pass.",
		}, []string{"state"}),
		oldest: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tally_outbox_oldest_pending_age_seconds",
			Help: "Age of the oldest item not yet answered (pending or leased), sampled by the maintenance pass.",
		}),
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.stale, m.transitions, m.items, m.oldest} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

func (m *metrics) staleWrites(transition string, n int) {
	if n > 0 {
		m.stale.WithLabelValues(transition).Add(float64(n))
	}
}

func (m *metrics) moved(transition string, state State) {
	m.transitions.WithLabelValues(transition, string(state)).Inc()
}
