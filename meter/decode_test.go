package meter

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var decodeNow = time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)

func TestDecodeValid(t *testing.T) {
	t.Parallel()
	evs, err := Decode(strings.NewReader(`{"events":[
		{"id":"e-1","tenant":"acme","feature":"api_calls","value":5,"timestamp":"2026-11-30T10:00:00.1234567Z"},
		{"id":"~ printable !","tenant":"acme.eu","feature":"seats:pro","value":-9223372036854775808},
		{"id":"x","tenant":"t","feature":"f","value":0,"timestamp":null}
	]}`), decodeNow)
	require.NoError(t, err)
	require.Len(t, evs, 3)
	require.Equal(t, "e-1", evs[0].ID)
	require.Equal(t, int64(5), evs[0].Value)
	require.Equal(t, time.Date(2026, 11, 30, 10, 0, 0, 123456000, time.UTC), *evs[0].Timestamp, "microsecond precision, UTC")
	require.Nil(t, evs[1].Timestamp, "omitted: now")
	require.Equal(t, int64(-9223372036854775808), evs[1].Value)
	require.Nil(t, evs[2].Timestamp)
}

func TestDecodeProblems(t *testing.T) {
	t.Parallel()
	ok := `"id":"a","tenant":"t","feature":"f","value":1`
	cases := []struct {
		name, event, field string
	}{
		{"missing id", `"tenant":"t","feature":"f","value":1`, "id"},
		{"missing tenant", `"id":"a","feature":"f","value":1`, "tenant"},
		{"missing feature", `"id":"a","tenant":"t","value":1`, "feature"},
		{"missing value", `"id":"a","tenant":"t","feature":"f"`, "value"},
		{"unknown field", ok + `,"unit":"ms"`, "unit"},
		{"empty id", `"id":"","tenant":"t","feature":"f","value":1`, "id"},
		{"long id", `"id":"` + strings.Repeat("a", 129) + `","tenant":"t","feature":"f","value":1`, "id"},
		{"non-ascii id", `"id":"é","tenant":"t","feature":"f","value":1`, "id"},
		{"control in id", `"id":"a\u0001","tenant":"t","feature":"f","value":1`, "id"},
		{"id not a string", `"id":7,"tenant":"t","feature":"f","value":1`, "id"},
		{"bad tenant", `"id":"a","tenant":"a b","feature":"f","value":1`, "tenant"},
		{"tenant with separator", `"id":"a","tenant":"a|b","feature":"f","value":1`, "tenant"},
		{"bad feature", `"id":"a","tenant":"t","feature":"-f","value":1`, "feature"},
		{"value string", `"id":"a","tenant":"t","feature":"f","value":"1"`, "value"},
		{"value fraction", `"id":"a","tenant":"t","feature":"f","value":1.5`, "value"},
		{"value exponent", `"id":"a","tenant":"t","feature":"f","value":1e3`, "value"},
		{"value overflow", `"id":"a","tenant":"t","feature":"f","value":9223372036854775808`, "value"},
		{"value null", `"id":"a","tenant":"t","feature":"f","value":null`, "value"},
		{"timestamp not rfc3339", ok + `,"timestamp":"2026-11-30 10:00"`, "timestamp"},
		{"timestamp number", ok + `,"timestamp":1796000000`, "timestamp"},
		{"timestamp far ahead", ok + `,"timestamp":"2026-12-02T12:00:00Z"`, "timestamp"},
		{"timestamp ancient", ok + `,"timestamp":"1999-12-31T23:59:59Z"`, "timestamp"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			body := `{"events":[{` + ok + `},{` + tc.event + `}]}`
			_, err := Decode(strings.NewReader(body), decodeNow)
			var ie *InvalidBatchError
			require.ErrorAs(t, err, &ie)
			require.Len(t, ie.Problems, 1, "%+v", ie.Problems)
			require.Equal(t, "meter: 1 problem in the batch: "+tc.field+": "+ie.Problems[0].Reason, ie.Error())
			require.Equal(t, 1, *ie.Problems[0].Index)
			require.Equal(t, tc.field, ie.Problems[0].Field)
			require.NotEmpty(t, ie.Problems[0].Reason)
		})
	}

	// Every problem of every event, in order.
	_, err := Decode(strings.NewReader(`{"events":[{"id":"","value":1.5},{"id":"ok","tenant":"t","feature":"f","value":1,"x":1}]}`), decodeNow)
	var ie *InvalidBatchError
	require.ErrorAs(t, err, &ie)
	var got []string
	for _, p := range ie.Problems {
		got = append(got, fmt.Sprintf("%d/%s", *p.Index, p.Field))
	}
	require.Equal(t, []string{"0/feature", "0/id", "0/tenant", "0/value", "1/x"}, got)
	require.Contains(t, ie.Error(), "meter: 5 problems in the batch, the first: feature: ")
}

