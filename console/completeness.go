package console

import (
	"html/template"
	"net/http"
	"time"

	"github.com/tallymeter/tally/quarantine"
)

func (c *Console) completeness(w http.ResponseWriter, r *http.Request) {
	period := r.URL.Query().Get("period")
	if _, _, err := quarantine.ParsePeriod(period); err != nil {
		period = time.Now().UTC().Format("2006-01")
	}
	tenant := r.URL.Query().Get("tenant")
	rep, err := quarantine.CompletenessOf(r.Context(), c.pool, period, tenant)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "completeness", "Completeness", struct {
		Period, Tenant string
		Report         quarantine.Completeness
		Chart          template.HTML
	}{period, tenant, rep, completenessChart(rep)})
}
