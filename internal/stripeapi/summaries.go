package stripeapi

import (
	"context"
	"fmt"
	"math"

	"github.com/stripe/stripe-go/v82"
)

// Summary is one hourly (or daily) meter event summary: the meter's
// aggregate of the customer's events with timestamps in [Start, End).
type Summary struct {
	Start, End int64 // Unix seconds
	// Value is the aggregated value. Stripe sends a float; whole values up
	// to 2^53 are exact.
	Value float64
}

// Grouping is a summary window.
type Grouping string

// The summary windows Stripe offers.
const (
	Hour Grouping = "hour"
	Day  Grouping = "day"
)

// EventSummaries reads every summary of meter for customer in [start, end),
// grouped by window, following Stripe's pagination (pages of 100) to the
// end. start and end must be aligned to the window. Stripe lists summaries
// newest first and only for windows that have events.
func (c *Client) EventSummaries(ctx context.Context, meter, customer string, start, end int64, window Grouping) ([]Summary, error) {
	size := int64(3600)
	if window == Day {
		size = 86400
	}
	if start%size != 0 || end%size != 0 || end <= start {
		return nil, fmt.Errorf("stripeapi: event summaries: [%d, %d) is not aligned to %s windows", start, end, window)
	}
	p := &stripe.BillingMeterEventSummaryListParams{
		ID: stripe.String(meter), Customer: stripe.String(customer),
		StartTime: stripe.Int64(start), EndTime: stripe.Int64(end), ValueGroupingWindow: stripe.String(string(window)),
	}
	p.Limit = stripe.Int64(100)
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	var out []Summary
	for s, err := range c.sc.V1BillingMeterEventSummaries.List(ctx, p) {
		if err != nil {
			return nil, WrapError(err)
		}
		if math.IsNaN(s.AggregatedValue) || math.IsInf(s.AggregatedValue, 0) {
			return nil, &Error{Code: CodeBadResponse, message: "Stripe returned a summary without a finite value"}
		}
		out = append(out, Summary{Start: s.StartTime, End: s.EndTime, Value: s.AggregatedValue})
	}
	return out, nil
}
