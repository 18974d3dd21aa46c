package meter

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func ts(s string) time.Time {
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		panic(err)
	}
	return t
}

func TestPeriodStartKnownAnswers(t *testing.T) {
	t.Parallel()
	cases := []struct{ at, anchor, start, end string }{
		{"2026-11-15T10:00:00Z", "1970-01-01T00:00:00Z", "2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z"},
		{"2026-11-01T00:00:00Z", "1970-01-01T00:00:00Z", "2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z"},
		{"2026-10-31T23:59:59Z", "1970-01-01T00:00:00Z", "2026-10-01T00:00:00Z", "2026-11-01T00:00:00Z"},
		{"2026-12-31T23:00:00Z", "1970-01-01T00:00:00Z", "2026-12-01T00:00:00Z", "2027-01-01T00:00:00Z"},
		// An anchor on the 31st clamps to the end of shorter months.
		{"2026-02-28T09:00:00Z", "2026-01-31T10:00:00Z", "2026-01-31T10:00:00Z", "2026-02-28T10:00:00Z"},
		{"2026-02-28T11:00:00Z", "2026-01-31T10:00:00Z", "2026-02-28T10:00:00Z", "2026-03-31T10:00:00Z"},
		{"2028-02-29T12:00:00Z", "2026-01-31T10:00:00Z", "2028-02-29T10:00:00Z", "2028-03-31T10:00:00Z"},
		// Mid-month anchors, and times before the anchor.
		{"2026-11-15T10:00:00Z", "2025-03-15T12:30:00Z", "2026-10-15T12:30:00Z", "2026-11-15T12:30:00Z"},
		{"2025-01-01T00:00:00Z", "2025-03-15T12:30:00Z", "2024-12-15T12:30:00Z", "2025-01-15T12:30:00Z"},
	}
	for _, c := range cases {
		require.Equal(t, ts(c.start), PeriodStart(ts(c.at), ts(c.anchor)), "%s anchored %s", c.at, c.anchor)
		require.Equal(t, ts(c.end), PeriodEnd(ts(c.at), ts(c.anchor)), "%s anchored %s", c.at, c.anchor)
	}
}

func TestWindowOf(t *testing.T) {
	t.Parallel()
	cal := CalendarAnchor
	cases := []struct {
		at     string
		width  time.Duration
		anchor time.Time
		want   Window
	}{
		{"2026-11-30T10:17:00Z", time.Hour, cal, Window{ts("2026-11-01T00:00:00Z"), ts("2026-11-30T10:00:00Z"), ts("2026-11-30T11:00:00Z")}},
		{"2026-11-30T23:59:59Z", 24 * time.Hour, cal, Window{ts("2026-11-01T00:00:00Z"), ts("2026-11-30T00:00:00Z"), ts("2026-12-01T00:00:00Z")}},
		{"2026-11-30T10:17:00Z", 15 * time.Minute, cal, Window{ts("2026-11-01T00:00:00Z"), ts("2026-11-30T10:15:00Z"), ts("2026-11-30T10:30:00Z")}},
		// A period starting at 12:30 cuts the 12:00-13:00 window in two.
		{"2026-11-15T12:10:00Z", time.Hour, ts("2025-03-15T12:30:00Z"), Window{ts("2026-10-15T12:30:00Z"), ts("2026-11-15T12:00:00Z"), ts("2026-11-15T12:30:00Z")}},
		{"2026-11-15T12:40:00Z", time.Hour, ts("2025-03-15T12:30:00Z"), Window{ts("2026-11-15T12:30:00Z"), ts("2026-11-15T12:30:00Z"), ts("2026-11-15T13:00:00Z")}},
		// Before the grid origin.
		{"1999-12-31T23:30:00Z", time.Hour, cal, Window{ts("1999-12-01T00:00:00Z"), ts("1999-12-31T23:00:00Z"), ts("2000-01-01T00:00:00Z")}},
	}
	for _, c := range cases {
		require.Equal(t, c.want, WindowOf(ts(c.at), c.width, c.anchor), "%s width %s", c.at, c.width)
	}
	split := windowsOfBucket(ts("2026-11-15T12:00:00Z"), time.Hour, ts("2025-03-15T12:30:00Z"))
	require.Equal(t, []Window{
		{ts("2026-10-15T12:30:00Z"), ts("2026-11-15T12:00:00Z"), ts("2026-11-15T12:30:00Z")},
		{ts("2026-11-15T12:30:00Z"), ts("2026-11-15T12:30:00Z"), ts("2026-11-15T13:00:00Z")},
	}, split)
	require.Len(t, windowsOfBucket(ts("2026-11-15T12:00:00Z"), time.Hour, cal), 1)
}

// Every instant lies in exactly one window, inside its period, and windows
// of a grid never overlap.
func TestWindowOfProperties(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	widths := []time.Duration{time.Minute, 15 * time.Minute, time.Hour, 6 * time.Hour, 24 * time.Hour}
	for i := 0; i < 20000; i++ {
		at := time.Unix(946684800+rng.Int64N(1_000_000_000), rng.Int64N(1e9)).UTC()
		anchor := time.Unix(rng.Int64N(2_000_000_000), 0).UTC()
		if i%3 == 0 {
			anchor = CalendarAnchor
		}
		w := WindowOf(at, widths[rng.IntN(len(widths))], anchor)
		require.False(t, at.Before(w.From), "%s before %v", at, w)
		require.True(t, at.Before(w.To), "%s not before %v", at, w)
		require.False(t, w.From.Before(w.PeriodStart))
		require.False(t, w.To.After(PeriodEnd(at, anchor)))
		require.Equal(t, w.PeriodStart, PeriodStart(at, anchor))
	}
}

func TestSubjectRefs(t *testing.T) {
	t.Parallel()
	w := Window{ts("2026-11-01T00:00:00Z"), ts("2026-11-30T10:00:00Z"), ts("2026-11-30T11:00:00Z")}
	require.Equal(t, "usage:api_calls:2026-11-01T00:00:00Z:2026-11-30T10:00:00Z:2026-11-30T11:00:00Z", w.SubjectRef("api_calls", 0))
	require.Equal(t, "usage:api_calls:2026-11-01T00:00:00Z:2026-11-30T10:00:00Z:2026-11-30T11:00:00Z#2", w.SubjectRef("api_calls", 2))
	require.Equal(t, "event:seats:evt 1", EventSubjectRef("seats", "evt 1"))
	require.Equal(t, "event:seats:a%7Cb%25c", EventSubjectRef("seats", "a|b%c"))
	require.NotEqual(t, EventSubjectRef("f", "a|b"), EventSubjectRef("f", "a%7Cb"))
	require.Equal(t, "event:a%3Ab:c", EventSubjectRef("a:b", "c"))
	require.NotEqual(t, EventSubjectRef("a:b", "c"), EventSubjectRef("a", "b:c"), "features may hold a colon too")
}
