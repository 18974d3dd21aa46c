package client

import (
	"encoding/json"
	"time"
)

// Event is one usage event, as POST /v1/usage takes it. Tally validates it:
// docs/usage.md has the rules.
type Event struct {
	// ID is the caller's id of the event, unique per tenant: 1 to 128
	// printable ASCII characters. Posting an id again with the same content
	// is a duplicate (stored once); with other content it is refused.
	ID string
	// Tenant is whose usage it is: 1 to 64 letters, digits and _.:-.
	Tenant string
	// Feature names what was used: 1 to 64 letters, digits and _.:-.
	Feature string
	// Value is whole units; negative is a correction, which needs a token
	// allowed to post corrections.
	Value int64
	// Timestamp is when the usage happened; Tally keeps microseconds. The
	// zero value sends none (Tally then takes its database's clock at the
	// insert) from Post, and is set to the time of the Add by Add.
	Timestamp time.Time
}

// wireEvent is an event as the request body carries it.
type wireEvent struct {
	ID        string `json:"id"`
	Tenant    string `json:"tenant"`
	Feature   string `json:"feature"`
	Value     int64  `json:"value"`
	Timestamp string `json:"timestamp,omitempty"`
}

// encode is the event's JSON in a request body. The same event always
// encodes to the same bytes.
func (e Event) encode() ([]byte, error) {
	w := wireEvent{ID: e.ID, Tenant: e.Tenant, Feature: e.Feature, Value: e.Value}
	if !e.Timestamp.IsZero() {
		w.Timestamp = e.Timestamp.UTC().Format(time.RFC3339Nano)
	}
	return json.Marshal(w)
}

// stampNow gives an event without a timestamp the time now, to the
// microsecond Tally keeps.
func (e Event) stampNow(now time.Time) Event {
	if e.Timestamp.IsZero() {
		e.Timestamp = now.UTC().Truncate(time.Microsecond)
	}
	return e
}

// Result is what Tally answered for the events posted.
type Result struct {
	// Accepted counts the events stored by this call.
	Accepted int `json:"accepted"`
	// Duplicates counts the events stored before with the same content
	// (or repeated within the call): not stored again. An event an attempt
	// stored whose reply was lost counts here once its retry is answered.
	Duplicates int `json:"duplicates"`
	// Unmapped counts the accepted events whose feature or tenant has no
	// mapping in Tally yet: stored, and quarantined until one is made.
	Unmapped int `json:"unmapped"`
}

func (r *Result) add(o Result) {
	r.Accepted += o.Accepted
	r.Duplicates += o.Duplicates
	r.Unmapped += o.Unmapped
}

// Request body framing: {"events":[e1,e2,…]}.
var (
	bodyOpen  = []byte(`{"events":[`)
	bodyClose = []byte(`]}`)
)

// bodySize is the size of a request body holding n events of total
// encoded size eventBytes.
func bodySize(n, eventBytes int) int {
	if n == 0 {
		return len(bodyOpen) + len(bodyClose)
	}
	return len(bodyOpen) + eventBytes + n - 1 + len(bodyClose)
}

// body frames encoded events as a request body.
func body(events [][]byte) []byte {
	size := 0
	for _, e := range events {
		size += len(e)
	}
	b := make([]byte, 0, bodySize(len(events), size))
	b = append(b, bodyOpen...)
	for i, e := range events {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, e...)
	}
	return append(b, bodyClose...)
}
