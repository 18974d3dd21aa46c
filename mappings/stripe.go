package mappings

import (
	"context"
	"fmt"

	"github.com/tallymeter/tally/internal/stripeapi"
)

// StripeMeters checks feature mappings against the meters of a Stripe
// account.
type StripeMeters struct {
	Client *stripeapi.Client
}

// ErrProviderUnavailable says the provider's meters could not be read.
type ErrProviderUnavailable struct {
	Code   string
	Status int
}

func (e *ErrProviderUnavailable) Error() string {
	return fmt.Sprintf("mappings: Stripe's meters could not be read (%s, status %d)", e.Code, e.Status)
}

// CheckMeter implements MeterChecker: an active meter must have the event
// name, and its formula must be the aggregation.
func (s StripeMeters) CheckMeter(ctx context.Context, eventName string, aggregation Aggregation) error {
	m, ok, err := s.Client.MeterByEventName(ctx, eventName)
	if err != nil {
		code, status, _ := stripeapi.Describe(err)
		return &ErrProviderUnavailable{Code: code, Status: status}
	}
	if !ok {
		return &MeterError{Code: "meter_not_found", Message: fmt.Sprintf("Stripe has no active meter with event_name %q; create it first", eventName)}
	}
	if m.Formula != string(aggregation) {
		return &MeterError{Code: "meter_formula_mismatch",
			Message: fmt.Sprintf("Stripe's meter %s for %q aggregates by %s, not %s", m.ID, eventName, m.Formula, aggregation)}
	}
	return nil
}
