package exporter

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/outbox"
)

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
			Help:        "The destination's current limiter rate per exporter, in calls a second (events a second for the v2 stream; halved on 429, recovering gradually).",
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
