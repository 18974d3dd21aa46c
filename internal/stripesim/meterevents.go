package stripesim

import (
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

const meterEventsPath = "/v1/billing/meter_events"

// Statuses of a [RecordedEvent].
const (
	EventRecorded  = "recorded"  // counts in summaries and aggregates
	EventDropped   = "dropped"   // accepted, then lost (the AsyncDrop fault)
	EventCancelled = "cancelled" // cancelled by a meter event adjustment
)

// Stripe's windows for meter events.
const (
	// DedupWindow is how long an identifier is refused after its receipt;
	// it is also how long an idempotency key is kept and an event can be
	// cancelled.
	DedupWindow      = 24 * time.Hour
	maxEventAge      = 35 * 24 * time.Hour
	maxEventFuture   = 5 * time.Minute
	maxIdentifierLen = 100
)

const msgTimestampWindow = "Timestamp must be within the past 35 days and not more than 5 minutes in the future"

// event is one recording of a meter event.
type event struct {
	seq        uint64 // receipt order across the simulator
	identifier string
	eventName  string
	meter      string // the meter id it was recorded against
	customer   string
	value      int64
	timestamp  time.Time
	received   time.Time
	status     string
	livemode   bool
	stream     bool              // received on the v2 stream
	payload    map[string]string // as sent, for the v1 answer; nil for stream events
}

// identSt is what an account knows of one identifier in one mode.
type identSt struct {
	latest *event // the latest recording
	count  int    // how many times it was recorded
}

// RecordedEvent is one recording of a meter event, as tests read it back.
type RecordedEvent struct {
	Identifier string    `json:"identifier"`
	EventName  string    `json:"event_name"`
	Meter      string    `json:"meter"` // the id of the meter it was recorded against
	Customer   string    `json:"customer"`
	Value      int64     `json:"value"`
	Timestamp  time.Time `json:"timestamp"` // the event's own time
	Received   time.Time `json:"received"`  // the simulator clock when it was recorded
	Status     string    `json:"status"`    // EventRecorded, EventDropped or EventCancelled
	Livemode   bool      `json:"livemode"`
	Stream     bool      `json:"stream"` // received on the v2 meter event stream
	// Recordings is how many times the identifier was recorded in the
	// account and mode: more than 1 means it was sent again after the
	// dedup window and was billed twice.
	Recordings int `json:"recordings"`
}

// meterEventJSON is the billing.meter_event object stripe-go decodes.
type meterEventJSON struct {
	Object     string            `json:"object"`
	Created    int64             `json:"created"`
	EventName  string            `json:"event_name"`
	Identifier string            `json:"identifier"`
	Livemode   bool              `json:"livemode"`
	Payload    map[string]string `json:"payload"`
	Timestamp  int64             `json:"timestamp"`
}

// eventInput is one meter event to check and record, from v1 or the stream.
type eventInput struct {
	livemode   bool
	eventName  string
	identifier string
	payload    map[string]string
	timestamp  time.Time
	stream     bool
}

// eventProblem is why an event is not recorded: err is the synchronous v1
// answer, code the error report code of an asynchronous failure
// (codeDuplicate for a duplicate, which the stream ignores silently and v1
// always refuses at once), meter the meter when one was found, note the
// error report's message when it is not err's.
type eventProblem struct {
	err   *apiError
	code  string
	meter *Meter
	note  string
}

// reportMessage is the message of the problem in an error report.
func (p *eventProblem) reportMessage() string {
	if p.note != "" {
		return p.note
	}
	return p.err.Message
}

// failure is the problem of in as an error report names it.
func (p *eventProblem) failure(in eventInput) streamFailure {
	return streamFailure{identifier: in.identifier, eventName: in.eventName, meter: p.meter, code: p.code, message: p.reportMessage()}
}

const codeDuplicate = "duplicate"

// maxValueDigits is how many significant digits Stripe accepts in a meter
// event value.
const maxValueDigits = 15

// tooManyDigits reports whether raw is an integer (an optional sign, then
// ASCII digits) with more than maxValueDigits digits once its leading zeros
// are dropped: every other digit counts as significant, trailing zeros too,
// so 10^15 is refused (the strictest reading of Stripe's rule).
func tooManyDigits(raw string) bool {
	if raw != "" && (raw[0] == '+' || raw[0] == '-') {
		raw = raw[1:]
	}
	if raw == "" {
		return false
	}
	for _, r := range raw {
		if r < '0' || r > '9' {
			return false
		}
	}
	return len(strings.TrimLeft(raw, "0")) > maxValueDigits
}

// checkEventLocked validates in against a at now, like Stripe in this order:
// an active meter, the customer and value payload keys, the value, the
// customer, the timestamp window and the identifier's dedup window. On
// success it returns the event to record, which owns in.payload (the v1
// event keeps it for its answer; a stream event, which is never echoed,
// drops it). s.mu must be held.
func (s *Server) checkEventLocked(a *account, in eventInput, now time.Time) (*event, *eventProblem) {
	return s.checkEventMeterLocked(a, a.activeMeterLocked(in.livemode, in.eventName, nil), in, now)
}

// checkEventMeterLocked is checkEventLocked with m, the active meter of
// in's mode and event name (nil if none), already looked up. Every check of
// a valid event is a map lookup: the work per event does not grow with the
// account's events. s.mu must be held.
func (s *Server) checkEventMeterLocked(a *account, m *Meter, in eventInput, now time.Time) (*event, *eventProblem) {
	if m == nil {
		p := &eventProblem{code: CodeNoMeter, err: errInvalid(http.StatusBadRequest, "resource_missing", "event_name",
			"No active meter found for event_name '%s'", in.eventName)}
		if old := a.inactiveMeterLocked(in.livemode, in.eventName); old != nil {
			p.code, p.meter = CodeArchivedMeter, old
			p.note = "The meter for event_name '" + in.eventName + "' is archived."
		}
		return nil, p
	}
	custParam, valueParam := "payload["+m.CustomerPayloadKey+"]", "payload["+m.ValuePayloadKey+"]"
	cust, ok := in.payload[m.CustomerPayloadKey]
	if !ok || cust == "" {
		return nil, &eventProblem{code: CodeNoCustomerDefined, meter: m, err: errMissingParam(custParam),
			note: "Customer mapping key " + m.CustomerPayloadKey + " not found in payload."}
	}
	raw, ok := in.payload[m.ValuePayloadKey]
	if !ok || raw == "" {
		return nil, &eventProblem{code: CodeInvalidValue, meter: m, err: errMissingParam(valueParam),
			note: "Value key " + m.ValuePayloadKey + " not found in payload."}
	}
	if tooManyDigits(raw) {
		return nil, &eventProblem{code: CodeValueTooManyDigits, meter: m, err: errValidation(CodeValueTooManyDigits, valueParam,
			"The value in the event payload can have at most %d digits. Received %s.", maxValueDigits, raw)}
	}
	value, err := strconv.ParseInt(raw, 10, 64)
	if err != nil {
		return nil, &eventProblem{code: CodeInvalidValue, meter: m, err: errValidation(
			"parameter_invalid_integer", valueParam, "Invalid integer: %s. The value of %s must be a whole number.", raw, valueParam)}
	}
	if cu := a.customers[modeID{in.livemode, cust}]; cu == nil || cu.deleted {
		return nil, &eventProblem{code: CodeCustomerNotFound, meter: m,
			err: errNoSuch(http.StatusBadRequest, customerObjectName, custParam, cust)}
	}
	if in.timestamp.Before(now.Add(-maxEventAge)) {
		return nil, &eventProblem{code: CodeTimestampTooFarInPast, meter: m,
			err: errValidation("", "timestamp", msgTimestampWindow)}
	}
	if in.timestamp.After(now.Add(maxEventFuture)) {
		return nil, &eventProblem{code: CodeTimestampInFuture, meter: m,
			err: errValidation("", "timestamp", msgTimestampWindow)}
	}
	if p := s.duplicateLocked(a, in, now); p != nil {
		p.meter = m
		return nil, p
	}
	payload := in.payload
	if in.stream {
		payload = nil
	}
	return &event{
		identifier: in.identifier, eventName: in.eventName, meter: m.ID, customer: cust, value: value,
		timestamp: in.timestamp, received: now, status: EventRecorded, livemode: in.livemode,
		stream: in.stream, payload: payload,
	}, nil
}

// duplicateLocked returns the duplicate problem when in's identifier was
// recorded less than DedupWindow before now in its mode, else nil. The
// duplicate is found while executing: a kept answer, with
// Stripe-Should-Retry: false. s.mu must be held.
func (s *Server) duplicateLocked(a *account, in eventInput, now time.Time) *eventProblem {
	if st := a.idents[modeID{in.livemode, in.identifier}]; st != nil && now.Sub(st.latest.received) < DedupWindow {
		return &eventProblem{code: codeDuplicate,
			err: errInvalid(http.StatusBadRequest, "", "", "An event already exists with identifier %s.", in.identifier)}
	}
	return nil
}

// recordLocked appends ev to a. s.mu must be held.
func (s *Server) recordLocked(a *account, ev *event) {
	s.seq++
	ev.seq = s.seq
	a.events = append(a.events, ev)
	k := modeID{ev.livemode, ev.identifier}
	st := a.idents[k]
	if st == nil {
		st = &identSt{}
		a.idents[k] = st
	}
	st.latest = ev
	st.count++
}

// DropEvent marks the recorded event with the identifier in account as
// dropped, as the AsyncDrop fault would have: it leaves the summaries and
// the aggregates, and an error report names it. It reports whether there was
// such a recorded event. Tests use it to drop exactly the events they mean.
func (s *Server) DropEvent(account, identifier string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.accounts[account]
	if a == nil {
		return false
	}
	for _, ev := range a.events {
		if ev.identifier == identifier && ev.status == EventRecorded {
			ev.status = EventDropped
			m := a.findMeterLocked(ev.livemode, ev.meter)
			s.reportLocked(a, s.now(), ev.livemode, []streamFailure{{identifier: ev.identifier, eventName: ev.eventName, meter: m,
				code: CodeDropped, message: "The event was accepted and then dropped (stripesim DropEvent)."}})
			return true
		}
	}
	return false
}

// newIdentifier is the identifier Stripe generates when none is sent.
func newIdentifier() string { return randomID("sim_", 24) }

// createMeterEvent is POST /v1/billing/meter_events. The shape of the
// request is checked first (validation errors, nothing kept for the key);
// then the event is checked against the account's meters and customers and
// recorded. With Limits.AsyncValidation an event that fails those checks is
// answered 200 as if accepted and reported in an ErrorReport, except a
// duplicate identifier, which is always refused at once.
func (s *Server) createMeterEvent(w http.ResponseWriter, r *http.Request) {
	in, now, e := s.meterEventInput(r)
	if e != nil {
		writeError(w, e)
		return
	}
	d, _ := decisionOf(r)
	if p := s.recordMeterEvent(r, in, now, d.drop); p != nil {
		if p.code == codeDuplicate {
			w.Header().Set("Stripe-Should-Retry", "false")
		}
		writeError(w, p.err)
		return
	}
	writeJSON(w, http.StatusOK, meterEventJSON{
		Object: "billing.meter_event", Created: now.Unix(), EventName: in.eventName, Identifier: in.identifier,
		Livemode: in.livemode, Payload: in.payload, Timestamp: in.timestamp.Unix(),
	})
}

// meterEventInput checks the shape of a POST /v1/billing/meter_events
// request and returns its event, with an identifier generated when none was
// sent and the timestamp now (to the second) when none was sent, and the
// simulator's time of the request.
func (s *Server) meterEventInput(r *http.Request) (eventInput, time.Time, *apiError) {
	rest, payload := splitNested(r.Form, "payload")
	if e := checkParams(rest, "event_name", "identifier", "timestamp"); e != nil {
		return eventInput{}, time.Time{}, e
	}
	f := r.Form
	in := eventInput{livemode: callerOf(r).livemode, eventName: f.Get("event_name"), identifier: f.Get("identifier"), payload: payload}
	if in.eventName == "" {
		return in, time.Time{}, errMissingParam("event_name")
	}
	if len(payload) == 0 {
		return in, time.Time{}, errMissingParam("payload")
	}
	if len(in.identifier) > maxIdentifierLen {
		return in, time.Time{}, errValidation("", "identifier", "Invalid identifier: must be at most %d characters", maxIdentifierLen)
	}
	if in.identifier == "" {
		in.identifier = newIdentifier()
	}
	now := s.now()
	in.timestamp = now.Truncate(time.Second)
	if f.Has("timestamp") {
		v := f.Get("timestamp")
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return in, now, errValidation("parameter_invalid_integer", "timestamp", "Invalid integer: %s", v)
		}
		in.timestamp = time.Unix(n, 0)
	}
	return in, now, nil
}

