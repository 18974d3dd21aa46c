package console

import (
	"errors"
	"net/http"
	"net/url"
	"strconv"

	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// quarantineListLimit bounds the quarantine page's list of items.
const quarantineListLimit = 500

func filterOf(r *http.Request) quarantine.Filter {
	q := r.URL.Query()
	return quarantine.Filter{Reason: q.Get("reason"), Tenant: q.Get("tenant"), Feature: q.Get("feature"), Period: q.Get("period")}
}

func (c *Console) quarantine(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	f := filterOf(r)
	if _, _, err := quarantine.ParsePeriod(f.Period); f.Period != "" && err != nil {
		// A malformed period is the user's: show the page unfiltered by it.
		f.Period = ""
	}
	rep, err := quarantine.Quarantined(ctx, c.pool, f)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	items, err := quarantine.Items(ctx, c.pool, f, quarantineListLimit)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	csv := url.Values{}
	for k, v := range map[string]string{"reason": f.Reason, "tenant": f.Tenant, "feature": f.Feature, "period": f.Period} {
		if v != "" {
			csv.Set(k, v)
		}
	}
	c.render(w, r, "quarantine", "Quarantine", struct {
		Filter  quarantine.Filter
		Reasons []string
		Report  quarantine.Report
		Items   []quarantine.Item
		CSVHref string
	}{f, reasonNames(), rep, items, "/console/quarantine.csv?" + csv.Encode()})
}

// reasonNames lists every quarantine reason, the outbox's list, for the
// filter.
func reasonNames() []string {
	out := make([]string, len(outbox.Reasons))
	for i, r := range outbox.Reasons {
		out[i] = string(r)
	}
	return out
}

// quarantineCSV is the report as CSV, safe to open in a spreadsheet.
func (c *Console) quarantineCSV(w http.ResponseWriter, r *http.Request) {
	f := filterOf(r)
	if _, _, err := quarantine.ParsePeriod(f.Period); f.Period != "" && err != nil {
		http.Error(w, "the period must be YYYY-MM", http.StatusBadRequest)
		return
	}
	rep, err := quarantine.Quarantined(r.Context(), c.pool, f)
	if err != nil {
		// The database's, not the user's (the read timeout, say).
		c.fail(w, r, err)
		return
	}
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	w.Header().Set("Content-Disposition", `attachment; filename="tally-quarantine.csv"`)
	if err := rep.CSV(w); err != nil {
		c.Logger.ErrorContext(r.Context(), "writing the quarantine CSV failed", "error", err)
	}
}

func (c *Console) requeue(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(r)
	version, err := strconv.Atoi(r.PostFormValue("mapping_version"))
	if !ok || err != nil {
		http.Error(w, "an item id and a mapping version are required", http.StatusBadRequest)
		return
	}
	res, err := c.Requeuer.Requeue(r.Context(), c.pool, id, version, actor(r))
	var (
		mc *quarantine.MappingChangedError
		ie *quarantine.StillIneligibleError
		se *outbox.StateError
	)
	switch {
	case errors.Is(err, outbox.ErrNotFound):
		http.NotFound(w, r)
	case err == nil && res.Action == quarantine.ActionReaddressed:
		back(w, r, "/console/quarantine", "readdressed")
	case err == nil:
		back(w, r, "/console/quarantine", "requeued")
	case errors.As(err, &mc):
		back(w, r, "/console/quarantine", "mapping_changed")
	case errors.As(err, &ie):
		back(w, r, "/console/quarantine", "still_ineligible")
	case errors.Is(err, outbox.ErrMayHaveReached):
		back(w, r, "/console/quarantine", "may_have_reached")
	case errors.As(err, &se):
		back(w, r, "/console/quarantine", "not_quarantined")
	case quarantine.IsConflict(err):
		back(w, r, "/console/quarantine", "requeue_refused")
	default:
		c.fail(w, r, err)
	}
}
