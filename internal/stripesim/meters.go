package stripesim

import (
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/go-chi/chi/v5"
)

// Meter statuses and the defaults of a meter's payload keys.
const (
	MeterActive   = "active"
	MeterInactive = "inactive"

	DefaultCustomerPayloadKey = "stripe_customer_id"
	DefaultValuePayloadKey    = "value"
)

// MeterSpec describes a meter to create with [Server.CreateMeter].
type MeterSpec struct {
	DisplayName string // default: EventName
	EventName   string // required
	Formula     string // sum, count or last; default sum
	// CustomerPayloadKey and ValuePayloadKey default to
	// DefaultCustomerPayloadKey and DefaultValuePayloadKey.
	CustomerPayloadKey string
	ValuePayloadKey    string
	EventTimeWindow    string // "", day or hour
	Livemode           bool   // the mode the meter lives in; default test
}

// Meter is a billing meter as the simulator holds it.
type Meter struct {
	ID                 string
	DisplayName        string
	EventName          string
	Formula            string // sum, count or last
	CustomerPayloadKey string
	ValuePayloadKey    string
	EventTimeWindow    string // "", day or hour
	Status             string // MeterActive or MeterInactive
	Livemode           bool
	Created            time.Time
	Updated            time.Time
	DeactivatedAt      time.Time // zero unless inactive
}

// meterJSON is the billing.meter object stripe-go decodes.
type meterJSON struct {
	ID              string `json:"id"`
	Object          string `json:"object"`
	Created         int64  `json:"created"`
	CustomerMapping struct {
		EventPayloadKey string `json:"event_payload_key"`
		Type            string `json:"type"`
	} `json:"customer_mapping"`
	DefaultAggregation struct {
		Formula string `json:"formula"`
	} `json:"default_aggregation"`
	DisplayName       string  `json:"display_name"`
	EventName         string  `json:"event_name"`
	EventTimeWindow   *string `json:"event_time_window"`
	Livemode          bool    `json:"livemode"`
	Status            string  `json:"status"`
	StatusTransitions struct {
		DeactivatedAt *int64 `json:"deactivated_at"`
	} `json:"status_transitions"`
	Updated       int64 `json:"updated"`
	ValueSettings struct {
		EventPayloadKey string `json:"event_payload_key"`
	} `json:"value_settings"`
}

func (m *Meter) json() meterJSON {
	out := meterJSON{
		ID: m.ID, Object: "billing.meter", Created: m.Created.Unix(),
		DisplayName: m.DisplayName, EventName: m.EventName, Livemode: m.Livemode,
		Status: m.Status, Updated: m.Updated.Unix(),
	}
	out.CustomerMapping.EventPayloadKey = m.CustomerPayloadKey
	out.CustomerMapping.Type = "by_id"
	out.DefaultAggregation.Formula = m.Formula
	if m.EventTimeWindow != "" {
		w := m.EventTimeWindow
		out.EventTimeWindow = &w
	}
	if !m.DeactivatedAt.IsZero() {
		t := m.DeactivatedAt.Unix()
		out.StatusTransitions.DeactivatedAt = &t
	}
	out.ValueSettings.EventPayloadKey = m.ValuePayloadKey
	return out
}

const meterObjectName = "billing meter"

// findMeterLocked returns the meter id of a's mode livemode, or nil.
func (a *account) findMeterLocked(livemode bool, id string) *Meter {
	for _, m := range a.meters {
		if m.ID == id && m.Livemode == livemode {
			return m
		}
	}
	return nil
}

// activeMeterLocked returns the active meter of the mode with the event
// name, other than except, or nil.
func (a *account) activeMeterLocked(livemode bool, eventName string, except *Meter) *Meter {
	for _, m := range a.meters {
		if m != except && m.Livemode == livemode && m.Status == MeterActive && m.EventName == eventName {
			return m
		}
	}
	return nil
}

// inactiveMeterLocked returns the latest created inactive meter of the
// mode with the event name, or nil.
func (a *account) inactiveMeterLocked(livemode bool, eventName string) *Meter {
	for i := len(a.meters) - 1; i >= 0; i-- {
		if m := a.meters[i]; m.Livemode == livemode && m.Status == MeterInactive && m.EventName == eventName {
			return m
		}
	}
	return nil
}

func errDuplicateEventName(name string) *apiError {
	return errInvalid(http.StatusBadRequest, "resource_already_exists", "event_name",
		"An active meter with event_name '%s' already exists. Deactivate it or choose another event_name.", name)
}

