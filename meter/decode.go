package meter

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/tallymeter/tally/internal/errcode"
)

// Limits of one POST /v1/usage.
const (
	// MaxEvents is the most events one batch may carry: the default of
	// Decoder.MaxEvents (TALLY_INGEST_MAX_EVENTS), and its ceiling.
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
	if len(e.Problems) == 1 {
		return fmt.Sprintf("meter: 1 problem in the batch: %s: %s", e.Problems[0].Field, e.Problems[0].Reason)
	}
	return fmt.Sprintf("meter: %d problems in the batch, the first: %s: %s", len(e.Problems), e.Problems[0].Field, e.Problems[0].Reason)
}

// ErrTooLarge says the batch is over its most events (Decoder.MaxEvents)
// or MaxBodyBytes.
var ErrTooLarge = errors.New("meter: batch too large")

// MaxProblems is the most problems one answer reports; the analysis stops
// there, so that a hostile batch costs no more than a valid one.
const MaxProblems = 100

// MaxUnknownFields is the most unknown fields of one object (the batch, or
// one event) the problems name; the others are counted in one more problem
// ("and N more unknown fields"), never collected.
const MaxUnknownFields = 10

// maxFieldName bounds the name of an unknown field as a problem repeats it.
const maxFieldName = 64

// ErrMalformed says the body is not the JSON object a batch is.
var ErrMalformed = errcode.New(errcode.Invalid, "invalid_json", "meter: the body is not a JSON object of the form {\"events\":[…]}")

var tokenPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$`)

// integerLiteral is a JSON number with no fraction and no exponent.
var integerLiteral = regexp.MustCompile(`^-?(0|[1-9][0-9]*)$`)

const tokenReason = "1 to 64 characters: letters, digits and _.:- (starting with a letter or digit)"

// Decoder reads batches of at most MaxEvents events.
type Decoder struct {
	// MaxEvents is the most events a batch may carry
	// (TALLY_INGEST_MAX_EVENTS), 1 to the package's MaxEvents. Defaults to
	// MaxEvents.
	MaxEvents int
}

func (d Decoder) maxEvents() int {
	if d.MaxEvents <= 0 || d.MaxEvents > MaxEvents {
		return MaxEvents
	}
	return d.MaxEvents
}

// Decode is Decoder{}.Decode: a batch of at most MaxEvents events.
func Decode(r io.Reader, now time.Time) ([]Event, error) { return Decoder{}.Decode(r, now) }

// Decode reads and validates a batch: {"events":[{"id","tenant","feature",
// "value","timestamp"}]}. Unknown fields are problems; a body over
// MaxBodyBytes or a batch over d.MaxEvents is ErrTooLarge; a body that is
// not a JSON object of that shape is ErrMalformed; otherwise the problems,
// in event order, at most MaxProblems of them (and at most
// MaxUnknownFields unknown fields of one object, the rest counted), in an
// *InvalidBatchError. now bounds timestamps in the future (MaxFuture).
//
// A well-formed batch takes a fast path: one strict pass into typed structs.
// Anything that path does not accept goes through the field-by-field
// analysis, which finds every problem; both apply the same rules.
func (d Decoder) Decode(r io.Reader, now time.Time) ([]Event, error) {
	body, err := io.ReadAll(io.LimitReader(r, MaxBodyBytes+1))
	if err != nil {
		return nil, fmt.Errorf("meter: reading the body: %w", err)
	}
	if len(body) > MaxBodyBytes {
		return nil, ErrTooLarge
	}
	if events, ok := decodeFast(body, now, d.maxEvents()); ok {
		return events, nil
	}
	return decodeSlow(body, now, d.maxEvents())
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
func decodeFast(body []byte, now time.Time, maxEvents int) ([]Event, bool) {
	if !exactKeys(body, maxEvents) {
		return nil, false
	}
	var batch struct {
		Events []fastEvent `json:"events"`
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&batch); err != nil || len(batch.Events) == 0 || len(batch.Events) > maxEvents {
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
// one of a batch's field names, without escapes, and whether body has no
// more commas than a batch of maxEvents events of five fields (so that the
// typed pass never allocates for an array longer than a batch may be). It
// scans the bytes once, without allocating; anything it does not recognise
// is left to the field-by-field analysis.
func exactKeys(body []byte, maxEvents int) bool {
	commas := 0
	for i := 0; i < len(body); i++ {
		if body[i] != '"' {
			if body[i] == ',' {
				if commas++; commas > 5*maxEvents {
					return false
				}
			}
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

// decodeSlow analyses a batch field by field and reports every problem. It
// walks the body itself once json.Valid has said it is one JSON value: an
// object's keys are never gathered into a map, and the unknown ones past
// MaxUnknownFields are only counted, so an object of a million unknown keys
// costs a scan, not a million allocations; an events array longer than
// maxEvents is counted, not decoded.
func decodeSlow(body []byte, now time.Time, maxEvents int) ([]Event, error) {
	start := skipSpace(body, 0)
	if start == len(body) || body[start] != '{' || !json.Valid(body) {
		return nil, ErrMalformed
	}
	var (
		raw     []byte
		found   bool
		unknown unknownFields
	)
	members(body[start:], func(key, value []byte) {
		if _, ok := fieldNamed(key, "events"); ok {
			raw, found = value, true // the last of repeated keys, as encoding/json takes it
			return
		}
		unknown.add(key)
	})
	problems := unknown.problems(nil)
	n := 0
	switch {
	case !found:
		problems = append(problems, Problem{Field: "events", Reason: "required: an array of events"})
	case raw[0] != '[':
		problems = append(problems, Problem{Field: "events", Reason: "must be an array of events"})
	default:
		elements(raw, func([]byte) bool {
			n++
			return n <= maxEvents
		})
	}
	if n > maxEvents {
		return nil, ErrTooLarge
	}
	if n == 0 && found && len(problems) == 0 {
		problems = append(problems, Problem{Field: "events", Reason: "must hold at least one event"})
	}
	events := make([]Event, 0, n)
	if n > 0 {
		i := 0
		elements(raw, func(item []byte) bool {
			if len(problems) >= MaxProblems {
				return false
			}
			ev, ps := decodeEvent(i, item, now)
			problems = append(problems, ps...)
			events = append(events, ev)
			i++
			return true
		})
	}
	if len(problems) > 0 {
		slices.SortStableFunc(problems, compareProblems)
		if len(problems) > MaxProblems {
			problems = problems[:MaxProblems]
		}
		return nil, &InvalidBatchError{Problems: problems}
	}
	return events, nil
}

// compareProblems orders problems by event (the batch's own first), then by
// field, with those of an object as a whole ("and N more unknown fields")
// after its fields'.
func compareProblems(a, b Problem) int {
	ia, ib := -1, -1
	if a.Index != nil {
		ia = *a.Index
	}
	if b.Index != nil {
		ib = *b.Index
	}
	switch {
	case ia != ib:
		return ia - ib
	case a.Field == b.Field:
		return 0
	case a.Field == "":
		return 1
	case b.Field == "":
		return -1
	case a.Field < b.Field:
		return -1
	default:
		return 1
	}
}

// unknownFields are an object's unknown fields: the names of the first
// MaxUnknownFields (each at most maxFieldName bytes), and how many more
// there were.
type unknownFields struct {
	names []string
	more  int
}

// add takes an unknown key as written, quotes included.
func (u *unknownFields) add(quoted []byte) {
	if len(u.names) == MaxUnknownFields {
		u.more++
		return
	}
	var name string
	if err := json.Unmarshal(quoted, &name); err != nil {
		name = "?"
	}
	if len(name) > maxFieldName {
		cut := maxFieldName
		for cut > 0 && !utf8.RuneStart(name[cut]) {
			cut--
		}
		name = name[:cut] + "…"
	}
	if !slices.Contains(u.names, name) {
		u.names = append(u.names, name)
	}
}

// problems are one problem per named unknown field, in name order, and one
// for the rest.
func (u *unknownFields) problems(index *int) []Problem {
	slices.Sort(u.names)
	var ps []Problem
	for _, name := range u.names {
		ps = append(ps, Problem{Index: index, Field: name, Reason: "unknown field"})
	}
	if u.more > 0 {
		ps = append(ps, Problem{Index: index, Reason: fmt.Sprintf("and %d more unknown fields", u.more)})
	}
	return ps
}

// eventFields are the fields of an event.
var eventFields = []string{"id", "tenant", "feature", "value", "timestamp"}

func decodeEvent(i int, raw []byte, now time.Time) (Event, []Problem) {
	idx := i
	var (
		ev       Event
		problems []Problem
		unknown  unknownFields
	)
	bad := func(field, reason string) {
		if len(problems) < MaxProblems {
			problems = append(problems, Problem{Index: &idx, Field: field, Reason: reason})
		}
	}
	if raw[0] != '{' {
		bad("", "must be a JSON object")
		return ev, problems
	}
	fields := make(map[string][]byte, len(eventFields))
	members(raw, func(key, value []byte) {
		if name, ok := fieldNamed(key, eventFields...); ok {
			fields[name] = value
			return
		}
		unknown.add(key)
	})
	problems = unknown.problems(&idx)
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
