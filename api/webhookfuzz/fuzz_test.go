package webhookfuzz_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stripe/stripe-go/v82/webhook"

	"github.com/tallymeter/tally/api"
)

// FuzzStripeEvent: whatever body and Stripe-Signature header arrive,
// parsing never panics, and it accepts only a body signed with the secret
// within the tolerance that names an event.
func FuzzStripeEvent(f *testing.F) {
	const secret = "whsec_fuzz"
	good := []byte(`{"id":"evt_1","object":"v2.core.event","type":"v1.billing.meter.error_report_triggered"}`)
	signed := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: good, Secret: secret, Timestamp: time.Now()})
	f.Add(signed.Payload, signed.Header)
	f.Add(good, "")
	f.Add(good, "t=1,v1=00")
	f.Add([]byte(`{}`), signed.Header)
	f.Add([]byte(`not json`), "t=,v1=,v0=")
	stale := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: good, Secret: secret, Timestamp: time.Now().Add(-time.Hour)})
	f.Add(stale.Payload, stale.Header)
	f.Fuzz(func(t *testing.T, body []byte, header string) {
		ev, err := api.ParseStripeEvent(body, header, secret)
		if err != nil {
			return
		}
		if !strings.HasPrefix(ev.ID, "evt_") || strings.ContainsAny(ev.ID, "/?.%# ") || ev.Type == "" {
			t.Fatalf("accepted an event without a Stripe event id or a type: %+v", ev)
		}
		if verr := webhook.ValidatePayloadWithTolerance(body, header, secret, 300*time.Second); verr != nil {
			t.Fatalf("accepted a body the signature does not cover: %v", verr)
		}
		if webhook.ValidatePayloadWithTolerance(body, header, "whsec_other", 300*time.Second) == nil {
			t.Fatalf("the signature verifies with another secret too")
		}
	})
}
