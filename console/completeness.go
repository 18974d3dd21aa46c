package console

import (
	"context"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/pricing"
	"github.com/tallymeter/tally/quarantine"
)

// lineItemsLimit bounds the list of items behind a count.
const lineItemsLimit = 100

// stateCue is how a state reads without its colour: a glyph beside its
// name, so that no state is told from another by colour alone.
var stateCue = map[string]string{
	"confirmed": "✔", "accepted": "◆", "pending": "○", "leased": "◔", "quarantined": "▲",
	"uncertain": "?", "rejected": "✖", "cancelled": "⊘", "superseded": "↷", "withdrawn": "↩",
}

// stateHeading is a state's column heading: its glyph, its name and what
// it means.
type stateHeading struct {
	State, Cue, Label, Title string
}

// completenessStates are the state columns of the completeness page, in
// their order.
var completenessStates = []stateHeading{
	{"confirmed", stateCue["confirmed"], "Confirmed", "Stripe's summaries show it: billed"},
	{"accepted", stateCue["accepted"], "Accepted", "Stripe accepted it; not yet seen in its summaries (the settle delay)"},
	{"pending", stateCue["pending"], "Pending", "not yet sent, or being sent"},
	{"quarantined", stateCue["quarantined"], "Quarantined", "held back until an operator fixes its cause"},
	{"uncertain", stateCue["uncertain"], "Uncertain", "may or may not have reached Stripe: to recover"},
	{"rejected", stateCue["rejected"], "Rejected", "abandoned: never billed"},
}

// count is a number as the page shows it, with the page that lists what
// it counts (Href empty when nothing to list).
type count struct {
	Text string
	Zero bool
	Href string
}

// completenessRow is a line of the report as the page shows it.
type completenessRow struct {
	Tenant, Customer, CustomerID string
	// Named is true when Stripe gave the customer a name.
	Named              bool
	Accounts           string
	Feature, Unit      string
	Period, PeriodFull string
	Ingested           count
	States             []count
	Cancelled, Late    count
	Discrepancies      count
	StripeHasMore      int64
	// Invoiced is the finalized invoice's quantity ("–" before it is
	// compared); InvoiceKinds the open differences, in words.
	Invoiced     string
	InvoiceKinds string
	// Amount is what the usage should bill and AtRisk the part Stripe has
	// not accepted, formatted ("–" when the line has no price); Note is
	// AmountNote.
	Amount, AtRisk, Note string
	Risky                bool
	Holds                bool
}

// moneyRow is one currency's total, or one customer's, on the page.
type moneyRow struct {
	Customer, Amount, AtRisk string
	Risky                    bool
	Lines                    int
}

// totalRow sums the lines of one feature (one unit).
type totalRow struct {
	Feature, Unit string
	Lines         int
	Ingested      string
	States        []string
	Cancelled     string
	Late          string
	Discrepancies int64
	Holds         bool
}

// lineItemsView is the list of items behind one count.
type lineItemsView struct {
	State, Cue, Tenant, Customer, Feature, Period string
	Items                                         []lineItemRow
	Full                                          bool
	// Unstaged is the line's pending usage not yet in any item (events).
	Unstaged string
	// Unmapped says the line's tenant or feature has no current mapping:
	// nothing can be listed.
	Unmapped bool
}

type lineItemRow struct {
	ID                       int64
	State, Cue, At, Value, R string
}

