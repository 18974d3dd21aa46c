package meter

import (
	"fmt"
	"strings"
	"time"
)

// CalendarAnchor anchors calendar-month billing periods (UTC).
var CalendarAnchor = time.Date(1970, 1, 1, 0, 0, 0, 0, time.UTC)

// gridOrigin is where window grids start; the database's date_bin uses the
// same origin. Any width that divides a day puts window bounds on UTC hours
// and midnights.
var gridOrigin = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// addMonths adds n months to t (UTC), clamping the day to the last day of a
// shorter month, as PostgreSQL's interval arithmetic and Stripe's billing
// anchors do: Jan 31 plus one month is Feb 28 (or 29).
func addMonths(t time.Time, n int) time.Time {
	t = t.UTC()
	y, m, d := t.Date()
	first := time.Date(y, m+time.Month(n), 1, t.Hour(), t.Minute(), t.Second(), t.Nanosecond(), time.UTC)
	last := first.AddDate(0, 1, -1).Day()
	return first.AddDate(0, 0, min(d, last)-1)
}

// PeriodStart is the start of the monthly billing period anchored at anchor
// that contains t. It is the Go twin of the database's tally_period_start.
func PeriodStart(t, anchor time.Time) time.Time {
	t, anchor = t.UTC(), anchor.UTC()
	n := (t.Year()-anchor.Year())*12 + int(t.Month()) - int(anchor.Month())
	p := addMonths(anchor, n)
	if p.After(t) {
		p = addMonths(anchor, n-1)
	}
	return p
}

// PeriodEnd is the start of the period after the one containing t.
func PeriodEnd(t, anchor time.Time) time.Time {
	anchor = anchor.UTC()
	start := PeriodStart(t, anchor)
	// start is addMonths(anchor, k), which always lies in the k-th month
	// after the anchor's.
	k := (start.Year()-anchor.Year())*12 + int(start.Month()) - int(anchor.Month())
	return addMonths(anchor, k+1)
}

// Window is the window a usage event falls in: [From, To), inside the
// billing period starting at PeriodStart.
type Window struct {
	PeriodStart, From, To time.Time
}

// WindowOf returns the window of width (dividing a day) containing t, cut at
// the boundaries of the billing periods anchored at anchor.
func WindowOf(t time.Time, width time.Duration, anchor time.Time) Window {
	t = t.UTC()
	from := gridOrigin.Add(t.Sub(gridOrigin) / width * width)
	if t.Before(from) { // before the origin, integer division rounds up
		from = from.Add(-width)
	}
	to := from.Add(width)
	ps, pe := PeriodStart(t, anchor), PeriodEnd(t, anchor)
	if ps.After(from) {
		from = ps
	}
	if pe.Before(to) {
		to = pe
	}
	return Window{PeriodStart: ps, From: from, To: to}
}

// windowsOfBucket splits the grid bucket [from, from+width) at period
// boundaries: one window, or two when a period starts inside the bucket.
func windowsOfBucket(from time.Time, width time.Duration, anchor time.Time) []Window {
	first := WindowOf(from, width, anchor)
	out := []Window{first}
	if end := from.Add(width); first.To.Before(end) {
		out = append(out, WindowOf(first.To, width, anchor))
	}
	return out
}

func rfc3339(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// SubjectRef names a window's item: "usage:<feature>:<period_start>:<from>:<to>",
// with "#<n>" for the n-th supplement.
func (w Window) SubjectRef(feature string, supplement int) string {
	ref := fmt.Sprintf("usage:%s:%s:%s:%s", feature, rfc3339(w.PeriodStart), rfc3339(w.From), rfc3339(w.To))
	if supplement > 0 {
		ref += fmt.Sprintf("#%d", supplement)
	}
	return ref
}

// idEscaper keeps an event id from carrying the identity's separator "|"
// into a subject ref: "%" and "|" are percent-encoded, nothing else.
var idEscaper = strings.NewReplacer("%", "%25", "|", "%7C")

// featureEscaper percent-encodes ":" in a feature name (which has no "%"),
// so that the first ":" after "event:" always ends the feature.
var featureEscaper = strings.NewReplacer(":", "%3A")

// EventSubjectRef names a per-event item: "event:<feature>:<event id>". A
// ":" in the feature and a "%" or "|" in the id are percent-encoded, so that
// two different events never share a ref (feature "a:b" with id "c" and
// feature "a" with id "b:c" would otherwise both read "event:a:b:c").
func EventSubjectRef(feature, eventID string) string {
	return "event:" + featureEscaper.Replace(feature) + ":" + idEscaper.Replace(eventID)
}
