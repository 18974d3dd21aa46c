package stripesim

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"

	"github.com/go-chi/chi/v5"
)

const summaryObjectName = "billing meter event summary"

// summaryJSON is the billing.meter_event_summary object stripe-go decodes.
type summaryJSON struct {
	ID              string  `json:"id"`
	Object          string  `json:"object"`
	AggregatedValue float64 `json:"aggregated_value"`
	EndTime         int64   `json:"end_time"`
	Livemode        bool    `json:"livemode"`
	Meter           string  `json:"meter"`
	StartTime       int64   `json:"start_time"`
}

// summaryID is a stable id for the summary of a meter, customer and window,
// so that it works as a pagination cursor across requests.
func summaryID(livemode bool, meter, customer string, start, end int64) string {
	h := sha256.Sum256(fmt.Appendf(nil, "%s\x00%s\x00%d\x00%d", meter, customer, start, end))
	prefix := "mtrusg_test_"
	if livemode {
		prefix = "mtrusg_"
	}
	return prefix + hex.EncodeToString(h[:16])
}

// intParam parses the integer form value name, which must be present.
func intParam(f url.Values, name string) (int64, *apiError) {
	v := f.Get(name)
	if v == "" {
		return 0, errMissingParam(name)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, errValidation("parameter_invalid_integer", name, "Invalid integer: %s", v)
	}
	return n, nil
}

// window is one summary being aggregated.
type window struct {
	start, end int64
	sum        int64
	count      int
	last       *event
}

func (w *window) add(ev *event) {
	w.sum += ev.value
	w.count++
	if w.last == nil || laterEvent(ev, w.last) {
		w.last = ev
	}
}

func (w *window) value(formula string) float64 {
	switch formula {
	case "count":
		return float64(w.count)
	case "last":
		if w.last == nil {
			return 0
		}
		return float64(w.last.value)
	}
	return float64(w.sum)
}

// listEventSummaries is GET /v1/billing/meters/{id}/event_summaries. It
// aggregates the customer's recorded events (not dropped, not cancelled)
// whose timestamp is in [start_time, end_time), by the meter's formula:
// with value_grouping_window one summary per hour or UTC day that has
// events, newest first as Stripe lists them; without it one summary for the
// whole range, even when empty. The bounds must be aligned to the window
// (to minutes without one).
func (s *Server) listEventSummaries(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	if e := checkParams(f, "customer", "start_time", "end_time", "value_grouping_window",
		"limit", "starting_after", "ending_before"); e != nil {
		writeError(w, e)
		return
	}
	p, e := parseListParams(f)
	if e != nil {
		writeError(w, e)
		return
	}
	q, e := parseSummaryQuery(f)
	if e != nil {
		writeError(w, e)
		return
	}
	id := chi.URLParam(r, "id")
	all, e := s.eventSummaries(callerOf(r), id, q)
	if e != nil {
		writeError(w, e)
		return
	}
	page, more, e := paginate(all, func(s summaryJSON) string { return s.ID }, func(summaryJSON) bool { return true },
		p, summaryObjectName)
	if e != nil {
		writeError(w, e)
		return
	}
	if page == nil {
		page = []summaryJSON{}
	}
	writeJSON(w, http.StatusOK, listEnvelope{Object: "list", Data: page, HasMore: more,
		URL: "/v1/billing/meters/" + id + "/event_summaries"})
}

// summaryQuery is what a summaries request asks for: the customer, the
// range [start, end), and the grouping window ("" for the whole range, else
// "hour" or "day") with its size in seconds (60 without one: the bounds'
// alignment).
type summaryQuery struct {
	customer   string
	start, end int64
	grouping   string
	size       int64
}