// recordMeterEvent checks in against the account's meters and customers
// and records it, marking it dropped and reporting it when the request
// drew the AsyncDrop fault (drop). It returns the problem to answer, or
// nil for 200: with Limits.AsyncValidation an invalid event other than a
// duplicate is reported instead of refused.
func (s *Server) recordMeterEvent(r *http.Request, in eventInput, now time.Time, drop bool) *eventProblem {
	c := callerOf(r)
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.accountLocked(c.account)
	async := s.lim.limitsOf(c.account).AsyncValidation
	var ev *event
	var p *eventProblem
	if async {
		p = s.duplicateLocked(a, in, now)
	}
	if p == nil {
		ev, p = s.checkEventLocked(a, in, now)
	}
	switch {
	case p == nil:
		s.recordLocked(a, ev)
		if drop {
			ev.status = EventDropped
			m := a.findMeterLocked(ev.livemode, ev.meter)
			s.reportLocked(a, now, ev.livemode, []streamFailure{sampleOf(r, streamFailure{identifier: ev.identifier, eventName: ev.eventName, meter: m,
				code: CodeDropped, message: "The event was accepted and then dropped (stripesim AsyncDrop fault)."})})
		}
	case async && p.code != codeDuplicate:
		s.reportLocked(a, now, in.livemode, []streamFailure{sampleOf(r, p.failure(in))})
		p = nil
	}
	return p
}