func (c *Console) completeness(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	q := r.URL.Query()
	period := q.Get("period")
	if _, _, err := quarantine.ParsePeriod(period); err != nil {
		period = time.Now().UTC().Format("2006-01")
	}
	tenant := q.Get("tenant")
	refresh := q.Get("refresh") == "1"
	rep, err := c.Reports.Completeness(ctx, c.pool, period, tenant, refresh)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	// The latest comparison of the counters the report reads with the
	// ledger: one row.
	audit, audited, err := quarantine.LatestAudit(ctx, c.pool, period)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var last *quarantine.Audit
	if audited {
		last = &audit
	}
	names, units, err := c.lineNames(ctx, rep.Lines)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	rows := make([]completenessRow, len(rep.Lines))
	for i, l := range rep.Lines {
		rows[i] = rowOf(l, period, names[l.Tenant], units[l.Feature])
	}
	var items *lineItemsView
	if st := q.Get("items"); st != "" {
		if items, err = c.lineItems(ctx, rep, names, units, st, tenant, q.Get("feature"), q.Get("line")); err != nil {
			c.fail(w, r, err)
			return
		}
	}
	csvHref := "/console/completeness.csv?" + url.Values{"period": {period}, "tenant": {tenant}}.Encode()
	refreshHref := "/console/completeness?" + url.Values{"period": {period}, "tenant": {tenant}, "refresh": {"1"}}.Encode()
	labels := make([]string, len(rows))
	for i, row := range rows {
		labels[i] = row.Customer + " · " + row.Feature + " · " + row.Period
	}
	money, customers := moneyRows(rep, names)
	c.render(w, r, "completeness", "Completeness", struct {
		Period, Tenant string
		RefreshHref    string
		CSVHref        string
		Report         quarantine.Completeness
		States         []stateHeading
		Rows           []completenessRow
		Totals         []totalRow
		Items          *lineItemsView
		Audit          *quarantine.Audit
		Chart          template.HTML
		Money          []moneyRow
		Customers      []moneyRow
	}{period, tenant, refreshHref, csvHref, rep, completenessStates, rows, totalsOf(rep.Lines, units), items, last,
		completenessChart(rep, labels), money, customers})
}

// moneyRows are the report's totals as the page shows them: one per
// currency, then one per customer and currency, a customer by its name
// when Stripe gave one.
func moneyRows(rep quarantine.Completeness, names map[string]mappings.TenantCustomer) (totals, customers []moneyRow) {
	row := func(who string, a quarantine.Amount) moneyRow {
		return moneyRow{Customer: who, Amount: pricing.Format(a.Amount, a.Currency), AtRisk: pricing.Format(a.AtRisk, a.Currency),
			Risky: a.AtRisk != 0, Lines: a.Lines}
	}
	named := map[string]string{}
	for _, n := range names {
		if n.Name != "" {
			named[n.Customer] = n.Name + " (" + n.Customer + ")"
		}
	}
	for _, a := range rep.Amounts {
		totals = append(totals, row("", a))
	}
	for _, c := range rep.Customers {
		who := c.Customer
		if n, ok := named[who]; ok {
			who = n
		}
		customers = append(customers, row(who, c.Amount))
	}
	return totals, customers
}

// lineNames reads the current customer (with its name as last read from
// Stripe, never asking Stripe) of each tenant and the unit of each feature
// of the report's lines: two index lookups a tenant and one read of the
// feature mappings.
func (c *Console) lineNames(ctx context.Context, lines []quarantine.Line) (map[string]mappings.TenantCustomer, map[string]mappings.Feature, error) {
	var tenants []string
	for _, l := range lines {
		if !slices.Contains(tenants, l.Tenant) {
			tenants = append(tenants, l.Tenant)
		}
	}
	names, err := mappings.TenantCustomers(ctx, c.pool, tenants)
	if err != nil {
		return nil, nil, err
	}
	features, err := c.Mappings.Features(ctx, c.pool)
	if err != nil {
		return nil, nil, err
	}
	units := map[string]mappings.Feature{}
	for _, f := range features {
		units[f.Feature] = f
	}
	return names, units, nil
}

// unitOf says in what a feature's usage counts: its meter's event name
// and how Stripe aggregates it; a feature without a mapping has none.
func unitOf(f mappings.Feature, ok bool) string {
	if !ok {
		return "no mapping"
	}
	switch f.Aggregation {
	case mappings.Count:
		return "count of " + f.EventName + " events"
	case mappings.Last:
		return "last " + f.EventName + " value"
	}
	return "sum of " + f.EventName
}