// parseSummaryQuery reads and checks a summaries request's own parameters,
// answering the first problem as Stripe does: a missing customer, a missing
// or malformed bound, an unknown grouping window, a bound not aligned to it,
// an empty range.
func parseSummaryQuery(f url.Values) (summaryQuery, *apiError) {
	q := summaryQuery{customer: f.Get("customer")}
	if q.customer == "" {
		return summaryQuery{}, errMissingParam("customer")
	}
	var e *apiError
	if q.start, e = intParam(f, "start_time"); e != nil {
		return summaryQuery{}, e
	}
	if q.end, e = intParam(f, "end_time"); e != nil {
		return summaryQuery{}, e
	}
	q.grouping = f.Get("value_grouping_window")
	size, unit, e := groupingWindow(q.grouping)
	if e != nil {
		return summaryQuery{}, e
	}
	q.size = size
	for _, b := range []struct {
		name string
		v    int64
	}{{"start_time", q.start}, {"end_time", q.end}} {
		if b.v%size != 0 {
			return summaryQuery{}, errValidation("", b.name,
				"Invalid %s: %d must be aligned with %s boundaries", b.name, b.v, unit)
		}
	}
	if q.end <= q.start {
		return summaryQuery{}, errValidation("", "end_time", "Invalid end_time: must be after start_time")
	}
	return q, nil
}

// groupingWindow is the size in seconds of a value_grouping_window, and the
// unit its bounds must be aligned to ("" groups nothing: minutes).
func groupingWindow(grouping string) (size int64, unit string, e *apiError) {
	switch grouping {
	case "":
		return 60, "minute", nil
	case "hour":
		return 3600, "hour", nil
	case "day":
		return 86400, "day (00:00 UTC)", nil
	}
	return 0, "", errValidation("", "value_grouping_window",
		"Invalid value_grouping_window: must be one of day or hour")
}

// eventSummaries aggregates the summaries q asks for of the caller's meter
// id, newest first; a meter or a customer the account does not have is an
// error.
func (s *Server) eventSummaries(c caller, id string, q summaryQuery) ([]summaryJSON, *apiError) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.accountLocked(c.account)
	m := a.findMeterLocked(c.livemode, id)
	if m == nil {
		return nil, errNoSuch(http.StatusNotFound, meterObjectName, "id", id)
	}
	if a.customers[modeID{c.livemode, q.customer}] == nil {
		return nil, errNoSuch(http.StatusBadRequest, customerObjectName, "customer", q.customer)
	}
	windows := a.summaryWindowsLocked(m, q)
	starts := make([]int64, 0, len(windows))
	for ws := range windows {
		starts = append(starts, ws)
	}
	slices.Sort(starts)
	slices.Reverse(starts) // newest first
	out := make([]summaryJSON, len(starts))
	for i, ws := range starts {
		win := windows[ws]
		out[i] = summaryJSON{
			ID: summaryID(m.Livemode, m.ID, q.customer, win.start, win.end), Object: "billing.meter_event_summary",
			AggregatedValue: win.value(m.Formula), StartTime: win.start, EndTime: win.end,
			Livemode: m.Livemode, Meter: m.ID,
		}
	}
	return out, nil
}

// summaryWindowsLocked folds the customer's recorded events of meter m in
// q's range into windows, by start: one per grouping window with events,
// or, without grouping, one for the whole range even when empty.
func (a *account) summaryWindowsLocked(m *Meter, q summaryQuery) map[int64]*window {
	windows := map[int64]*window{}
	if q.grouping == "" {
		windows[q.start] = &window{start: q.start, end: q.end}
	}
	for _, ev := range a.events {
		ts := ev.timestamp.Unix()
		if ev.meter != m.ID || ev.customer != q.customer || ev.status != EventRecorded || ts < q.start || ts >= q.end {
			continue
		}
		ws := q.start
		if q.grouping != "" {
			ws = ts - ts%q.size
		}
		win := windows[ws]
		if win == nil {
			win = &window{start: ws, end: ws + q.size}
			windows[ws] = win
		}
		win.add(ev)
	}
	return windows
}
