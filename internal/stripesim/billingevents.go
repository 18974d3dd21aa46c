package stripesim

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/stripe/stripe-go/v82/webhook"
)

// Types of the v1 events Stripe sends about subscriptions and invoices
// (stripe-go's EventTypeCustomerSubscription* and EventTypeInvoice*).
const (
	EventSubscriptionCreated = "customer.subscription.created"
	EventSubscriptionUpdated = "customer.subscription.updated"
	EventSubscriptionDeleted = "customer.subscription.deleted"
	EventInvoiceCreated      = "invoice.created"
	EventInvoiceFinalized    = "invoice.finalized"
	EventInvoiceUpdated      = "invoice.updated"
)

// BillingEvent is one v1 snapshot event about a subscription or an
// invoice: data.object as the object was when the event happened, and
// data.previous_attributes, the top-level fields an update changed with
// their values before it.
type BillingEvent struct {
	ID       string // evt_…
	Type     string // one of the EventSubscription* and EventInvoice* types
	Created  time.Time
	Livemode bool
	// Account is the connected account the event happened on; empty for
	// an account that is a key's own.
	Account            string
	Object             json.RawMessage
	PreviousAttributes json.RawMessage // nil when there are none
	// RequestID and IdempotencyKey name the API request that caused the
	// event; both are empty for what Stripe did on its own (a renewal, a
	// finalization at the end of the grace period).
	RequestID      string
	IdempotencyKey string
}

// v1Event is one v1 event of an account: a BillingEvent, or a meter event
// (meter set) in the same form, as GET /v1/events lists them together.
type v1Event struct {
	BillingEvent
	meter bool
}

// snapshot marshals v, an object the simulator renders.
func snapshot(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic("stripesim: cannot encode an event object: " + err.Error())
	}
	return b
}

// previousAttributes is the previous_attributes of an update from before
// to after: every top-level field whose value changed, with its value in
// before; nil when nothing changed.
func previousAttributes(before, after json.RawMessage) json.RawMessage {
	var b, a map[string]json.RawMessage
	if json.Unmarshal(before, &b) != nil || json.Unmarshal(after, &a) != nil {
		return nil
	}
	prev := map[string]json.RawMessage{}
	for k, v := range b {
		if !bytes.Equal(v, a[k]) {
			prev[k] = v
		}
	}
	if len(prev) == 0 {
		return nil
	}
	return snapshot(prev)
}

// emitLocked records a billing event of type typ at at in account a, its
// object rendered now; cause is the request that caused it, nil for what
// Stripe does on its own. s.mu must be held.
func (s *Server) emitLocked(a *account, typ string, livemode bool, at time.Time, object any, prev json.RawMessage, cause *http.Request) {
	e := BillingEvent{ID: newEventID(livemode), Type: typ, Created: at, Livemode: livemode, Object: snapshot(object),
		PreviousAttributes: prev}
	if !s.ownAccountLocked(a.id) {
		e.Account = a.id
	}
	if cause != nil {
		e.RequestID, e.IdempotencyKey = recordOf(cause).RequestID, cause.Header.Get("Idempotency-Key")
	}
	a.v1Events = append(a.v1Events, v1Event{BillingEvent: e})
}

// newEventID is a fresh v1 event id of the mode.
func newEventID(livemode bool) string {
	if livemode {
		return randomID("evt_", 24)
	}
	return randomID("evt_test_", 24)
}

// eventRequestJSON is an event's request: null id and key for an event
// Stripe caused itself.
type eventRequestJSON struct {
	ID             *string `json:"id"`
	IdempotencyKey *string `json:"idempotency_key"`
}

func (e BillingEvent) json() snapshotEventJSON {
	out := snapshotEventJSON{ID: e.ID, Object: "event", APIVersion: apiVersion, Created: e.Created.Unix(),
		Livemode: e.Livemode, PendingWebhooks: 1, Type: e.Type,
		Request: eventRequestJSON{ID: optional(e.RequestID), IdempotencyKey: optional(e.IdempotencyKey)}}
	if e.Account != "" {
		acct := e.Account
		out.Account = &acct
	}
	out.Data.Object, out.Data.PreviousAttributes = e.Object, e.PreviousAttributes
	return out
}

// SignedBillingEvent is the body and Stripe-Signature header of the
// snapshot event e, signed with secret at t, as an event destination with
// the snapshot payload style would post it.
func SignedBillingEvent(e BillingEvent, secret string, t time.Time) (body []byte, signature string) {
	p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: snapshot(e.json()), Secret: secret, Timestamp: t})
	return p.Payload, p.Header
}

// billingEventsLocked returns a's billing events, both modes, by created
// time, in the order they were recorded at equal times. s.mu must be held.
func (a *account) billingEventsLocked() []BillingEvent {
	var out []BillingEvent
	for _, e := range a.v1Events {
		if !e.meter {
			out = append(out, e.BillingEvent)
		}
	}
	slices.SortStableFunc(out, func(x, y BillingEvent) int { return x.Created.Compare(y.Created) })
	return out
}

// BillingEvents returns the subscription and invoice events of account,
// both modes, oldest first, after applying the billing due at the
// simulator's now ([Server.AdvanceBilling]).
func (s *Server) BillingEvents(account string) []BillingEvent {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.advanceBillingLocked(s.now())
	if a := s.accounts[account]; a != nil {
		return a.billingEventsLocked()
	}
	return nil
}

