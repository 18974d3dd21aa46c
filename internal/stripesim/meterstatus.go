package stripesim

import (
	"context"
	"encoding/json"
	"slices"
	"time"

	"github.com/stripe/stripe-go/v82/webhook"
)

// Types of the v1 events Stripe sends when a meter is created or its
// status changes (stripe-go's EventTypeBillingMeter*).
const (
	EventMeterCreated     = "billing.meter.created"
	EventMeterDeactivated = "billing.meter.deactivated"
	EventMeterReactivated = "billing.meter.reactivated"
)

// MeterEvent is one v1 event about a meter, as an event destination with
// the snapshot payload style posts it: the meter as it was when the event
// happened.
type MeterEvent struct {
	ID       string // evt_…
	Type     string // one of the EventMeter* types
	Created  time.Time
	Livemode bool
	// Account is the connected account the event happened on; empty for
	// an account that is a key's own.
	Account string
	Meter   Meter
}

// snapshotEventJSON is a v1 event (object "event") with its data.object
// and, for an update, data.previous_attributes.
type snapshotEventJSON struct {
	ID         string  `json:"id"`
	Object     string  `json:"object"`
	Account    *string `json:"account,omitempty"`
	APIVersion string  `json:"api_version"`
	Created    int64   `json:"created"`
	Data       struct {
		Object             json.RawMessage `json:"object"`
		PreviousAttributes json.RawMessage `json:"previous_attributes,omitempty"`
	} `json:"data"`
	Livemode        bool             `json:"livemode"`
	PendingWebhooks int              `json:"pending_webhooks"`
	Request         eventRequestJSON `json:"request"`
	Type            string           `json:"type"`
}

// apiVersion is the version the simulator renders snapshot events in:
// stripe-go v82's.
const apiVersion = "2025-08-27.basil"

// billingEvent is e in the form of every v1 event.
func (e MeterEvent) billingEvent() BillingEvent {
	return BillingEvent{ID: e.ID, Type: e.Type, Created: e.Created, Livemode: e.Livemode, Account: e.Account,
		Object: snapshot(e.Meter.json())}
}

func snapshotOf(e MeterEvent) snapshotEventJSON { return e.billingEvent().json() }

// meterEventLocked records an event of type typ about m, in account a, at
// the simulator's now. s.mu must be held.
func (s *Server) meterEventLocked(a *account, typ string, m *Meter) {
	e := MeterEvent{ID: newEventID(m.Livemode), Type: typ, Created: s.now(), Livemode: m.Livemode, Meter: *m}
	if !s.ownAccountLocked(a.id) {
		e.Account = a.id
	}
	a.meterEvents = append(a.meterEvents, e)
	a.v1Events = append(a.v1Events, v1Event{BillingEvent: e.billingEvent(), meter: true})
}

// ownAccountLocked reports whether id is the own account of one of the
// simulator's keys (not reached through Stripe-Account). s.mu must be
// held.
func (s *Server) ownAccountLocked(id string) bool {
	for _, own := range s.keys {
		if own == id {
			return true
		}
	}
	return false
}

// MeterEvents returns the meter events of account, both modes, oldest
// first.
func (s *Server) MeterEvents(account string) []MeterEvent {
	s.mu.Lock()
	defer s.mu.Unlock()
	if a := s.accounts[account]; a != nil {
		return slices.Clone(a.meterEvents)
	}
	return nil
}

// SignedSnapshotEvent is the body and Stripe-Signature header of the
// snapshot event e, signed with secret at t, as an event destination with
// the snapshot payload style would post it.
func SignedSnapshotEvent(e MeterEvent, secret string, t time.Time) (body []byte, signature string) {
	b, _ := json.Marshal(snapshotOf(e))
	p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: b, Secret: secret, Timestamp: t})
	return p.Payload, p.Header
}

// DeliverMeterEvents posts every meter event of account not delivered yet
// to url as a signed snapshot event, and marks those answered 2xx
// delivered. It returns how many were delivered; the first answer that is
// not 2xx stops it with an error.
func (s *Server) DeliverMeterEvents(ctx context.Context, account, url, secret string) (int, error) {
	s.mu.Lock()
	a := s.accounts[account]
	var pending []MeterEvent
	if a != nil {
		for _, e := range a.meterEvents {
			if !a.delivered[e.ID] {
				pending = append(pending, e)
			}
		}
	}
	s.mu.Unlock()
	n := 0
	for _, e := range pending {
		body, sig := SignedSnapshotEvent(e, secret, time.Now())
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