// sampleOf is f as the sample of a v1 error report names it: by the
// request's Idempotency-Key when it had one, and by the request's
// Request-Id. stripe-go documents the sample's request.identifier as "The
// request idempotency key"
// (V1BillingMeterErrorReportTriggeredEventDataReasonErrorTypeSampleErrorRequest),
// and Stripe's example names the request by id and idempotency_key
// (Options.Samples chooses the shape): the simulator names the key when
// the request had one, the worst case for a client that matches samples
// to its events by identifier; the stream's samples name the event.
func sampleOf(r *http.Request, f streamFailure) streamFailure {
	if k := r.Header.Get("Idempotency-Key"); k != "" {
		f.identifier = k
	}
	f.requestID = recordOf(r).RequestID
	return f
}

// Events returns every recording of a meter event in account, both modes,
// in receipt order — recorded, dropped and cancelled ones.
func (s *Server) Events(account string) []RecordedEvent {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.accounts[account]
	if a == nil {
		return nil
	}
	out := make([]RecordedEvent, len(a.events))
	for i, ev := range a.events {
		out[i] = RecordedEvent{
			Identifier: ev.identifier, EventName: ev.eventName, Meter: ev.meter, Customer: ev.customer,
			Value: ev.value, Timestamp: ev.timestamp, Received: ev.received, Status: ev.status,
			Livemode: ev.livemode, Stream: ev.stream, Recordings: a.idents[modeID{ev.livemode, ev.identifier}].count,
		}
	}
	return out
}