func TestDecodeBatchShape(t *testing.T) {
	t.Parallel()
	for _, body := range []string{``, `[]`, `"x"`, `{"events":[]}x`, `{`, `{"events":[{}]} {}`, `null`} {
		_, err := Decode(strings.NewReader(body), decodeNow)
		require.Error(t, err, body)
		var ie *InvalidBatchError
		require.True(t, errors.Is(err, ErrMalformed) || errors.As(err, &ie), "%q: %v", body, err)
	}
	cases := map[string]string{
		`{}`:                  "events",
		`{"events":null}`:     "events",
		`{"events":{}}`:       "events",
		`{"events":[]}`:       "events",
		`{"events":[],"x":1}`: "x",
	}
	for body, field := range cases {
		_, err := Decode(strings.NewReader(body), decodeNow)
		var ie *InvalidBatchError
		require.ErrorAs(t, err, &ie, body)
		require.Nil(t, ie.Problems[0].Index)
		require.Contains(t, []string{field, "events"}, ie.Problems[0].Field)
	}
}

// Field names match exactly: encoding/json alone would take "ID" for "id".
func TestDecodeExactFieldNames(t *testing.T) {
	t.Parallel()
	for _, body := range []string{
		`{"Events":[{"id":"a","tenant":"t","feature":"f","value":1}]}`,
		`{"events":[{"ID":"a","tenant":"t","feature":"f","value":1}]}`,
		`{"events":[{"id":"a","Tenant":"t","feature":"f","value":1}]}`,
		`{"events":[{"id":"a","tenant":"t","feature":"f","VALUE":1}]}`,
	} {
		_, err := Decode(strings.NewReader(body), decodeNow)
		var ie *InvalidBatchError
		require.ErrorAs(t, err, &ie, body)
	}
	// An escaped key is the same name once decoded: the analysis accepts it.
	evs, err := Decode(strings.NewReader(`{"events":[{"i\u0064":"a","tenant":"t","feature":"f","value":1}]}`), decodeNow)
	require.NoError(t, err)
	require.Equal(t, "a", evs[0].ID)
}

// A hostile batch costs no more than a valid one: at most MaxProblems.
func TestDecodeProblemsCapped(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	b.WriteString(`{"events":[{"id":"a","tenant":"t","feature":"f","value":1`)
	for i := 0; i < 50000; i++ {
		fmt.Fprintf(&b, `,"k%d":1`, i)
	}
	b.WriteString(`}`)
	for i := 0; i < 5000; i++ {
		b.WriteString(`,{}`)
	}
	b.WriteString(`]}`)
	_, err := Decode(strings.NewReader(b.String()), decodeNow)
	var ie *InvalidBatchError
	require.ErrorAs(t, err, &ie)
	require.Len(t, ie.Problems, MaxProblems)
}

// analyse is Decode once the body is read (io.ReadAll's allocations grow
// with the body's size, whatever it holds).
func analyse(body []byte) ([]Event, error) {
	if evs, ok := decodeFast(body, decodeNow, MaxEvents); ok {
		return evs, nil
	}
	return decodeSlow(body, decodeNow, MaxEvents)
}

// unknownKeys is a batch of one valid event and, at the top level (event
// false) or in the event, n unknown keys.
func unknownKeys(n int, inEvent bool) []byte {
	var keys bytes.Buffer
	for i := 0; i < n; i++ {
		fmt.Fprintf(&keys, `,"k%07d":1`, i)
	}
	if inEvent {
		return []byte(`{"events":[{"id":"a","tenant":"t","feature":"f","value":1` + keys.String() + `}]}`)
	}
	return []byte(`{"events":[{"id":"a","tenant":"t","feature":"f","value":1}]` + keys.String() + `}`)
}

