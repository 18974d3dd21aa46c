package stripeapi

import "testing"

func TestEndpointAndClass(t *testing.T) {
	t.Parallel()
	for path, want := range map[string]string{
		"/v1/billing/meter_events":                              "meter_events",
		"/v1/billing/meters":                                    "meters",
		"/v1/billing/meters/mtr_1":                              "meters",
		"/v1/billing/meters/mtr_1/event_summaries":              "event_summaries",
		"/proxy/stripe/v1/billing/meters/mtr_1/event_summaries": "event_summaries",
		"/v1/account":                                           "account",
		"/v2/core/events/evt_1":                                 "events",
		"/v2/core/events":                                       "events",
		"/v1/customers/cus_1":                                   "other",
	} {
		if got := EndpointOf(path); got != want {
			t.Errorf("EndpointOf(%q) = %q, want %q", path, got, want)
		}
	}
	for status, want := range map[int]string{0: "none", 200: "2xx", 400: "4xx", 401: "401", 403: "403", 404: "4xx", 429: "429", 500: "5xx", 502: "5xx"} {
		if got := classOf(status); got != want {
			t.Errorf("classOf(%d) = %q, want %q", status, got, want)
		}
	}
}
