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
	cust := f.Get("customer")
	if cust == "" {
		writeError(w, errMissingParam("customer"))
		return
	}
	start, e := intParam(f, "start_time")
	if e != nil {
		writeError(w, e)
		return
	}
	end, e := intParam(f, "end_time")
	if e != nil {
		writeError(w, e)
		return
	}
	grouping := f.Get("value_grouping_window")
	size, unit := int64(60), "minute"
	switch grouping {
	case "":
	case "hour":
		size, unit = 3600, "hour"
	case "day":
		size, unit = 86400, "day (00:00 UTC)"
	default:
		writeError(w, errValidation("", "value_grouping_window",
			"Invalid value_grouping_window: must be one of day or hour"))
		return
	}
	for _, b := range []struct {
		name string
		v    int64
	}{{"start_time", start}, {"end_time", end}} {
		if b.v%size != 0 {
			writeError(w, errValidation("", b.name,
				"Invalid %s: %d must be aligned with %s boundaries", b.name, b.v, unit))
			return
		}
	}
	if end <= start {
		writeError(w, errValidation("", "end_time", "Invalid end_time: must be after start_time"))
		return
	}

	c, id := callerOf(r), chi.URLParam(r, "id")
	all, e := func() ([]summaryJSON, *apiError) {
		s.mu.Lock()
		defer s.mu.Unlock()
		a := s.accountLocked(c.account)
		m := a.findMeterLocked(c.livemode, id)
		if m == nil {
			return nil, errNoSuch(http.StatusNotFound, meterObjectName, "id", id)
		}
		if a.customers[modeID{c.livemode, cust}] == nil {
			return nil, errNoSuch(http.StatusBadRequest, customerObjectName, "customer", cust)
		}
		windows := map[int64]*window{}
		if grouping == "" {
			windows[start] = &window{start: start, end: end}
		}
		for _, ev := range a.events {
			ts := ev.timestamp.Unix()
			if ev.meter != m.ID || ev.customer != cust || ev.status != EventRecorded || ts < start || ts >= end {
				continue
			}
			ws := start
			if grouping != "" {
				ws = ts - ts%size
			}
			win := windows[ws]
			if win == nil {
				win = &window{start: ws, end: ws + size}
				windows[ws] = win
			}
			win.add(ev)
		}
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
				ID: summaryID(m.Livemode, m.ID, cust, win.start, win.end), Object: "billing.meter_event_summary",
				AggregatedValue: win.value(m.Formula), StartTime: win.start, EndTime: win.end,
				Livemode: m.Livemode, Meter: m.ID,
			}
		}
		return out, nil
	}()
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