// DeliverBillingEvents posts every billing event of account not delivered
// yet to url as a signed snapshot event, oldest first, after applying the
// billing due at the simulator's now, and marks those answered 2xx
// delivered. It returns how many were delivered; the first answer that is
// not 2xx stops it with an error.
func (s *Server) DeliverBillingEvents(ctx context.Context, account, url, secret string) (int, error) {
	s.mu.Lock()
	s.advanceBillingLocked(s.now())
	a := s.accounts[account]
	var pending []BillingEvent
	if a != nil {
		for _, e := range a.billingEventsLocked() {
			if !a.delivered[e.ID] {
				pending = append(pending, e)
			}
		}
	}
	s.mu.Unlock()
	n := 0
	for _, e := range pending {
		body, sig := SignedBillingEvent(e, secret, time.Now())
		if err := deliver(ctx, e.ID, url, body, sig); err != nil {
			return n, err
		}
		s.mu.Lock()
		a.delivered[e.ID] = true
		s.mu.Unlock()
		n++
	}
	return n, nil
}

// v1EventsPath is the v1 events endpoint.
const v1EventsPath = "/v1/events"

// maxEventTypes is how many types GET /v1/events takes: "An array of up to
// 20 strings containing specific event names" (stripe-go
// EventListParams.Types).
const maxEventTypes = 20

var (
	typesKey     = regexp.MustCompile(`^types(\[[0-9]*\])?$`)
	v1EventsKeys = append([]*regexp.Regexp{exact("type"), typesKey}, append(slices.Clone(listKeys), createdKeys...)...)
)

// typeMatcher is the type filter of a listing: type, a name or "a group of
// events using * as a wildcard", or types, exact names.
type typeMatcher struct {
	pattern *regexp.Regexp
	types   []string
}

func (m typeMatcher) keeps(typ string) bool {
	switch {
	case m.pattern != nil:
		return m.pattern.MatchString(typ)
	case m.types != nil:
		return slices.Contains(m.types, typ)
	}
	return true
}

// readableV1 reports whether e can still be read or listed at now: of the
// caller's mode, and younger than eventRetention ("List events, going back
// up to 30 days", stripe-go EventListParams).
func readableV1(e v1Event, livemode bool, now time.Time) bool {
	return e.Livemode == livemode && now.Sub(e.Created) < eventRetention
}

// listV1Events is GET /v1/events: the account's v1 events — meter,
// subscription and invoice events — of the key's mode from the last 30
// days, newest first, filtered by type (with * wildcards) or types, and
// created, a page at a time with starting_after and ending_before.
func (s *Server) listV1Events(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	if e := checkParamPatterns(f, v1EventsKeys...); e != nil {
		writeError(w, e)
		return
	}
	lp, e := parseListParams(f)
	if e != nil {
		writeError(w, e)
		return
	}
	created, e := parseCreatedFilter(f, "created")
	if e != nil {
		writeError(w, e)
		return
	}
	var m typeMatcher
	for k, vs := range f {
		if typesKey.MatchString(k) {
			m.types = append(m.types, vs...)
		}
	}
	switch {
	case f.Has("type") && m.types != nil:
		writeError(w, errValidation("parameters_exclusive", "types", "You may only specify one of these parameters: type, types."))
		return
	case len(m.types) > maxEventTypes:
		writeError(w, errValidation("", "types", "Invalid types: must have at most %d elements", maxEventTypes))
		return
	case f.Has("type"):
		m.pattern = regexp.MustCompile("^" + strings.ReplaceAll(regexp.QuoteMeta(f.Get("type")), `\*`, ".*") + "$")
	}
	c := callerOf(r)
	s.mu.Lock()
	now := s.now()
	var all []v1Event
	if a := s.accounts[c.account]; a != nil {
		for _, e := range a.v1Events {
			if readableV1(e, c.livemode, now) {
				all = append(all, e)
			}
		}
	}
	s.mu.Unlock()
	slices.Reverse(all)
	slices.SortStableFunc(all, func(x, y v1Event) int { return y.Created.Compare(x.Created) })
	page, more, e := paginate(all, func(e v1Event) string { return e.ID },
		func(e v1Event) bool { return m.keeps(e.Type) && created.keeps(e.Created) }, lp, "event")
	if e != nil {
		writeError(w, e)
		return
	}
	out := make([]snapshotEventJSON, len(page))
	for i, ev := range page {
		out[i] = ev.json()
	}
	writeJSON(w, http.StatusOK, listEnvelope{Object: "list", Data: out, HasMore: more, URL: v1EventsPath})
}

// getV1Event is GET /v1/events/{id}: one v1 event of the account, of the
// key's mode, from the last 30 days.
func (s *Server) getV1Event(w http.ResponseWriter, r *http.Request) {
	if e := checkParams(r.Form); e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	var found *v1Event
	if a := s.accounts[c.account]; a != nil {
		now := s.now()
		for i := range a.v1Events {
			if e := a.v1Events[i]; e.ID == id && readableV1(e, c.livemode, now) {
				found = &e
			}
		}
	}
	s.mu.Unlock()
	if found == nil {
		writeError(w, errNoSuch(http.StatusNotFound, "event", "id", id))
		return
	}
	writeJSON(w, http.StatusOK, found.json())
}
