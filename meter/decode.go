package meter

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"sort"
	"strconv"
	"time"
)

// Limits of one POST /v1/usage.
const (
	// MaxEvents is the most events one batch may carry.
	MaxEvents = 10_000
	// MaxBodyBytes is the largest request body accepted.
	MaxBodyBytes = 5 << 20
	// MaxFuture is how far ahead of the server's clock a timestamp may be;
	// its window would not close before then anyway, and further is a bug.
	MaxFuture = 24 * time.Hour
)

// Event is one validated usage event.
type Event struct {
	// ID is the client's id, unique per tenant: 1 to 128 printable ASCII
	// characters.
	ID     string
	Tenant string
	// Feature names the usage's feature.
	Feature string
	// Value is whole units; negative is a correction.
	Value int64
	// Timestamp is when the usage happened (microsecond precision); nil means
	// "now", as the database's clock reads at the insert.
	Timestamp *time.Time
}

// Problem is one thing wrong with a batch: the index of the event (nil for
// the batch as a whole), the field, and why.
type Problem struct {
	Index  *int   `json:"index"`
	Field  string `json:"field"`
	Reason string `json:"reason"`
}

// InvalidBatchError lists every problem found; nothing of the batch is
// stored.
type InvalidBatchError struct {
	Problems []Problem
}

func (e *InvalidBatchError) Error() string {
	return fmt.Sprintf("meter: %d problems in the batch, the first: %s: %s", len(e.Problems), e.Problems[0].Field, e.Problems[0].Reason)
}

// ErrTooLarge says the batch is over MaxEvents events or MaxBodyBytes.
var ErrTooLarge = errors.New("meter: batch too large")

// MaxProblems is the most problems one answer reports; the analysis stops
// there, so that a hostile batch costs no more than a valid one.
const MaxProblems = 100

// ErrMalformed says the body is not the JSON object a batch is.
var ErrMalformed = errors.New("meter: the body is not a JSON object of the form {\"events\":[…]}")

var tokenPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$`)

// integerLiteral is a JSON number with no fraction and no exponent.
var integerLiteral = regexp.MustCompile(`^-?(0|[1-9][0-9]*)$`)

const tokenReason = "1 to 64 characters: letters, digits and _.:- (starting with a letter or digit)"

// Decode reads and validates a batch: {"events":[{"id","tenant","feature",
// "value","timestamp"}]}. Unknown fields are problems; a body over
// MaxBodyBytes or a batch over MaxEvents is ErrTooLarge; a body that is not a
// JSON object of that shape is ErrMalformed; otherwise the problems, in
// event order, at most MaxProblems of them, in an *InvalidBatchError. now bounds timestamps
// in the future (MaxFuture).
//
// A well-formed batch takes a fast path: one strict pass into typed structs.
// Anything that path does not accept goes through the field-by-field
// analysis, which finds every problem; both apply the same rules.
func Decode(r io.Reader, now time.Time) ([]Event, error) {
	body, err := io.ReadAll(io.LimitReader(r, MaxBodyBytes+1))
	if err != nil {
		return nil, fmt.Errorf("meter: reading the body: %w", err)
	}
	if len(body) > MaxBodyBytes {
		return nil, ErrTooLarge
	}
	if events, ok := decodeFast(body, now); ok {
		return events, nil
	}
	return decodeSlow(body, now)
}

// fastEvent is an event as the fast path reads it: every field typed,
// the value kept raw so that a quoted number is not taken for a number.
type fastEvent struct {
	ID        *string         `json:"id"`
	Tenant    *string         `json:"tenant"`
	Feature   *string         `json:"feature"`
	Value     json.RawMessage `json:"value"`
	Timestamp *string         `json:"timestamp"`
}

// decodeFast decodes a batch in one strict pass into typed structs; ok is
// false when the batch is not entirely valid, and then decodeSlow says why.
// encoding/json matches field names without regard to case, so the keys are
// checked to be exactly the batch's field names first.
func decodeFast(body []byte, now time.Time) ([]Event, bool) {
	if !exactKeys(body) {
		return nil, false
	}
	var batch struct {
		Events []fastEvent `json:"events"`
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&batch); err != nil || len(batch.Events) == 0 || len(batch.Events) > MaxEvents {
		return nil, false
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, false
	}
	events := make([]Event, len(batch.Events))
	for i, fe := range batch.Events {
		if fe.ID == nil || fe.Tenant == nil || fe.Feature == nil || fe.Value == nil ||
			!validEventID(*fe.ID) || !tokenPattern.MatchString(*fe.Tenant) || !tokenPattern.MatchString(*fe.Feature) ||
			!integerLiteral.Match(fe.Value) {
			return nil, false
		}
		v, err := strconv.ParseInt(string(fe.Value), 10, 64)
		if err != nil {
			return nil, false
		}
		ev := Event{ID: *fe.ID, Tenant: *fe.Tenant, Feature: *fe.Feature, Value: v}
		if fe.Timestamp != nil {
			t, ok := validTimestamp(*fe.Timestamp, now)
			if !ok {
				return nil, false
			}
			ev.Timestamp = &t
		}
		events[i] = ev
	}
	return events, true
}

// exactKeys reports whether every object key in body is spelled exactly as
// one of a batch's field names, without escapes. It scans the bytes once,
// without allocating; anything it does not recognise is left to the
// field-by-field analysis.
func exactKeys(body []byte) bool {
	for i := 0; i < len(body); i++ {
		if body[i] != '"' {
			continue
		}
		start := i + 1
		j := start
		for j < len(body) && body[j] != '"' {
			if body[j] == '\\' {
				j++ // skip the escaped byte
			}
			j++
		}
		if j >= len(body) {
			return false
		}
		k := j + 1
		for k < len(body) && (body[k] == ' ' || body[k] == '\t' || body[k] == '\n' || body[k] == '\r') {
			k++
		}
		if k < len(body) && body[k] == ':' {
			switch string(body[start:j]) {
			case "events", "id", "tenant", "feature", "value", "timestamp":
			default:
				return false
			}
		}
		i = j
	}
	return true
}

// validTimestamp parses an RFC 3339 timestamp to UTC microseconds and checks
// its bounds.
func validTimestamp(s string, now time.Time) (time.Time, bool) {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}, false
	}
	t = t.UTC().Truncate(time.Microsecond)
	return t, !t.After(now.Add(MaxFuture)) && t.Year() >= 2000
}

// decodeSlow analyses a batch field by field and reports every problem.
func decodeSlow(body []byte, now time.Time) ([]Event, error) {
	var top map[string]json.RawMessage
	if err := strictUnmarshal(body, &top); err != nil || top == nil {
		return nil, ErrMalformed
	}
	var problems []Problem
	raw, ok := top["events"]
	for k := range top {
		if k != "events" {
			problems = append(problems, Problem{Field: k, Reason: "unknown field"})
		}
	}
	var items []json.RawMessage
	if !ok {
		problems = append(problems, Problem{Field: "events", Reason: "required: an array of events"})
	} else if err := strictUnmarshal(raw, &items); err != nil || items == nil {
		problems = append(problems, Problem{Field: "events", Reason: "must be an array of events"})
	}
	if len(items) > MaxEvents {
		return nil, ErrTooLarge
	}
	if len(items) == 0 && ok && len(problems) == 0 {
		problems = append(problems, Problem{Field: "events", Reason: "must hold at least one event"})
	}
	events := make([]Event, 0, len(items))
	for i, item := range items {
		if len(problems) >= MaxProblems {
			break
		}
		ev, ps := decodeEvent(i, item, now)
		problems = append(problems, ps...)
		events = append(events, ev)
	}
	if len(problems) > 0 {
		sort.SliceStable(problems, func(a, b int) bool {
			ia, ib := -1, -1
			if problems[a].Index != nil {
				ia = *problems[a].Index
			}
			if problems[b].Index != nil {
				ib = *problems[b].Index
			}
			if ia != ib {
				return ia < ib
			}
			return problems[a].Field < problems[b].Field
		})
		if len(problems) > MaxProblems {
			problems = problems[:MaxProblems]
		}
		return nil, &InvalidBatchError{Problems: problems}
	}
	return events, nil
}

func strictUnmarshal(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return errors.New("trailing data")
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("trailing data")
	}
	return nil
}

func decodeEvent(i int, raw json.RawMessage, now time.Time) (Event, []Problem) {
	idx := i
	var (
		ev       Event
		problems []Problem
		fields   map[string]json.RawMessage
	)
	bad := func(field, reason string) {
		if len(problems) < MaxProblems {
			problems = append(problems, Problem{Index: &idx, Field: field, Reason: reason})
		}
	}
	if err := strictUnmarshal(raw, &fields); err != nil || fields == nil {
		bad("", "must be a JSON object")
		return ev, problems
	}
	str := func(name string, required bool) (string, bool) {
		v, ok := fields[name]
		if !ok {
			if required {
				bad(name, "required")
			}
			return "", false
		}
		var s string
		if err := json.Unmarshal(v, &s); err != nil {
			bad(name, "must be a string")
			return "", false
		}
		return s, true
	}
	for k := range fields {
		switch k {
		case "id", "tenant", "feature", "value", "timestamp":
		default:
			bad(k, "unknown field")
		}
	}
	if s, ok := str("id", true); ok {
		if !validEventID(s) {
			bad("id", "1 to 128 printable ASCII characters")
		}
		ev.ID = s
	}
	if s, ok := str("tenant", true); ok {
		if !tokenPattern.MatchString(s) {
			bad("tenant", tokenReason)
		}
		ev.Tenant = s
	}
	if s, ok := str("feature", true); ok {
		if !tokenPattern.MatchString(s) {
			bad("feature", tokenReason)
		}
		ev.Feature = s
	}
	if v, ok := fields["value"]; !ok {
		bad("value", "required")
	} else if !integerLiteral.Match(v) {
		bad("value", "must be a whole number (no fraction, no exponent, not a string)")
	} else if n, err := strconv.ParseInt(string(v), 10, 64); err != nil {
		bad("value", "must fit in a signed 64-bit integer")
	} else {
		ev.Value = n
	}
	if v, ok := fields["timestamp"]; ok && string(v) != "null" {
		var s string
		if err := json.Unmarshal(v, &s); err != nil {
			bad("timestamp", "must be an RFC 3339 string")
		} else if t, err := time.Parse(time.RFC3339Nano, s); err != nil {
			bad("timestamp", "must be RFC 3339, e.g. 2026-11-30T12:00:00Z")
		} else if t = t.UTC().Truncate(time.Microsecond); t.After(now.Add(MaxFuture)) {
			bad("timestamp", "more than 24 hours in the future")
		} else if t.Year() < 2000 {
			bad("timestamp", "before the year 2000")
		} else {
			ev.Timestamp = &t
		}
	}
	return ev, problems
}

func validEventID(s string) bool {
	if len(s) < 1 || len(s) > 128 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
