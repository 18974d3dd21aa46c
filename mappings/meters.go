package mappings

import (
	"context"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/tallymeter/tally/internal/stripeapi"
)

// MeterChecker verifies a feature mapping against the provider's meters
// (the meter half of Checker).
type MeterChecker interface {
	// CheckMeter returns the payload keys of the active meter with the
	// event name when its formula matches the aggregation, with a key the
	// provider leaves empty as its default (DefaultCustomerPayloadKey,
	// DefaultValuePayloadKey), and a *MeterError when no meter fits.
	CheckMeter(ctx context.Context, eventName string, aggregation Aggregation) (PayloadKeys, error)
}

// MeterError says why the provider's meters do not fit a feature mapping.
type MeterError struct {
	// Code is "meter_not_found", "meter_formula_mismatch" or
	// "meter_payload_key_invalid".
	Code    string
	Message string
}

func (e *MeterError) Error() string { return "mappings: " + e.Message }

// The payload keys of a Stripe meter that names none: Stripe's defaults of
// customer_mapping.event_payload_key and value_settings.event_payload_key
// (stripe-go v82, BillingMeterEventParams.Payload; "Payload key overrides",
// https://docs.stripe.com/billing/subscriptions/usage-based/recording-usage#payload-key-overrides).
const (
	DefaultCustomerPayloadKey = stripeapi.DefaultCustomerPayloadKey
	DefaultValuePayloadKey    = stripeapi.DefaultValuePayloadKey
)

// MaxPayloadKeyLength is the longest payload key a feature mapping takes,
// in characters: the most Stripe takes when a meter is created (max length
// 100 for both event_payload_keys in Stripe's API specification).
const MaxPayloadKeyLength = 100

// PayloadKeys are the meter event payload keys a meter reads: the key of the
// Stripe customer id and the key of the value.
type PayloadKeys struct {
	Customer string
	Value    string
}

// DefaultPayloadKeys are Stripe's default keys, DefaultCustomerPayloadKey
// and DefaultValuePayloadKey.
func DefaultPayloadKeys() PayloadKeys {
	return PayloadKeys{Customer: DefaultCustomerPayloadKey, Value: DefaultValuePayloadKey}
}

// String renders the keys as the audit log shows them:
// "customer=stripe_customer_id value=value".
func (k PayloadKeys) String() string { return "customer=" + k.Customer + " value=" + k.Value }

// check returns a *MeterError unless both keys are plausible payload keys
// (1 to MaxPayloadKeyLength characters of valid UTF-8, no control
// character) and differ. eventName says whose meter it is.
func (k PayloadKeys) check(eventName string) error {
	for _, key := range []struct{ which, key string }{{"customer", k.Customer}, {"value", k.Value}} {
		if !plausiblePayloadKey(key.key) {
			return &MeterError{Code: "meter_payload_key_invalid", Message: fmt.Sprintf(
				"Stripe's meter for %q names a %s payload key that Tally cannot send: want 1 to %d characters, no control characters",
				eventName, key.which, MaxPayloadKeyLength)}
		}
	}
	if k.Customer == k.Value {
		return &MeterError{Code: "meter_payload_key_invalid", Message: fmt.Sprintf(
			"Stripe's meter for %q names the same payload key for the customer and the value", eventName)}
	}
	return nil
}

func plausiblePayloadKey(key string) bool {
	if key == "" || !utf8.ValidString(key) || utf8.RuneCountInString(key) > MaxPayloadKeyLength {
		return false
	}
	return !strings.ContainsFunc(key, unicode.IsControl)
}
