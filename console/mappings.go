package console

import (
	"encoding/base64"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/httpsec"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
)

// unmappedSpan is how far back the mappings page looks for unmapped usage.
const unmappedSpan = 7 * 24 * time.Hour

// mappingsPage draws the mappings page, with the refusal of the form the
// browser was redirected from, if any (refusalCookie).
func (c *Console) mappingsPage(w http.ResponseWriter, r *http.Request) {
	var refusal *mappings.Refusal
	if ck, err := r.Cookie(refusalCookie); err == nil {
		http.SetCookie(w, &http.Cookie{Name: refusalCookie, Path: refusalPath, MaxAge: -1, HttpOnly: true,
			SameSite: http.SameSiteStrictMode, Secure: httpsec.ClientHTTPS(r)})
		var rf mappings.Refusal
		if b, err := base64.RawURLEncoding.DecodeString(ck.Value); err == nil && json.Unmarshal(b, &rf) == nil && rf.Code != "" {
			refusal = &rf
		}
	}
	c.renderMappings(w, r, refusal)
}

// refusalCookie carries a refused mapping form's refusal, in the mappings
// package's words, across the redirect after the form to the next drawing
// of the mappings page, which clears it. A cookie, not the address: a link
// cannot make the page say anything else, and only this site sets it
// (HttpOnly, SameSite=Strict, a minute at most).
const refusalCookie = "tally_mapping_refusal"

// refusalPath is where the browser sends refusalCookie: the mappings page
// and its forms.
const refusalPath = "/console/mappings"

// maxRefusalCookie bounds refusalCookie's value, under the 4 KiB a
// browser keeps of a cookie.
const maxRefusalCookie = 3000

// mappingsView is what the mappings page shows.
type mappingsView struct {
	Features []mappings.Feature
	Tenants  []mappings.Tenant
	// Accounts are the connected accounts current tenant mappings name,
	// by id, with how many tenants name each.
	Accounts      []accountTenants
	Unmapped      []meter.Unmapped
	History       []audit.Entry
	Exporters     []string
	RestrictedKey bool
	// Unchecked is mappings.UncheckedWarning when this node has no Stripe
	// key to check mappings against.
	Unchecked string
	// Refusal, after a form was refused, is why: the code and message the
	// API and the CLI give for the same mapping.
	Refusal *mappings.Refusal
}

// accountTenants is a connected account and the number of tenants whose
// current mapping names it.
type accountTenants struct {
	Account string
	Tenants int
}

// renderMappings draws the mappings page; after a refused form, with the
// refusal. It answers 200 either way: the page is what the browser asked
// for, and a 4xx would read as a failed load in its console.
func (c *Console) renderMappings(w http.ResponseWriter, r *http.Request, refusal *mappings.Refusal) {
	ctx := r.Context()
	v := mappingsView{Refusal: refusal, RestrictedKey: c.Mappings.RestrictedKey, Unchecked: c.Mappings.Warning()}
	var err error
	if v.Features, err = c.Mappings.Features(ctx, c.pool); err != nil {
		c.fail(w, r, err)
		return
	}
	if v.Tenants, err = c.Mappings.Tenants(ctx, c.pool); err != nil {
		c.fail(w, r, err)
		return
	}
	accounts, err := mappings.CurrentAccounts(ctx, c.pool)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	for a, n := range accounts {
		v.Accounts = append(v.Accounts, accountTenants{Account: a, Tenants: n})
	}
	slices.SortFunc(v.Accounts, func(a, b accountTenants) int { return strings.Compare(a.Account, b.Account) })
	if v.Unmapped, err = meter.UnmappedUsage(ctx, c.pool, unmappedSpan); err != nil {
		c.fail(w, r, err)
		return
	}
	if v.History, err = c.mappingHistory(r); err != nil {
		c.fail(w, r, err)
		return
	}
	// A restricted key cannot use Stripe's v2 API: the stream is not
	// offered (PutFeature would refuse it).
	v.Exporters = mappings.Exporters
	if c.Mappings.RestrictedKey {
		v.Exporters = slices.DeleteFunc(slices.Clone(v.Exporters), func(e string) bool { return e == mappings.ExporterStripeMeterEventStream })
	}
	c.render(w, r, "mappings", "Mappings", v)
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
		if err := window.UnmarshalText([]byte(s)); err != nil {
			c.mappingResult(w, r, &mappings.ValidationError{Fields: []mappings.FieldError{
				{Field: "window", Reason: "a duration dividing a day, e.g. 15m, 1h, 24h"}}}, "")
			return
		}
	}
	// The exporter select's first option (empty) is the node's default.
	in := mappings.FeatureInput{EventName: strings.TrimSpace(r.PostFormValue("event_name")),
		Aggregation: mappings.Aggregation(r.PostFormValue("aggregation")), Window: window,
		Exporter: r.PostFormValue("exporter")}
	_, _, err := c.Mappings.PutFeature(r.Context(), c.pool, strings.TrimSpace(r.PostFormValue("feature")), in, actor(r))
	c.mappingResult(w, r, err, "feature_saved")
}

func (c *Console) putTenant(w http.ResponseWriter, r *http.Request) {
	// An empty account is the node's destination (STRIPE_ACCOUNT, else the
	// key's own account).
	in := mappings.TenantInput{StripeCustomerID: strings.TrimSpace(r.PostFormValue("customer")),
		StripeAccount: strings.TrimSpace(r.PostFormValue("stripe_account"))}
	// An empty invoice grace is the node's default (TALLY_INVOICE_GRACE).
	if s := strings.TrimSpace(r.PostFormValue("invoice_grace")); s != "" {
		g, err := time.ParseDuration(s)
		if err != nil {
			c.mappingResult(w, r, &mappings.ValidationError{Fields: []mappings.FieldError{
				{Field: "invoice_grace", Reason: "a Go duration from 0s to 72h in whole seconds, e.g. 1h, 90m, 72h"}}}, "")
			return
		}
		grace := mappings.Duration(g)
		in.InvoiceGrace = &grace
	}
	_, _, err := c.Mappings.PutTenant(r.Context(), c.pool, strings.TrimSpace(r.PostFormValue("tenant")), in, actor(r))
	c.mappingResult(w, r, err, "tenant_saved")
}

// mappingResult redirects to the mappings page: saved, with the flash
// ok; refused, with the refusal (mappings.RefusalOf, as the API and the CLI
// say it) in refusalCookie.
func (c *Console) mappingResult(w http.ResponseWriter, r *http.Request, err error, ok string) {
	if err == nil {
		back(w, r, "/console/mappings", ok)
		return
	}
	refusal, isRefusal := mappings.RefusalOf(err)
	if !isRefusal {
		c.fail(w, r, err)
		return
	}
	b, err := json.Marshal(refusal)
	if err == nil && base64.RawURLEncoding.EncodedLen(len(b)) > maxRefusalCookie {
		// Too long for a cookie: the code and the start of the message.
		refusal.Fields = nil
		if m := []rune(refusal.Message); len(m) > 300 {
			refusal.Message = string(m[:300]) + "…"
		}
		b, err = json.Marshal(refusal)
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	http.SetCookie(w, &http.Cookie{Name: refusalCookie, Value: base64.RawURLEncoding.EncodeToString(b), Path: refusalPath,
		MaxAge: 60, HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: httpsec.ClientHTTPS(r)})
	http.Redirect(w, r, "/console/mappings", http.StatusSeeOther)
}
