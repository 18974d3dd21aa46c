package stripesim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

const (
	streamPath      = "/v2/billing/meter_event_stream"
	sessionTTL      = 15 * time.Minute
	maxStreamEvents = 100
)

// session is a v2 meter event session: its token authenticates the stream.
type session struct {
	account  string
	livemode bool
	connect  bool // created for a connected account (the Stripe-Account header)
	expires  time.Time
}

// sessionJSON is the v2.billing.meter_event_session object stripe-go
// decodes (times in RFC 3339).
type sessionJSON struct {
	ID                  string    `json:"id"`
	Object              string    `json:"object"`
	AuthenticationToken string    `json:"authentication_token"`
	Created             time.Time `json:"created"`
	ExpiresAt           time.Time `json:"expires_at"`
	Livemode            bool      `json:"livemode"`
}

// errSessionExpired is Stripe's answer on the stream to an expired or
// unknown session token. stripe-go v82 parses the errors of /v2 paths by
// error.type: this one becomes a *stripe.TemporarySessionExpiredError;
// every other one, whatever its status, a *stripe.V2RawError (Type, Code
// and Message, no HTTP status) — never a *stripe.Error.
func errSessionExpired() *apiError {
	return &apiError{Status: http.StatusUnauthorized, Type: "temporary_session_expired", Code: "billing_meter_event_session_expired",
		Message: "The meter event session has expired or is not valid. Create a new session with POST /v2/billing/meter_event_session."}
}

// isJSONObject reports whether body is empty or one JSON object.
func isJSONObject(body []byte) bool {
	body = bytes.TrimSpace(body)
	if len(body) == 0 {
		return true
	}
	var v map[string]json.RawMessage
	return json.Unmarshal(body, &v) == nil
}

// createSession is POST /v2/billing/meter_event_session (API key auth): a
// token for the stream, valid sessionTTL on the simulator clock, for the
// account and mode the request acts on.
func (s *Server) createSession(w http.ResponseWriter, r *http.Request) {
	if !isJSONObject(bodyOf(r)) {
		writeError(w, errValidation("", "", "Invalid request: the body is not a JSON object."))
		return
	}
	c := callerOf(r)
	now := s.now().UTC()
	out := sessionJSON{
		ID: randomID("mes_", 24), Object: "v2.billing.meter_event_session",
		AuthenticationToken: randomID("mesk_", 48), Created: now, ExpiresAt: now.Add(sessionTTL), Livemode: c.livemode,
	}
	if !c.livemode {
		out.ID = randomID("mes_test_", 24)
		out.AuthenticationToken = randomID("mesk_test_", 48)
	}
	s.mu.Lock()
	s.accountLocked(c.account)
	for tok, sess := range s.sessions {
		if !now.Before(sess.expires) {
			delete(s.sessions, tok)
		}
	}
	s.sessions[out.AuthenticationToken] = &session{account: c.account, livemode: c.livemode, connect: c.connect, expires: out.ExpiresAt}
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, out)
}

// ExpireSessions expires every live meter event session of account now, on
// any clock: the next stream request with one of their tokens is answered
// 401 temporary_session_expired, as after the 15 minutes. It returns how
// many live sessions it expired. Tests use it to expire sessions mid-run
// without moving [Options.Now].
func (s *Server) ExpireSessions(account string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	now, n := s.now(), 0
	for tok, sess := range s.sessions {
		if sess.account != account {
			continue
		}
		if now.Before(sess.expires) {
			n++
		}
		delete(s.sessions, tok)
	}
	return n
}

// authenticateSession authenticates the stream with a session token, in
// place of an API key; the Stripe-Account header plays no part (the
// session fixed the account).
func (s *Server) authenticateSession(next http.Handler, w http.ResponseWriter, r *http.Request) {
	tok := apiKey(r)
	s.mu.Lock()
	sess := s.sessions[tok]
	now := s.now()
	revoked := sess != nil && sess.connect && s.accounts[sess.account] != nil && s.accounts[sess.account].revoked
	s.mu.Unlock()
	if sess == nil || !now.Before(sess.expires) {
		writeError(w, errSessionExpired())
		return
	}
	if revoked {
		// Not documented: what a live session of a revoked connected
		// account gets. Designed for the worst: it stops working at once.
		writeError(w, s.accountInvalid(tok, sess.account))
		return
	}
	c := caller{account: sess.account, livemode: sess.livemode, connect: sess.connect}
	rec := recordOf(r)
	rec.Account, rec.Livemode = c.account, c.livemode
	next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callerKey, c)))
}

// streamEvent is one event of a stream request as sent.
type streamEvent struct {
	EventName  string         `json:"event_name"`
	Identifier string         `json:"identifier"`
	Payload    map[string]any `json:"payload"`
	Timestamp  *string        `json:"timestamp"`
}