func rowOf(l quarantine.Line, period string, cu mappings.TenantCustomer, f mappings.Feature) completenessRow {
	row := completenessRow{Tenant: l.Tenant, Customer: l.Tenant, CustomerID: cu.Customer, Named: cu.Name != "",
		Accounts: strings.Join(l.Accounts, " "), Feature: l.Feature, Unit: unitOf(f, f.Feature != ""),
		Period: periodText(l.Period), PeriodFull: l.Period, StripeHasMore: l.DiscrepanciesStripeHasMore, Holds: l.Holds}
	if cu.Name != "" {
		row.Customer = cu.Name
	}
	row.Ingested = count{Text: grouped(l.Ingested.Value.String()), Zero: l.Ingested.Events == 0}
	for i, b := range []quarantine.Bucket{l.Confirmed, l.Accepted, l.Pending, l.Quarantined, l.Uncertain, l.Rejected} {
		n := count{Text: grouped(b.Value.String()), Zero: b.Events == 0}
		if !n.Zero {
			st := completenessStates[i].State
			if st == "quarantined" {
				n.Href = "/console/quarantine?" + url.Values{"tenant": {l.Tenant}, "feature": {l.Feature}, "period": {period}}.Encode()
			} else {
				n.Href = "/console/completeness?" + url.Values{"period": {period}, "tenant": {l.Tenant}, "feature": {l.Feature},
					"line": {l.Period}, "items": {st}}.Encode() + "#items"
			}
		}
		row.States = append(row.States, n)
	}
	row.Invoiced = "–"
	if l.Invoiced != nil {
		row.Invoiced = grouped(l.Invoiced.String())
	}
	var kinds []string
	for _, k := range l.InvoiceDiscrepancies {
		kinds = append(kinds, kindLabels[k])
	}
	row.InvoiceKinds = strings.Join(kinds, "; ")
	row.Amount, row.Note = "–", l.AmountNote
	if l.Amount != nil {
		row.Amount = pricing.Format(*l.Amount, l.Currency)
		if l.AmountAtRisk != nil && *l.AmountAtRisk != 0 {
			row.AtRisk, row.Risky = pricing.Format(*l.AmountAtRisk, l.Currency), true
		}
	}
	row.Cancelled = count{Text: grouped(l.Cancelled.Value.String()), Zero: l.Cancelled.Events == 0}
	row.Late = count{Text: grouped(l.PeriodClosed.Value.String()), Zero: l.PeriodClosed.Events == 0}
	row.Discrepancies = count{Text: grouped(strconv.FormatInt(l.Discrepancies, 10)), Zero: l.Discrepancies == 0}
	if l.Discrepancies > 0 {
		row.Discrepancies.Href = "/console/discrepancies?" + url.Values{"tenant": {l.Tenant}, "feature": {l.Feature}, "period": {period}}.Encode()
	}
	return row
}

// totalsOf sums the lines by feature: one row a feature, since features
// count in units of their own.
func totalsOf(lines []quarantine.Line, units map[string]mappings.Feature) []totalRow {
	type sum struct {
		lines               int
		ingested, cancelled quarantine.Value
		late                quarantine.Value
		states              [6]quarantine.Value
		discrepancies       int64
		holds               bool
	}
	var order []string
	sums := map[string]*sum{}
	for _, l := range lines {
		s := sums[l.Feature]
		if s == nil {
			s = &sum{holds: true}
			sums[l.Feature] = s
			order = append(order, l.Feature)
		}
		s.lines++
		s.ingested, s.cancelled, s.late = s.ingested.Plus(l.Ingested.Value), s.cancelled.Plus(l.Cancelled.Value), s.late.Plus(l.PeriodClosed.Value)
		for i, b := range []quarantine.Bucket{l.Confirmed, l.Accepted, l.Pending, l.Quarantined, l.Uncertain, l.Rejected} {
			s.states[i] = s.states[i].Plus(b.Value)
		}
		s.discrepancies += l.Discrepancies
		s.holds = s.holds && l.Holds
	}
	slices.Sort(order)
	out := make([]totalRow, 0, len(order))
	for _, f := range order {
		s := sums[f]
		u, ok := units[f]
		t := totalRow{Feature: f, Unit: unitOf(u, ok), Lines: s.lines, Ingested: grouped(s.ingested.String()),
			Cancelled: grouped(s.cancelled.String()), Late: grouped(s.late.String()), Discrepancies: s.discrepancies, Holds: s.holds}
		for _, v := range s.states {
			t.States = append(t.States, grouped(v.String()))
		}
		out = append(out, t)
	}
	return out
}