// addMeterLocked validates spec, whose required fields are set, and adds
// the meter to a.
func (s *Server) addMeterLocked(a *account, spec MeterSpec) (*Meter, *apiError) {
	if !slices.Contains([]string{"sum", "count", "last"}, spec.Formula) {
		return nil, errValidation("", "default_aggregation[formula]",
			"Invalid default_aggregation[formula]: must be one of sum, count, or last")
	}
	if !slices.Contains([]string{"", "day", "hour"}, spec.EventTimeWindow) {
		return nil, errValidation("", "event_time_window",
			"Invalid event_time_window: must be one of day or hour")
	}
	if a.activeMeterLocked(spec.Livemode, spec.EventName, nil) != nil {
		return nil, errDuplicateEventName(spec.EventName)
	}
	now := s.now()
	m := &Meter{
		ID: randomID("mtr_", 24), DisplayName: spec.DisplayName, EventName: spec.EventName,
		Formula: spec.Formula, CustomerPayloadKey: spec.CustomerPayloadKey,
		ValuePayloadKey: spec.ValuePayloadKey, EventTimeWindow: spec.EventTimeWindow,
		Status: MeterActive, Livemode: spec.Livemode, Created: now, Updated: now,
	}
	a.meters = append(a.meters, m)
	s.meterEventLocked(a, EventMeterCreated, m)
	return m, nil
}

