package console

import (
	"fmt"
	"net/http"
	"net/url"
	"strconv"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// quarantineListLimit bounds the quarantine page's list of items.
const quarantineListLimit = 500

func filterOf(r *http.Request) quarantine.Filter {
	q := r.URL.Query()
	return quarantine.Filter{Reason: q.Get("reason"), Tenant: q.Get("tenant"), Feature: q.Get("feature"), Period: q.Get("period")}
}

// requeueMatchingAction is where the quarantine page's "requeue all
// matching" form posts (requeueMatching).
const requeueMatchingAction = "/console/quarantine/requeue"

// quarantinePage is what the quarantine page shows.
type quarantinePage struct {
	Filter  quarantine.Filter
	Reasons []string
	Report  quarantine.Report
	Items   []quarantine.Item
	// PageHref is this page with its filters; CSVHref and ItemsCSVHref
	// download the report and its items as CSV; ConfirmHref asks to
	// requeue every matching item.
	PageHref, CSVHref, ItemsCSVHref, ConfirmHref string
	// RequeueAction is where the confirmation posts.
	RequeueAction string
	// After is the page of matching items a confirmation is for: those
	// with a greater id.
	After int64
	// Confirm is the dry run a confirmation shows; Result what the
	// requeue did.
	Confirm, Result *quarantine.BulkResult
	// NextHref, after a result that read a full page, confirms the next.
	NextHref string
}

func (c *Console) quarantine(w http.ResponseWriter, r *http.Request) {
	f := filterOf(r)
	if _, _, err := quarantine.ParsePeriod(f.Period); f.Period != "" && err != nil {
		// A malformed period is the user's: show the page unfiltered by it.
		f.Period = ""
	}
	p := quarantinePage{Filter: f}
	s, _ := sessionOf(r)
	if r.URL.Query().Get("confirm") == "requeue" && s.Role.Allows(auth.RoleOperator) {
		// The confirmation: the same requeues as a dry run, which changes
		// nothing.
		p.After, _ = strconv.ParseInt(r.URL.Query().Get("after"), 10, 64)
		res, err := c.Requeuer.RequeueMatching(r.Context(), c.pool, quarantine.BulkRequest{Filter: f, After: max(p.After, 0),
			DryRun: true, By: actor(r)})
		if err != nil {
			c.fail(w, r, err)
			return
		}
		p.Confirm = &res
	}
	p.Result = resultOf(r.URL.Query())
	c.renderQuarantine(w, r, p)
}

// renderQuarantine reads the report and the items of p's filter and
// renders the page.
func (c *Console) renderQuarantine(w http.ResponseWriter, r *http.Request, p quarantinePage) {
	ctx := r.Context()
	var err error
	if p.Report, err = quarantine.Quarantined(ctx, c.pool, p.Filter); err != nil {
		c.fail(w, r, err)
		return
	}
	if p.Items, err = quarantine.Items(ctx, c.pool, p.Filter, quarantineListLimit); err != nil {
		c.fail(w, r, err)
		return
	}
	q := filterQuery(p.Filter)
	p.Reasons, p.RequeueAction = reasonNames(), requeueMatchingAction
	p.PageHref = "/console/quarantine?" + q.Encode()
	p.CSVHref = "/console/quarantine.csv?" + q.Encode()
	q.Set("items", "1")
	p.ItemsCSVHref = "/console/quarantine.csv?" + q.Encode()
	q.Del("items")
	q.Set("confirm", "requeue")
	p.ConfirmHref = "/console/quarantine?" + q.Encode()
	if p.Result != nil && p.Result.NextAfter != nil {
		q.Set("after", strconv.FormatInt(*p.Result.NextAfter, 10))
		p.NextHref = "/console/quarantine?" + q.Encode()
	}
	c.render(w, r, "quarantine", "Quarantine", p)
}

// filterQuery is a filter's fields as query parameters, the empty ones
// left out.
func filterQuery(f quarantine.Filter) url.Values {
	q := url.Values{}
	for k, v := range map[string]string{"reason": f.Reason, "tenant": f.Tenant, "feature": f.Feature, "period": f.Period} {
		if v != "" {
			q.Set(k, v)
		}
	}
	return q
}

// requeueMatching requeues every quarantined item the posted filters
// match (a page of them, after the posted id) under the current mappings,
// as POST /v1/quarantine/requeue does, and redirects to the page with the
// filters, which shows what it did.
func (c *Console) requeueMatching(w http.ResponseWriter, r *http.Request) {
	f := quarantine.Filter{Reason: r.PostFormValue("reason"), Tenant: r.PostFormValue("tenant"),
		Feature: r.PostFormValue("feature"), Period: r.PostFormValue("period")}
	after, err := strconv.ParseInt(r.PostFormValue("after"), 10, 64)
	if _, _, perr := quarantine.ParsePeriod(f.Period); err != nil || after < 0 || (f.Period != "" && perr != nil) {
		http.Error(w, "the filters or the page are malformed: reload the quarantine page and try again", http.StatusBadRequest)
		return
	}
	res, err := c.Requeuer.RequeueMatching(r.Context(), c.pool, quarantine.BulkRequest{Filter: f, After: after, By: actor(r),
		Options: quarantine.RequeueOptions{AcceptPeriodClosed: r.PostFormValue("accept_period_closed") == "1"}})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	q := filterQuery(f)
	for k, v := range resultQuery(res) {
		q[k] = v
	}
	http.Redirect(w, r, "/console/quarantine?"+q.Encode(), http.StatusSeeOther)
}

// refusalCodes are the refusals a requeue's result may count, the only
// ones the page reads back from its query.
var refusalCodes = []string{quarantine.RefusalNotFound, quarantine.RefusalMappingChanged, quarantine.RefusalNotQuarantined,
	quarantine.RefusalStillIneligible, quarantine.RefusalMayHaveReached, quarantine.RefusalNotSendable,
	quarantine.RefusalAggregationChanged, quarantine.RefusalExportStalled, quarantine.RefusalSuccessorExists,
	quarantine.RefusalPeriodClosed}

// resultQuery is a bulk requeue's totals as the query of the redirect
// after it: the page shows them (resultOf) and a reload requeues nothing.
func resultQuery(res quarantine.BulkResult) url.Values {
	q := url.Values{"done": {"1"}, "requeued": {strconv.Itoa(res.Totals.Requeued)},
		"readdressed": {strconv.Itoa(res.Totals.Readdressed)}, "refused": {strconv.Itoa(res.Totals.Refused)}}
	for code, n := range res.Totals.RefusedBy {
		q.Set("refused_"+code, strconv.Itoa(n))
	}
	if res.NextAfter != nil {
		q.Set("next", strconv.FormatInt(*res.NextAfter, 10))
	}
	return q
}

// resultOf reads the totals resultQuery wrote; nil without them.
func resultOf(q url.Values) *quarantine.BulkResult {
	if q.Get("done") == "" {
		return nil
	}
	n := func(k string) int {
		v, err := strconv.Atoi(q.Get(k))
		if err != nil || v < 0 {
			return 0
		}
		return v
	}
	res := &quarantine.BulkResult{Totals: quarantine.BulkTotals{Requeued: n("requeued"), Readdressed: n("readdressed"),
		Refused: n("refused"), RefusedBy: map[string]int{}}}
	for _, code := range refusalCodes {
		if v := n("refused_" + code); v > 0 {
			res.Totals.RefusedBy[code] = v
		}
	}
	if next, err := strconv.ParseInt(q.Get("next"), 10, 64); err == nil && next > 0 {
		res.NextAfter = &next
	}
	return res
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

// quarantineCSV is the report as CSV, safe to open in a spreadsheet; with
// items=1, its items one by one.
func (c *Console) quarantineCSV(w http.ResponseWriter, r *http.Request) {
	f := filterOf(r)
	if _, _, err := quarantine.ParsePeriod(f.Period); f.Period != "" && err != nil {
		http.Error(w, "the period must be YYYY-MM", http.StatusBadRequest)
		return
	}
	if r.URL.Query().Get("items") == "1" {
		c.quarantineItemsCSV(w, r, f)
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

// quarantineItemsCSV is the quarantined items as CSV, one row an item,
// safe to open in a spreadsheet; a filter matching more than
// quarantine.MaxItemsCSV is refused rather than cut.
func (c *Console) quarantineItemsCSV(w http.ResponseWriter, r *http.Request, f quarantine.Filter) {
	items, err := quarantine.Items(r.Context(), c.pool, f, quarantine.MaxItemsCSV+1)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	if len(items) > quarantine.MaxItemsCSV {
		http.Error(w, fmt.Sprintf("more than %d items match: narrow the filters", quarantine.MaxItemsCSV), http.StatusUnprocessableEntity)
		return
	}
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	w.Header().Set("Content-Disposition", `attachment; filename="tally-quarantine-items.csv"`)
	if err := quarantine.ItemsCSV(w, items); err != nil {
		c.Logger.ErrorContext(r.Context(), "writing the quarantine items CSV failed", "error", err)
	}
}

func (c *Console) requeue(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(r)
	version, err := strconv.Atoi(r.PostFormValue("mapping_version"))
	if !ok || err != nil {
		http.Error(w, "an item id and a mapping version are required", http.StatusBadRequest)
		return
	}
	res, err := c.Requeuer.RequeueWith(r.Context(), c.pool, id, version, actor(r),
		quarantine.RequeueOptions{AcceptPeriodClosed: r.PostFormValue("accept_period_closed") == "1"})
	switch {
	case err != nil:
		c.refused(w, r, "requeue", "/console/quarantine", err)
	case res.Action == quarantine.ActionReaddressed:
		back(w, r, "/console/quarantine", "readdressed")
	default:
		back(w, r, "/console/quarantine", "requeued")
	}
}
