package mappings

import (
	"context"
	"fmt"

	"github.com/tallymeter/tally/internal/stripeapi"
)

// StripeMeters is the Checker of a Stripe account: feature mappings
// against its meters, tenant mappings against its customers. The client's
// account (its Stripe-Account, else the key's own) is the account the node
// exports to.
type StripeMeters struct {
	Client *stripeapi.Client
}

// ErrProviderUnavailable says the provider's meters or customers could not
// be read.
type ErrProviderUnavailable struct {
	Code   string
	Status int
}

func (e *ErrProviderUnavailable) Error() string {
	return fmt.Sprintf("mappings: Stripe could not be asked (%s, status %d)", e.Code, e.Status)
}

// CheckCustomer implements CustomerChecker: the account must have the
// customer, not deleted. Meter events for a customer the account does not
// have are refused (meter_event_customer_not_found), and the items would
// wait in quarantine.
func (s StripeMeters) CheckCustomer(ctx context.Context, customerID string) error {
	state, err := s.Client.Customer(ctx, customerID)
	if err != nil {
		code, status, _ := stripeapi.Describe(err)
		return &ErrProviderUnavailable{Code: code, Status: status}
	}
	switch state {
	case stripeapi.CustomerActive:
		return nil
	case stripeapi.CustomerDeleted:
		return &CustomerError{Code: CodeCustomerDeleted,
			Message: fmt.Sprintf("Stripe's customer %s is deleted in the account this node exports to; map a current customer", customerID)}
	}
	return &CustomerError{Code: CodeCustomerNotFound,
		Message: fmt.Sprintf("Stripe has no customer %s in the account this node exports to (check the id, the key's mode and STRIPE_ACCOUNT); create it first", customerID)}
}

// CheckMeter implements MeterChecker: an active meter must have the event
// name, its formula must be the aggregation, and it must take every event
// (no event_time_window). It returns the meter's payload keys, Stripe's
// default for a key the meter leaves empty.
//
// A pre-aggregated meter (event_time_window hour or day) keeps only the
// latest event of each customer and window, "a newer event overwrites the
// previous one" (docs.stripe.com/billing/subscriptions/usage-based/meters/configure,
// "Event ingestion"): a window's supplement, a correction or a second
// per-event item in the window would replace what Tally sent before it,
// and usage would be lost at Stripe. Tally sends to raw meters only.
func (s StripeMeters) CheckMeter(ctx context.Context, eventName string, aggregation Aggregation) (PayloadKeys, error) {
	m, ok, err := s.Client.MeterByEventName(ctx, eventName)
	if err != nil {
		code, status, _ := stripeapi.Describe(err)
		return PayloadKeys{}, &ErrProviderUnavailable{Code: code, Status: status}
	}
	if !ok {
		return PayloadKeys{}, &MeterError{Code: "meter_not_found", Message: fmt.Sprintf("Stripe has no active meter with event_name %q; create it first", eventName)}
	}
	if m.Formula != string(aggregation) {
		return PayloadKeys{}, &MeterError{Code: "meter_formula_mismatch",
			Message: fmt.Sprintf("Stripe's meter %s for %q aggregates by %s, not %s", m.ID, eventName, m.Formula, aggregation)}
	}
	if m.EventTimeWindow != "" {
		return PayloadKeys{}, &MeterError{Code: "meter_pre_aggregated",
			Message: fmt.Sprintf("Stripe's meter %s for %q is pre-aggregated (event_time_window %s): each event would replace the last of its %s; map a meter without an event time window", m.ID, eventName, m.EventTimeWindow, m.EventTimeWindow)}
	}
	return keysOf(m), nil
}

// keysOf is a meter's payload keys: an empty key is Stripe's default.
func keysOf(m stripeapi.Meter) PayloadKeys {
	k := PayloadKeys{Customer: m.CustomerPayloadKey, Value: m.ValuePayloadKey}
	if k.Customer == "" {
		k.Customer = DefaultCustomerPayloadKey
	}
	if k.Value == "" {
		k.Value = DefaultValuePayloadKey
	}
	return k
}
