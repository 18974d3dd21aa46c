package console

import (
	"errors"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
)

// unmappedSpan is how far back the mappings page looks for unmapped usage.
const unmappedSpan = 7 * 24 * time.Hour

func (c *Console) mappingsPage(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	fs, err := c.Mappings.Features(ctx, c.pool)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	ts, err := c.Mappings.Tenants(ctx, c.pool)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	missing, err := meter.UnmappedUsage(ctx, c.pool, unmappedSpan)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	history, err := c.mappingHistory(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	// A restricted key cannot use Stripe's v2 API: the stream is not
	// offered (PutFeature would refuse it).
	exporters := mappings.Exporters
	if c.Mappings.RestrictedKey {
		exporters = slices.DeleteFunc(slices.Clone(exporters), func(e string) bool { return e == mappings.ExporterStripeMeterEventStream })
	}
	c.render(w, r, "mappings", "Mappings", struct {
		Features      []mappings.Feature
		Tenants       []mappings.Tenant
		Unmapped      []meter.Unmapped
		History       []audit.Entry
		Exporters     []string
		RestrictedKey bool
	}{fs, ts, missing, history, exporters, c.Mappings.RestrictedKey})
}

// mappingHistory is the mapping changes among the latest 500 audit
// entries.
func (c *Console) mappingHistory(r *http.Request) ([]audit.Entry, error) {
	all, err := audit.List(r.Context(), c.pool, "", 500)
	if err != nil {
		return nil, err
	}
	var history []audit.Entry
	for _, e := range all {
		if e.Action == audit.ActionFeatureMapping || e.Action == audit.ActionTenantMapping {
			history = append(history, e)
		}
	}
	return history, nil
}

func (c *Console) putFeature(w http.ResponseWriter, r *http.Request) {
	var window mappings.Duration
	if s := strings.TrimSpace(r.PostFormValue("window")); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			back(w, r, "/console/mappings", "invalid_mapping")
			return
		}
		window = mappings.Duration(d)
	}
	// The exporter select's first option (empty) is the node's default.
	in := mappings.FeatureInput{EventName: strings.TrimSpace(r.PostFormValue("event_name")),
		Aggregation: mappings.Aggregation(r.PostFormValue("aggregation")), Window: window,
		Exporter: r.PostFormValue("exporter")}
	_, _, err := c.Mappings.PutFeature(r.Context(), c.pool, strings.TrimSpace(r.PostFormValue("feature")), in, actor(r))
	c.mappingResult(w, r, err, "feature_saved")
}

func (c *Console) putTenant(w http.ResponseWriter, r *http.Request) {
	in := mappings.TenantInput{StripeCustomerID: strings.TrimSpace(r.PostFormValue("customer"))}
	_, _, err := c.Mappings.PutTenant(r.Context(), c.pool, strings.TrimSpace(r.PostFormValue("tenant")), in, actor(r))
	c.mappingResult(w, r, err, "tenant_saved")
}

func (c *Console) mappingResult(w http.ResponseWriter, r *http.Request, err error, ok string) {
	var (
		ve *mappings.ValidationError
		me *mappings.MeterError
		pu *mappings.ErrProviderUnavailable
	)
	switch {
	case err == nil:
		back(w, r, "/console/mappings", ok)
	case errors.As(err, &ve), errors.As(err, &me), errors.As(err, &pu):
		back(w, r, "/console/mappings", "invalid_mapping")
	default:
		c.fail(w, r, err)
	}
}