// stream is POST /v2/billing/meter_event_stream, answered 200 with an
// empty object like Stripe. The shape of the request is checked at once
// (400); the events themselves are validated as Stripe does
// asynchronously — here before answering, so a test sees the outcome right
// after the answer: valid events are recorded, duplicates of an identifier
// inside the dedup window are ignored silently, and every other invalid
// event is left out and reported in an [ErrorReport]. A recorded event the
// AsyncDrop fault hits (drawn per event) is marked dropped and reported
// with CodeDropped. The gate and the execute layer applied the rate limits
// and the other faults to the request as a whole.
func (s *Server) stream(w http.ResponseWriter, r *http.Request) {
	evs, e := decodeStream(r)
	if e != nil {
		writeError(w, e)
		return
	}
	c := callerOf(r)
	now := s.now()
	ins := make([]eventInput, len(evs))
	for i, ev := range evs {
		in, e := streamInput(i, ev, c, now)
		if e != nil {
			writeError(w, e)
			return
		}
		ins[i] = in
	}

	d, _ := decisionOf(r)
	s.mu.Lock()
	a := s.accountLocked(c.account)
	failures := s.recordStreamLocked(a, c, ins, d.dropP, now)
	for i := range failures {
		// A stream request carries up to 100 events: its id names none alone.
		failures[i].requestID = recordOf(r).RequestID
	}
	s.reportLocked(a, now, c.livemode, failures)
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, struct{}{})
}

// decodeStream reads the events of a stream request and checks their
// number: at least one, at most maxStreamEvents.
func decodeStream(r *http.Request) ([]streamEvent, *apiError) {
	var req struct {
		Events []streamEvent `json:"events"`
	}
	dec := json.NewDecoder(bytes.NewReader(bodyOf(r)))
	dec.UseNumber()
	if err := dec.Decode(&req); err != nil {
		return nil, errValidation("", "", "Invalid JSON body: %v", err)
	}
	switch n := len(req.Events); {
	case n == 0:
		return nil, errMissingParam("events")
	case n > maxStreamEvents:
		return nil, errValidation("", "events",
			"Too many events: a request may contain at most %d events, this one has %d.", maxStreamEvents, n)
	}
	return req.Events, nil
}

// streamInput checks the shape of the stream request's event i and returns
// it as an eventInput: an identifier generated when none was sent, the
// timestamp now when none was sent.
func streamInput(i int, ev streamEvent, c caller, now time.Time) (eventInput, *apiError) {
	at := func(field string) string { return fmt.Sprintf("events[%d].%s", i, field) }
	in := eventInput{livemode: c.livemode, eventName: ev.EventName, identifier: ev.Identifier,
		payload: map[string]string{}, timestamp: now, stream: true}
	if in.eventName == "" {
		return in, errMissingParam(at("event_name"))
	}
	if ev.Payload == nil {
		return in, errMissingParam(at("payload"))
	}
	for k, v := range ev.Payload {
		switch v := v.(type) {
		case string:
			in.payload[k] = v
		case json.Number:
			in.payload[k] = v.String()
		default:
			return in, errValidation("", at("payload"), "Invalid %s[%s]: must be a string", at("payload"), k)
		}
	}
	if len(in.identifier) > maxIdentifierLen {
		return in, errValidation("", at("identifier"),
			"Invalid %s: must be at most %d characters", at("identifier"), maxIdentifierLen)
	}
	if in.identifier == "" {
		in.identifier = newIdentifier()
	}
	if ev.Timestamp != nil {
		t, err := time.Parse(time.RFC3339Nano, *ev.Timestamp)
		if err != nil {
			return in, errValidation("", at("timestamp"),
				"Invalid %s: must be an RFC 3339 date-time", at("timestamp"))
		}
		in.timestamp = t
	}
	return in, nil
}

// recordStreamLocked checks the events of one stream request against a's
// meters and customers in order, records the valid ones and draws the
// AsyncDrop fault (probability dropP) for each recorded event. It returns
// the failures to report: invalid events other than duplicates, and
// dropped ones. s.mu must be held.
func (s *Server) recordStreamLocked(a *account, c caller, ins []eventInput, dropP float64, now time.Time) []streamFailure {
	var failures []streamFailure
	meters := map[string]*Meter{} // event name -> active meter, for this request
	for _, in := range ins {
		m, ok := meters[in.eventName]
		if !ok {
			m = a.activeMeterLocked(c.livemode, in.eventName, nil)
			meters[in.eventName] = m
		}
		ev, p := s.checkEventMeterLocked(a, m, in, now)
		switch {
		case p == nil:
			s.recordLocked(a, ev)
			if s.lim.roll(dropP) {
				ev.status = EventDropped
				failures = append(failures, streamFailure{identifier: in.identifier, eventName: in.eventName, meter: m,
					code: CodeDropped, message: "The event was accepted and then dropped (stripesim AsyncDrop fault)."})
			}
		case p.code != codeDuplicate:
			failures = append(failures, streamFailure{identifier: in.identifier, eventName: in.eventName,
				meter: p.meter, code: p.code, message: p.reportMessage()})
		}
	}
	return failures
}