// CreateMeter adds a meter to account (added if unknown) without HTTP, for
// test setup. Empty fields take their defaults. It panics when the spec is
// invalid or an active meter of the same mode already has the event name,
// which the HTTP API would refuse too.
func (s *Server) CreateMeter(account string, spec MeterSpec) Meter {
	if spec.EventName == "" {
		panic("stripesim: CreateMeter: EventName is required")
	}
	if spec.DisplayName == "" {
		spec.DisplayName = spec.EventName
	}
	if spec.Formula == "" {
		spec.Formula = "sum"
	}
	if spec.CustomerPayloadKey == "" {
		spec.CustomerPayloadKey = DefaultCustomerPayloadKey
	}
	if spec.ValuePayloadKey == "" {
		spec.ValuePayloadKey = DefaultValuePayloadKey
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	m, e := s.addMeterLocked(s.accountLocked(account), spec)
	if e != nil {
		panic("stripesim: CreateMeter: " + e.Message)
	}
	return *m
}

// Meters returns the meters of account, both modes, active and inactive, in
// creation order (the API lists newest first).
func (s *Server) Meters(account string) []Meter {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.accounts[account]
	if a == nil {
		return nil
	}
	out := make([]Meter, len(a.meters))
	for i, m := range a.meters {
		out[i] = *m
	}
	return out
}

// DeactivateMeter deactivates a meter of account without HTTP. It is a no-op
// for a meter already inactive and an error for an unknown one.
func (s *Server) DeactivateMeter(account, id string) error {
	return s.setMeterStatus(account, id, MeterInactive)
}

// ReactivateMeter reactivates a meter of account without HTTP. It is a
// no-op for a meter already active, and an error for an unknown one or
// when another active meter of its mode has its event name.
func (s *Server) ReactivateMeter(account, id string) error {
	return s.setMeterStatus(account, id, MeterActive)
}

// setMeterStatus moves a meter of account to status, recording the event
// Stripe would send.
func (s *Server) setMeterStatus(account, id, status string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if a := s.accounts[account]; a != nil {
		for _, m := range a.meters {
			if m.ID != id {
				continue
			}
			if m.Status == status {
				return nil
			}
			if status == MeterActive && a.activeMeterLocked(m.Livemode, m.EventName, m) != nil {
				return fmt.Errorf("stripesim: another active meter has event name %q", m.EventName)
			}
			s.transitionLocked(a, m, status)
			return nil
		}
	}
	return fmt.Errorf("stripesim: no meter %q in account %q", id, account)
}

// transitionLocked moves m of account a to status and records the event
// Stripe would send. s.mu must be held.
func (s *Server) transitionLocked(a *account, m *Meter, status string) {
	now := s.now()
	m.Status, m.Updated = status, now
	typ := EventMeterReactivated
	if status == MeterInactive {
		m.DeactivatedAt = now
		typ = EventMeterDeactivated
	} else {
		m.DeactivatedAt = time.Time{}
	}
	s.meterEventLocked(a, typ, m)
}

// listMeters is GET /v1/billing/meters.
func (s *Server) listMeters(w http.ResponseWriter, r *http.Request) {
	if e := checkParams(r.Form, "limit", "starting_after", "ending_before", "status"); e != nil {
		writeError(w, e)
		return
	}
	p, e := parseListParams(r.Form)
	if e != nil {
		writeError(w, e)
		return
	}
	status := r.Form.Get("status")
	if status != "" && status != MeterActive && status != MeterInactive {
		writeError(w, errValidation("", "status", "Invalid status: must be one of active or inactive"))
		return
	}
	c := callerOf(r)
	s.mu.Lock()
	var all []meterJSON // newest first
	if a := s.accounts[c.account]; a != nil {
		for i := len(a.meters) - 1; i >= 0; i-- {
			if m := a.meters[i]; m.Livemode == c.livemode {
				all = append(all, m.json())
			}
		}
	}
	s.mu.Unlock()
	page, more, e := paginate(all,
		func(m meterJSON) string { return m.ID },
		func(m meterJSON) bool { return status == "" || m.Status == status },
		p, meterObjectName)
	if e != nil {
		writeError(w, e)
		return
	}
	if page == nil {
		page = []meterJSON{}
	}
	writeJSON(w, http.StatusOK, listEnvelope{Object: "list", Data: page, HasMore: more, URL: "/v1/billing/meters"})
}

// getMeter is GET /v1/billing/meters/{id}.
func (s *Server) getMeter(w http.ResponseWriter, r *http.Request) {
	if e := checkParams(r.Form); e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	var out meterJSON
	m := s.accountLocked(c.account).findMeterLocked(c.livemode, id)
	if m != nil {
		out = m.json()
	}
	s.mu.Unlock()
	if m == nil {
		writeError(w, errNoSuch(http.StatusNotFound, meterObjectName, "id", id))
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// createMeter is POST /v1/billing/meters.
func (s *Server) createMeter(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	if e := checkParams(r.Form, "display_name", "event_name", "default_aggregation[formula]",
		"customer_mapping[event_payload_key]", "customer_mapping[type]",
		"value_settings[event_payload_key]", "event_time_window"); e != nil {
		writeError(w, e)
		return
	}
	c := callerOf(r)
	spec := MeterSpec{
		DisplayName: f.Get("display_name"), EventName: f.Get("event_name"),
		Formula:            f.Get("default_aggregation[formula]"),
		CustomerPayloadKey: DefaultCustomerPayloadKey, ValuePayloadKey: DefaultValuePayloadKey,
		EventTimeWindow: f.Get("event_time_window"), Livemode: c.livemode,
	}
	for _, req := range []struct{ param, value string }{
		{"default_aggregation[formula]", spec.Formula},
		{"display_name", spec.DisplayName},
		{"event_name", spec.EventName},
	} {
		if req.value == "" {
			writeError(w, errMissingParam(req.param))
			return
		}
	}
	if f.Has("customer_mapping[event_payload_key]") || f.Has("customer_mapping[type]") {
		spec.CustomerPayloadKey = f.Get("customer_mapping[event_payload_key]")
		if spec.CustomerPayloadKey == "" {
			writeError(w, errMissingParam("customer_mapping[event_payload_key]"))
			return
		}
		switch t := f.Get("customer_mapping[type]"); t {
		case "":
			writeError(w, errMissingParam("customer_mapping[type]"))
			return
		case "by_id":
		default:
			writeError(w, errValidation("", "customer_mapping[type]",
				"Invalid customer_mapping[type]: must be by_id"))
			return
		}
	}
	if f.Has("value_settings[event_payload_key]") {
		spec.ValuePayloadKey = f.Get("value_settings[event_payload_key]")
		if spec.ValuePayloadKey == "" {
			writeError(w, errMissingParam("value_settings[event_payload_key]"))
			return
		}
	}
	s.mu.Lock()
	m, e := s.addMeterLocked(s.accountLocked(c.account), spec)
	var out meterJSON
	if m != nil {
		out = m.json()
	}
	s.mu.Unlock()
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// deactivateMeter is POST /v1/billing/meters/{id}/deactivate.
func (s *Server) deactivateMeter(w http.ResponseWriter, r *http.Request) {
	s.transitionMeter(w, r, MeterActive, MeterInactive)
}

// reactivateMeter is POST /v1/billing/meters/{id}/reactivate.
func (s *Server) reactivateMeter(w http.ResponseWriter, r *http.Request) {
	s.transitionMeter(w, r, MeterInactive, MeterActive)
}

// transitionMeter moves a meter from status from to status to. A meter not
// in status from is refused with 400 (the simulator's choice: Stripe's
// exact answer to a repeated transition is not pinned down here).
func (s *Server) transitionMeter(w http.ResponseWriter, r *http.Request, from, to string) {
	if e := checkParams(r.Form); e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	out, e := func() (meterJSON, *apiError) {
		s.mu.Lock()
		defer s.mu.Unlock()
		a := s.accountLocked(c.account)
		m := a.findMeterLocked(c.livemode, id)
		switch {
		case m == nil:
			return meterJSON{}, errNoSuch(http.StatusNotFound, meterObjectName, "id", id)
		case m.Status != from:
			return meterJSON{}, errInvalid(http.StatusBadRequest, "", "", "This meter is already %s.", m.Status)
		case to == MeterActive && a.activeMeterLocked(m.Livemode, m.EventName, m) != nil:
			return meterJSON{}, errDuplicateEventName(m.EventName)
		}
		s.transitionLocked(a, m, to)
		return m.json(), nil
	}()
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, out)
}
