package stripeapi

import (
	"context"
	"fmt"
	"math"
	"time"

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

// MeterErrorReport is a v1.billing.meter.error_report_triggered or
// v1.billing.meter.no_meter_found event, as Tally records it.
type MeterErrorReport struct {
	ID, Type string
	Livemode bool
	Created  time.Time
	// Meter is the related meter; empty for no_meter_found.
	Meter string
	// Samples are the failed events Stripe names (a sample, not all of
	// them: ErrorCount says how many failed).
	Samples    []MeterErrorSample
	ErrorCount int64
}

// MeterErrorSample is one failed meter event of a report.
type MeterErrorSample struct {
	Identifier, Code, Message string
}

// The event types of meter error reports.
const (
	EventMeterErrorReport = "v1.billing.meter.error_report_triggered"
	EventNoMeterFound     = "v1.billing.meter.no_meter_found"
)

// MeterErrorEvent fetches the full event id (GET /v2/core/events/{id}), a
// meter error report; another type is an error. Messages are sanitised.
func (c *Client) MeterErrorEvent(ctx context.Context, id string) (MeterErrorReport, error) {
	p := &stripe.V2CoreEventRetrieveParams{}
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	ev, err := c.sc.V2CoreEvents.Retrieve(ctx, id, p)
	if err != nil {
		return MeterErrorReport{}, WrapError(err)
	}
	var out MeterErrorReport
	switch e := ev.(type) {
	case *stripe.V1BillingMeterErrorReportTriggeredEvent:
		out = MeterErrorReport{ID: e.ID, Type: e.Type, Livemode: e.Livemode, Created: e.Created, Meter: e.RelatedObject.ID}
		if e.Data.Reason != nil {
			out.ErrorCount = e.Data.Reason.ErrorCount
			for _, t := range e.Data.Reason.ErrorTypes {
				for _, s := range t.SampleErrors {
					if s.Request != nil {
						out.Samples = append(out.Samples, MeterErrorSample{Identifier: s.Request.Identifier, Code: string(t.Code), Message: sanitize(s.ErrorMessage)})
					}
				}
			}
		}
	case *stripe.V1BillingMeterNoMeterFoundEvent:
		out = MeterErrorReport{ID: e.ID, Type: e.Type, Livemode: e.Livemode, Created: e.Created}
		if e.Data.Reason != nil {
			out.ErrorCount = e.Data.Reason.ErrorCount
			for _, t := range e.Data.Reason.ErrorTypes {
				for _, s := range t.SampleErrors {
					if s.Request != nil {
						out.Samples = append(out.Samples, MeterErrorSample{Identifier: s.Request.Identifier, Code: string(t.Code), Message: sanitize(s.ErrorMessage)})
					}
				}
			}
		}
	default:
		return MeterErrorReport{}, &Error{Code: CodeBadResponse, message: "the event is not a meter error report"}
	}
	return out, nil
}