// Unknown fields are bounded like every other problem: the first
// MaxUnknownFields by name, then one problem counting the rest, and the
// cost of the analysis does not grow with their number — the allocations
// of 200,000 unknown keys are those of 20, give or take the body's buffer.
// (testing.AllocsPerRun: not parallel.)
func TestDecodeUnknownFieldsBounded(t *testing.T) {
	for _, inEvent := range []bool{false, true} {
		name := map[bool]string{false: "batch", true: "event"}[inEvent]
		t.Run(name, func(t *testing.T) {
			body := unknownKeys(200_000, inEvent)
			require.Less(t, len(body), MaxBodyBytes)
			_, err := Decode(bytes.NewReader(body), decodeNow)
			var ie *InvalidBatchError
			require.ErrorAs(t, err, &ie)
			require.Len(t, ie.Problems, MaxUnknownFields+1, "%+v", ie.Problems[:min(len(ie.Problems), 12)])
			for i, p := range ie.Problems[:MaxUnknownFields] {
				require.Equal(t, fmt.Sprintf("k%07d", i), p.Field, "the first ones, by name")
				require.Equal(t, "unknown field", p.Reason)
			}
			last := ie.Problems[MaxUnknownFields]
			require.Empty(t, last.Field)
			require.Equal(t, fmt.Sprintf("and %d more unknown fields", 200_000-MaxUnknownFields), last.Reason)
			if inEvent {
				require.Equal(t, 0, *last.Index)
			} else {
				require.Nil(t, last.Index)
			}

			allocs := func(n int) float64 {
				body := unknownKeys(n, inEvent)
				return testing.AllocsPerRun(3, func() { _, _ = analyse(body) })
			}
			few, many := allocs(20), allocs(200_000)
			require.LessOrEqual(t, many, few+2, "20 unknown keys: %.0f allocations; 200,000: %.0f", few, many)
		})
	}
}

// A key is the field it names once its escapes are decoded, whatever its
// spelling; long or non-ASCII keys name no field and are reported whole
// (cut to a bounded length).
func TestDecodeKeysAsEncodingJSONReadsThem(t *testing.T) {
	t.Parallel()
	evs, err := Decode(strings.NewReader(`{"\u0065vents":[{"\u0069\u0064":"a","tenant":"t","feature":"f","value":1,"timest\u0061mp":null}]}`), decodeNow)
	require.NoError(t, err)
	require.Equal(t, "a", evs[0].ID)

	long := strings.Repeat("é", 100)
	_, err = Decode(strings.NewReader(`{"events":[{"id":"a","tenant":"t","feature":"f","value":1,"`+long+`":1,"\u00e9":2}]}`), decodeNow)
	var ie *InvalidBatchError
	require.ErrorAs(t, err, &ie)
	require.Len(t, ie.Problems, 2, "%+v", ie.Problems)
	require.Equal(t, "é", ie.Problems[0].Field)
	require.Equal(t, strings.Repeat("é", maxFieldName/2)+"…", ie.Problems[1].Field)
}

// An array longer than a batch may be is counted, not decoded: it costs no
// more allocations than a short one. (testing.AllocsPerRun: not parallel.)
func TestDecodeLongArrayCostsNoMore(t *testing.T) {
	array := func(n int) []byte {
		return []byte(`{"events":[` + strings.Repeat("1,", n) + `1]}`)
	}
	body := array(2_000_000)
	_, err := Decode(bytes.NewReader(body), decodeNow)
	require.ErrorIs(t, err, ErrTooLarge)
	shortBody := array(MaxEvents + 1)
	short := testing.AllocsPerRun(3, func() { _, _ = analyse(shortBody) })
	long := testing.AllocsPerRun(3, func() { _, _ = analyse(body) })
	require.LessOrEqual(t, long, short, "%d elements: %.0f allocations; 2,000,000: %.0f", MaxEvents+1, short, long)
}

// A Decoder with a lower MaxEvents refuses a longer batch as too large.
func TestDecoderMaxEvents(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	b.WriteString(`{"events":[`)
	for i := 0; i < 3; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"id":"%d","tenant":"t","feature":"f","value":1}`, i)
	}
	b.WriteString(`]}`)
	_, err := Decoder{MaxEvents: 2}.Decode(strings.NewReader(b.String()), decodeNow)
	require.ErrorIs(t, err, ErrTooLarge)
	evs, err := Decoder{MaxEvents: 3}.Decode(strings.NewReader(b.String()), decodeNow)
	require.NoError(t, err)
	require.Len(t, evs, 3)
	evs, err = Decoder{MaxEvents: MaxEvents + 1}.Decode(strings.NewReader(b.String()), decodeNow)
	require.NoError(t, err, "above the ceiling: the ceiling")
	require.Len(t, evs, 3)
}

func TestDecodeTooLarge(t *testing.T) {
	t.Parallel()
	var b bytes.Buffer
	b.WriteString(`{"events":[`)
	for i := 0; i <= MaxEvents; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"id":"%d","tenant":"t","feature":"f","value":1}`, i)
	}
	b.WriteString(`]}`)
	_, err := Decode(&b, decodeNow)
	require.ErrorIs(t, err, ErrTooLarge, "10,001 events")

	big := `{"events":[{"id":"a","tenant":"t","feature":"f","value":1,"pad":"` + strings.Repeat("x", MaxBodyBytes) + `"}]}`
	_, err = Decode(strings.NewReader(big), decodeNow)
	require.ErrorIs(t, err, ErrTooLarge, "over 5 MiB")
}

