package console

import (
	"html/template"
	"net/http"
	"net/url"
	"time"

	"github.com/tallymeter/tally/quarantine"
)

func (c *Console) completeness(w http.ResponseWriter, r *http.Request) {
	period := r.URL.Query().Get("period")
	if _, _, err := quarantine.ParsePeriod(period); err != nil {
		period = time.Now().UTC().Format("2006-01")
	}
	tenant := r.URL.Query().Get("tenant")
	refresh := r.URL.Query().Get("refresh") == "1"
	rep, err := c.Reports.Completeness(r.Context(), c.pool, period, tenant, refresh)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	// The latest comparison of the counters the report reads with the
	// ledger: one row.
	audit, audited, err := quarantine.LatestAudit(r.Context(), c.pool, period)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var last *quarantine.Audit
	if audited {
		last = &audit
	}
	csvHref := "/console/completeness.csv?" + url.Values{"period": {period}, "tenant": {tenant}}.Encode()
	refreshHref := "/console/completeness?" + url.Values{"period": {period}, "tenant": {tenant}, "refresh": {"1"}}.Encode()
	c.render(w, r, "completeness", "Completeness", struct {
		Period, Tenant string
		RefreshHref    string
		CSVHref        string
		Report         quarantine.Completeness
		Audit          *quarantine.Audit
		Chart          template.HTML
	}{period, tenant, refreshHref, csvHref, rep, last, completenessChart(rep)})
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