// Aggregate returns, over the events of account (both modes) with the
// event name and customer whose status is EventRecorded, what each meter
// formula makes of them: the sum of the values, their count, and the value
// of the last one (latest timestamp; on a tie, the later received).
func (s *Server) Aggregate(account, eventName, customer string) (sum int64, count int, last int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.accounts[account]
	if a == nil {
		return 0, 0, 0
	}
	var lastEv *event
	for _, ev := range a.events {
		if ev.status != EventRecorded || ev.eventName != eventName || ev.customer != customer {
			continue
		}
		sum += ev.value
		count++
		if lastEv == nil || laterEvent(ev, lastEv) {
			lastEv = ev
		}
	}
	if lastEv != nil {
		last = lastEv.value
	}
	return sum, count, last
}

// laterEvent reports whether a comes after b for the last formula.
func laterEvent(a, b *event) bool {
	if !a.timestamp.Equal(b.timestamp) {
		return a.timestamp.After(b.timestamp)
	}
	return a.seq > b.seq
}

// RecordedTwice returns the identifiers recorded more than once in one
// account and mode, sorted, over all accounts. A non-empty answer means
// some usage was billed twice.
func (s *Server) RecordedTwice() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, a := range s.accounts {
		for k, st := range a.idents {
			if st.count > 1 {
				out = append(out, k.id)
			}
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}