// FuzzDecode: whatever the body, Decode returns events or an error of the
// documented kinds, never panics, and every event it returns is valid.
func FuzzDecode(f *testing.F) {
	for _, seed := range []string{
		`{"events":[{"id":"a","tenant":"t","feature":"f","value":1}]}`,
		`{"events":[{"id":"a","tenant":"t","feature":"f","value":-5,"timestamp":"2026-11-30T10:00:00Z"}]}`,
		`{"events":[{"id":"a","tenant":"t","feature":"f","value":1.0}]}`,
		`{"events":[{"id":"a","tenant":"t","feature":"f","value":1,"timestamp":null,"x":[]}]}`,
		`{"events":{}}`, `[]`, `{"events":[1,"x",null]}`, `{"events":[{"id":"\u0000"}]}`,
		`{"Events":[{"ID":"a","TENANT":"t","feature":"f","value":1}]}`,
		`{"events":[{"id":"a","id":"b","tenant":"t","feature":"f","value":1}]}`,
		`{"events":[{"i\u0064":"a","tenant":"t","feature":"f","value":1}]}`,
		`{"\u0065vents":[{"id":"a","tenant":"t","feature":"f","value":1,"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8,"i":9,"j":10,"k":11}],"x":{"y":[1,"]"]}}`,
		`{"events":[1,[2],{"id":"\"}"}],"\ud800":true}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		evs, err := Decode(bytes.NewReader(body), decodeNow)
		// The fast path and the field-by-field analysis agree.
		if fast, ok := decodeFast(body, decodeNow, MaxEvents); ok {
			slow, serr := decodeSlow(body, decodeNow, MaxEvents)
			if serr != nil {
				t.Fatalf("the fast path accepted what the analysis refuses: %v", serr)
			}
			if len(slow) != len(fast) {
				t.Fatalf("fast %d events, slow %d", len(fast), len(slow))
			}
			for i := range fast {
				if fast[i].ID != slow[i].ID || fast[i].Tenant != slow[i].Tenant || fast[i].Feature != slow[i].Feature ||
					fast[i].Value != slow[i].Value || (fast[i].Timestamp == nil) != (slow[i].Timestamp == nil) ||
					(fast[i].Timestamp != nil && !fast[i].Timestamp.Equal(*slow[i].Timestamp)) {
					t.Fatalf("event %d: fast %+v, slow %+v", i, fast[i], slow[i])
				}
			}
		}
		if err != nil {
			var ie *InvalidBatchError
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrTooLarge) && !errors.As(err, &ie) {
				t.Fatalf("unexpected error kind: %v", err)
			}
			if ie != nil && len(ie.Problems) == 0 {
				t.Fatal("an invalid batch without problems")
			}
			return
		}
		if len(evs) == 0 || len(evs) > MaxEvents {
			t.Fatalf("%d events", len(evs))
		}
		for _, ev := range evs {
			if !validEventID(ev.ID) || !tokenPattern.MatchString(ev.Tenant) || !tokenPattern.MatchString(ev.Feature) {
				t.Fatalf("invalid event passed: %+v", ev)
			}
			if ev.Timestamp != nil && (ev.Timestamp.After(decodeNow.Add(MaxFuture)) || ev.Timestamp.Year() < 2000 ||
				ev.Timestamp.Location() != time.UTC || ev.Timestamp.Nanosecond()%1000 != 0) {
				t.Fatalf("bad timestamp passed: %v", ev.Timestamp)
			}
		}
	})
}

func BenchmarkDecode(b *testing.B) {
	var buf bytes.Buffer
	buf.WriteString(`{"events":[`)
	for i := 0; i < 1000; i++ {
		if i > 0 {
			buf.WriteByte(',')
		}
		fmt.Fprintf(&buf, `{"id":"evt-%d","tenant":"acme","feature":"api_calls","value":%d,"timestamp":"2026-11-30T10:%02d:00Z"}`, i, i, i%60)
	}
	buf.WriteString(`]}`)
	body := buf.Bytes()
	b.Run("fast", func(b *testing.B) {
		for b.Loop() {
			if _, err := Decode(bytes.NewReader(body), decodeNow); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*1000), "ns/event")
	})
	b.Run("field-by-field", func(b *testing.B) {
		for b.Loop() {
			if _, err := decodeSlow(body, decodeNow, MaxEvents); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*1000), "ns/event")
	})
}