// lineItems lists the items of state behind the line of tenant, feature
// and period start line: read by the line's ordering keys under the
// current mappings, at most lineItemsLimit.
func (c *Console) lineItems(ctx context.Context, rep quarantine.Completeness, names map[string]mappings.TenantCustomer,
	units map[string]mappings.Feature, state, tenant, feature, line string) (*lineItemsView, error) {
	i := slices.IndexFunc(rep.Lines, func(l quarantine.Line) bool {
		return l.Tenant == tenant && l.Feature == feature && l.Period == line
	})
	known := slices.ContainsFunc(completenessStates, func(h stateHeading) bool { return h.State == state })
	if i < 0 || !known {
		return nil, nil
	}
	l := rep.Lines[i]
	cu, mappedTenant := names[tenant]
	f, mappedFeature := units[feature]
	v := &lineItemsView{State: state, Cue: stateCue[state], Tenant: tenant, Customer: tenant, Feature: feature, Period: periodText(line)}
	if cu.Name != "" {
		v.Customer = cu.Name
	}
	if state == "pending" && l.Unstaged.Events > 0 {
		v.Unstaged = grouped(strconv.FormatInt(l.Unstaged.Events, 10))
	}
	start, err := time.Parse(time.RFC3339, line)
	if !mappedTenant || !mappedFeature || err != nil {
		v.Unmapped = true
		return v, nil
	}
	items, err := quarantine.LineItems(ctx, c.pool, quarantine.LineFilter{Tenant: tenant, Feature: feature, Period: start,
		Accounts: l.Accounts, Customer: cu.Customer, EventName: f.EventName, States: []string{state}}, lineItemsLimit)
	if err != nil {
		return nil, err
	}
	v.Full = len(items) == lineItemsLimit
	for _, it := range items {
		v.Items = append(v.Items, lineItemRow{ID: it.ID, State: it.State, Cue: stateCue[it.State],
			At: it.At.Format("2006-01-02 15:04"), Value: grouped(it.Value), R: it.Reason})
	}
	return v, nil
}

// periodText is a billing period's start as a finance reader says it:
// YYYY-MM for a calendar month, the date for a period anchored on another
// day.
func periodText(start string) string {
	t, err := time.Parse(time.RFC3339, start)
	if err != nil {
		return start
	}
	t = t.UTC()
	if t.Day() == 1 && t.Hour() == 0 && t.Minute() == 0 && t.Second() == 0 {
		return t.Format("2006-01")
	}
	return t.Format("2006-01-02")
}

// grouped writes an integer with thousands separators ("-1,234,567");
// anything else is returned as it is.
func grouped(s string) string {
	digits := strings.TrimPrefix(s, "-")
	if digits == "" || strings.Trim(digits, "0123456789") != "" {
		return s
	}
	var b strings.Builder
	if len(digits) < len(s) {
		b.WriteByte('-')
	}
	for i, d := range digits {
		if i > 0 && (len(digits)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(d)
	}
	return b.String()
}

// completenessCSV is the report as CSV, safe to open in a spreadsheet.
func (c *Console) completenessCSV(w http.ResponseWriter, r *http.Request) {
	period := r.URL.Query().Get("period")
	if _, _, err := quarantine.ParsePeriod(period); err != nil {
		http.Error(w, "the period must be YYYY-MM", http.StatusBadRequest)
		return
	}
	rep, err := c.Reports.Completeness(r.Context(), c.pool, period, r.URL.Query().Get("tenant"), false)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	w.Header().Set("Content-Disposition", `attachment; filename="tally-completeness-`+period+`.csv"`)
	if err := rep.CSV(w); err != nil {
		c.Logger.ErrorContext(r.Context(), "writing the completeness CSV failed", "error", err)
	}
}
