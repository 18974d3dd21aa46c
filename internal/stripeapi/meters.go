package stripeapi

import (
	"context"

	"github.com/stripe/stripe-go/v82"
)

// Stripe's facts about meter events that more than one package relies on
// (docs/stripe.md has the sources).
const (
	// DefaultCustomerPayloadKey and DefaultValuePayloadKey are the payload
	// keys of a meter that names none (customer_mapping.event_payload_key,
	// value_settings.event_payload_key).
	DefaultCustomerPayloadKey = "stripe_customer_id"
	DefaultValuePayloadKey    = "value"
	// MaxValue is the largest magnitude of a meter event value Stripe takes:
	// 15 significant digits (meter_event_value_too_many_digits). Whether
	// Stripe counts a whole number's trailing zeros is not documented; Tally
	// assumes the worst and counts every digit.
	MaxValue int64 = 999_999_999_999_999
	// MeterEventsPath is v1's meter-event endpoint.
	MeterEventsPath = "/v1/billing/meter_events"
	// AdjustmentsPath is v1's meter event adjustment endpoint.
	AdjustmentsPath = "/v1/billing/meter_event_adjustments"
)

// Meter is a Stripe billing meter, as Tally needs it.
type Meter struct {
	ID          string
	DisplayName string
	EventName   string
	Formula     string // sum, count or last
	Status      string // active or inactive
	// CustomerPayloadKey and ValuePayloadKey are the meter event payload
	// keys of the customer id and the value.
	CustomerPayloadKey string
	ValuePayloadKey    string
	// EventTimeWindow is "hour" or "day" for a pre-aggregated meter, which
	// keeps only the latest event of each customer and window; empty for a
	// raw meter.
	EventTimeWindow string
}

func meterOf(m *stripe.BillingMeter) Meter {
	out := Meter{ID: m.ID, DisplayName: m.DisplayName, EventName: m.EventName, Status: string(m.Status),
		EventTimeWindow: string(m.EventTimeWindow)}
	if m.DefaultAggregation != nil {
		out.Formula = string(m.DefaultAggregation.Formula)
	}
	if m.CustomerMapping != nil {
		out.CustomerPayloadKey = m.CustomerMapping.EventPayloadKey
	}
	if m.ValueSettings != nil {
		out.ValuePayloadKey = m.ValueSettings.EventPayloadKey
	}
	return out
}

// listMeters calls yield for every meter with the status ("" for all), in
// Stripe's order (newest first), reading pages of 100 until yield returns
// false.
func (c *Client) listMeters(ctx context.Context, status string, yield func(Meter) bool) error {
	p := &stripe.BillingMeterListParams{}
	p.Limit = stripe.Int64(100)
	if status != "" {
		p.Status = stripe.String(status)
	}
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	for m, err := range c.sc.V1BillingMeters.List(ctx, p) {
		if err != nil {
			return WrapError(err)
		}
		if !yield(meterOf(m)) {
			return nil
		}
	}
	return nil
}

// Meters returns every meter of the account, active and inactive, reading
// every page.
func (c *Client) Meters(ctx context.Context) ([]Meter, error) {
	var out []Meter
	err := c.listMeters(ctx, "", func(m Meter) bool {
		out = append(out, m)
		return true
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// MeterByEventName returns the active meter with the event name; false when
// there is none. Inactive meters are ignored: Stripe accepts meter events
// only for active meters, and at most one active meter has a given event
// name.
func (c *Client) MeterByEventName(ctx context.Context, eventName string) (Meter, bool, error) {
	var found Meter
	var ok bool
	err := c.listMeters(ctx, string(stripe.BillingMeterStatusActive), func(m Meter) bool {
		if m.EventName == eventName && m.Status == string(stripe.BillingMeterStatusActive) {
			found, ok = m, true
			return false
		}
		return true
	})
	if err != nil {
		return Meter{}, false, err
	}
	return found, ok, nil
}
