package stripeapi

import (
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// RequestMetrics counts every HTTP call a Client makes to Stripe, by
// endpoint and status class: tally_stripe_requests_total. One instance is
// shared by every client of a process (the deliverer's, the reconciler's).
type RequestMetrics struct {
	requests *prometheus.CounterVec
}

// NewRequestMetrics registers the series on reg.
func NewRequestMetrics(reg prometheus.Registerer) (*RequestMetrics, error) {
	m := &RequestMetrics{requests: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tally_stripe_requests_total",
		Help: "Calls to Stripe by endpoint (meter_events, meter_event_stream, meter_event_session, meters, event_summaries, account, events, other) and status class (2xx, 4xx, 401, 403, 429, 5xx, none: no answer).",
	}, []string{"endpoint", "class"})}
	if err := reg.Register(m.requests); err != nil {
		return nil, err
	}
	return m, nil
}

// Observe counts one call to path answered with status (0: no answer).
func (m *RequestMetrics) Observe(path string, status int) {
	if m == nil {
		return
	}
	m.requests.WithLabelValues(EndpointOf(path), classOf(status)).Inc()
}

// EndpointOf names the Stripe endpoint of a request path, without ids.
func EndpointOf(path string) string {
	// The API base may carry a path of its own (a proxy's prefix).
	if i := strings.Index(path, "/v1/"); i > 0 {
		path = path[i:]
	} else if i := strings.Index(path, "/v2/"); i > 0 {
		path = path[i:]
	}
	switch {
	case path == "/v1/billing/meter_events":
		return "meter_events"
	case strings.HasPrefix(path, "/v1/billing/meters/") && strings.HasSuffix(path, "/event_summaries"):
		return "event_summaries"
	case path == "/v1/billing/meters" || strings.HasPrefix(path, "/v1/billing/meters/"):
		return "meters"
	case path == "/v1/account":
		return "account"
	case path == EventsPath || strings.HasPrefix(path, EventsPath+"/"):
		return "events"
	case path == StreamPath:
		return "meter_event_stream"
	case path == "/v2/billing/meter_event_session":
		return "meter_event_session"
	}
	return "other"
}

func classOf(status int) string {
	switch {
	case status == 0:
		return "none"
	case status == 401 || status == 403 || status == 429:
		return strconv.Itoa(status)
	case status >= 500:
		return "5xx"
	case status >= 400:
		return "4xx"
	case status >= 200 && status < 300:
		return "2xx"
	}
	return "other"
}
