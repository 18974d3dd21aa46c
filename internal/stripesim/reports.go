package stripesim

import (
	"slices"
	"time"
)

// Types of the thin events an [ErrorReport] stands for.
const (
	ReportErrorTriggered = "v1.billing.meter.error_report_triggered"
	ReportNoMeterFound   = "v1.billing.meter.no_meter_found"
)

// Error codes of an [ErrorReport]: Stripe's codes for asynchronous meter
// event errors, and CodeDropped, the simulator's own code for an event it
// accepted and then dropped (the AsyncDrop fault).
const (
	CodeNoMeter               = "no_meter"
	CodeArchivedMeter         = "archived_meter"
	CodeNoCustomerDefined     = "meter_event_no_customer_defined"
	CodeCustomerNotFound      = "meter_event_customer_not_found"
	CodeInvalidValue          = "meter_event_invalid_value"
	CodeValueTooManyDigits    = "meter_event_value_too_many_digits"
	CodeTimestampTooFarInPast = "timestamp_too_far_in_past"
	CodeTimestampInFuture     = "timestamp_in_future"
	CodeDropped               = "dropped"
)

// ErrorReport is one thin event Stripe would send about meter events that
// failed after they were accepted: invalid events on the v2 stream, on v1
// with Limits.AsyncValidation, and events lost by the AsyncDrop fault. An
// event for an event name without any meter of its mode is reported with
// ReportNoMeterFound and CodeNoMeter; one whose meter is inactive with
// ReportErrorTriggered, CodeArchivedMeter and that meter. The simulator
// stores them (see [Server.ErrorReports]), serves them on GET
// /v2/core/events for 30 days, and posts them with [Server.DeliverReports].
type ErrorReport struct {
	ID       string // evt_…
	Type     string // ReportErrorTriggered or ReportNoMeterFound
	Created  time.Time
	Livemode bool
	// Context is the thin event's context: the account's id when it is a
	// connected account (one without a key of its own, reached with
	// Stripe-Account or Stripe-Context), else empty.
	Context string
	// Meter is the id of the meter the events were meant for (the related
	// object); empty for ReportNoMeterFound.
	Meter     string
	EventName string
	// Code is the error type's code, one of the Code constants.
	Code string
	// ErrorCount is the number of failed events; Identifiers name each
	// (the error samples): a v1 event by the Idempotency-Key of its
	// request when it had one, else by the event's identifier. RequestIDs
	// are the Request-Ids of the requests that carried them, in the same
	// order ("" for none: DropEvent's). Message is the first one's error
	// message.
	ErrorCount  int
	Identifiers []string
	RequestIDs  []string
	Message     string
}

// streamFailure is one event that failed after it was accepted.
type streamFailure struct {
	identifier string
	requestID  string // the Request-Id of the request that carried it
	eventName  string
	meter      *Meter // nil when no meter was found
	code       string
	message    string
}

// reportLocked turns failures, all seen at now, into error reports: one per
// meter (or event name when there is none) and code. s.mu must be held.
func (s *Server) reportLocked(a *account, now time.Time, livemode bool, failures []streamFailure) {
	if len(failures) == 0 {
		return
	}
	type groupKey struct{ meter, eventName, code string }
	var order []groupKey
	groups := map[groupKey]*ErrorReport{}
	for _, f := range failures {
		k := groupKey{eventName: f.eventName, code: f.code}
		typ := ReportNoMeterFound
		if f.meter != nil {
			k = groupKey{meter: f.meter.ID, eventName: f.meter.EventName, code: f.code}
			typ = ReportErrorTriggered
		}
		g := groups[k]
		if g == nil {
			g = &ErrorReport{
				ID: randomID("evt_test_", 24), Type: typ, Created: now, Livemode: livemode, Context: s.contextLocked(a),
				Meter: k.meter, EventName: k.eventName, Code: f.code, Message: f.message,
			}
			if livemode {
				g.ID = randomID("evt_", 24)
			}
			groups[k] = g
			order = append(order, k)
		}
		g.ErrorCount++
		g.Identifiers = append(g.Identifiers, f.identifier)
		g.RequestIDs = append(g.RequestIDs, f.requestID)
	}
	for _, k := range order {
		a.reports = append(a.reports, *groups[k])
	}
}

// ErrorReports returns the error reports of account, both modes, oldest
// first. [Server.DeliverReports] posts them as signed thin events, and
// GET /v2/core/events/{id} serves each as a full event.
func (s *Server) ErrorReports(account string) []ErrorReport {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.accounts[account]
	if a == nil {
		return nil
	}
	out := slices.Clone(a.reports)
	for i := range out {
		out[i].Identifiers = slices.Clone(out[i].Identifiers)
		out[i].RequestIDs = slices.Clone(out[i].RequestIDs)
	}
	return out
}

// contextLocked is the context of account a's thin events: its id when no
// key is its own (a connected account), else empty. s.mu must be held.
func (s *Server) contextLocked(a *account) string {
	for _, own := range s.keys {
		if own == a.id {
			return ""
		}
	}
	return a.id
}
