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
	refreshHref := "/console/completeness?" + url.Values{"period": {period}, "tenant": {tenant}, "refresh": {"1"}}.Encode()
	c.render(w, r, "completeness", "Completeness", struct {
		Period, Tenant string
		RefreshHref    string
		Report         quarantine.Completeness
		Chart          template.HTML
	}{period, tenant, refreshHref, rep, completenessChart(rep)})
}
