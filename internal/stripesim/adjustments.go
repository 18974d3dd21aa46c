package stripesim

import "net/http"

const adjustmentsPath = "/v1/billing/meter_event_adjustments"

// adjustmentJSON is the billing.meter_event_adjustment object stripe-go
// decodes.
type adjustmentJSON struct {
	Object string `json:"object"`
	Cancel struct {
		Identifier string `json:"identifier"`
	} `json:"cancel"`
	EventName string `json:"event_name"`
	Livemode  bool   `json:"livemode"`
	Status    string `json:"status"`
	Type      string `json:"type"`
}

// createAdjustment is POST /v1/billing/meter_event_adjustments: type cancel
// cancels the latest recording of an identifier with the event name if it
// was received less than DedupWindow ago. The cancelled event leaves the
// summaries and aggregates at once, so the adjustment is complete.
func (s *Server) createAdjustment(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	if e := checkParams(f, "event_name", "type", "cancel[identifier]"); e != nil {
		writeError(w, e)
		return
	}
	name, typ, ident := f.Get("event_name"), f.Get("type"), f.Get("cancel[identifier]")
	switch {
	case name == "":
		writeError(w, errMissingParam("event_name"))
		return
	case typ == "":
		writeError(w, errMissingParam("type"))
		return
	case typ != "cancel":
		writeError(w, errValidation("", "type", "Invalid type: must be cancel"))
		return
	case ident == "":
		writeError(w, errMissingParam("cancel[identifier]"))
		return
	}
	c := callerOf(r)
	e := func() *apiError {
		s.mu.Lock()
		defer s.mu.Unlock()
		a := s.accountLocked(c.account)
		st := a.idents[modeID{c.livemode, ident}]
		if st == nil || st.latest.eventName != name {
			return errInvalid(http.StatusBadRequest, "resource_missing", "cancel[identifier]",
				"No meter event with identifier '%s' and event_name '%s' found.", ident, name)
		}
		ev := st.latest
		switch {
		case s.now().Sub(ev.received) >= DedupWindow:
			return errInvalid(http.StatusBadRequest, "", "cancel[identifier]",
				"The meter event with identifier '%s' was received more than 24 hours ago and can no longer be cancelled.", ident)
		case ev.status == EventCancelled && s.again:
			return nil // Options.CancelAgainSucceeds: the worst case, a success that proves nothing
		case ev.status == EventCancelled:
			return errInvalid(http.StatusBadRequest, "", "cancel[identifier]",
				"The meter event with identifier '%s' has already been cancelled.", ident)
		}
		ev.status = EventCancelled
		return nil
	}()
	if e != nil {
		writeError(w, e)
		return
	}
	out := adjustmentJSON{Object: "billing.meter_event_adjustment", EventName: name, Livemode: c.livemode,
		Status: "complete", Type: "cancel"}
	out.Cancel.Identifier = ident
	writeJSON(w, http.StatusOK, out)
}
