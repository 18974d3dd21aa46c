package console_test

import (
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/mappings"
)

// The mappings page shows each feature's payload keys. On a node whose
// Stripe key is restricted (rk_…) the feature form does not offer the v2
// stream, says why, and a forged form that names it saves nothing. (Plain
// HTTP: this runs without a browser.)
func TestMappingsPageShowsPayloadKeysAndHidesTheStreamForARestrictedKey(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	sim := stripesim.New(stripesim.Options{})
	simSrv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); simSrv.Close() })
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "tokens", Formula: "sum", CustomerPayloadKey: "account", ValuePayloadKey: "n"})
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: simSrv.URL})
	require.NoError(t, err)
	store := &mappings.Store{Checker: mappings.StripeMeters{Client: c}, RestrictedKey: true}
	con, err := console.New(console.Deps{Pool: s.env.Pool, Outbox: s.env.Outbox, Mappings: store, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	srv := httptest.NewServer(api.New(api.Options{Console: con.Handler(), Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)

	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar}
	get := func(path string) string {
		t.Helper()
		resp, err := client.Get(srv.URL + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return string(b)
	}
	resp, err := postSignIn(client, srv.URL, s.token(t, "olive", auth.RoleOperator))
	require.NoError(t, err)
	resp.Body.Close()
	page := get("/console/mappings")
	m := csrfPattern.FindStringSubmatch(page)
	require.NotNil(t, m)
	csrf := m[1]

	require.Contains(t, page, `<td data-testid="customer-key">stripe_customer_id</td><td data-testid="value-key">value</td>`,
		"api, mapped without a checker, shows Stripe's default keys")
	require.Contains(t, page, `data-testid="restricted-key"`)
	form := page[strings.Index(page, `data-testid="feature-form"`):]
	form = form[:strings.Index(form, "</form>")]
	require.Contains(t, form, `<option value="stripe_meter_events">`)
	require.NotContains(t, form, "stripe_meter_event_stream", "the stream is not offered")

	save := func(exporter string) string {
		t.Helper()
		return postMapping(t, client, srv.URL+"/console/mappings/features", url.Values{"csrf": {csrf}, "feature": {"tokens"},
			"event_name": {"tokens"}, "aggregation": {"sum"}, "exporter": {exporter}})
	}
	require.Equal(t, "refused invalid_mapping", save(mappings.ExporterStripeMeterEventStream), "a forged form naming the stream")
	_, err = store.GetFeature(s.env.Ctx, s.env.Pool, "tokens")
	require.ErrorIs(t, err, mappings.ErrNotFound, "nothing saved")

	require.Equal(t, "saved feature_saved", save(""))
	page = get("/console/mappings")
	require.Contains(t, page, `<td data-testid="customer-key">account</td><td data-testid="value-key">n</td>`, "the meter's own keys")
	require.Contains(t, page, "keys customer=account value=n", "the history shows the keys")
}

var refusalPattern = regexp.MustCompile(`data-testid="flash" data-code="([a-z_]+)"`)

// postMapping posts a mapping form and says what the console answered:
// "saved <flash>" after the redirect of a saved mapping, "refused <code>"
// for a refused one (the page it redirects to, with the refusal).
func postMapping(t *testing.T, client *http.Client, to string, form url.Values) string {
	t.Helper()
	resp, err := client.PostForm(to, form)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	if m := refusalPattern.FindStringSubmatch(string(b)); m != nil {
		require.True(t, strings.HasSuffix(resp.Request.URL.String(), "/console/mappings"), "a refusal redirects to the page too")
		return "refused " + m[1]
	}
	return "saved " + resp.Request.URL.Query().Get("flash")
}

// On a node without a Stripe key, the mappings page says mappings are
// saved unchecked, and the history shows each unchecked change's reason; a
// customer id that is not one is refused on the page with the code the API
// gives.
func TestMappingsPageSaysMappingsAreUncheckedWithoutAKey(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar}
	resp, err := postSignIn(client, s.url, s.token(t, "olive", auth.RoleOperator))
	require.NoError(t, err)
	resp.Body.Close()
	page := func() string {
		t.Helper()
		resp, err := client.Get(s.url + "/console/mappings")
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return string(b)
	}
	p := page()
	require.Contains(t, p, `data-testid="unchecked">Mappings are `+html.EscapeString(mappings.UncheckedWarning))
	csrf := csrfPattern.FindStringSubmatch(p)[1]

	to := s.url + "/console/mappings/tenants"
	require.Equal(t, "refused invalid_mapping", postMapping(t, client, to, url.Values{"csrf": {csrf}, "tenant": {"acme"}, "customer": {"acct_1"}}))
	require.Equal(t, "saved tenant_saved", postMapping(t, client, to, url.Values{"csrf": {csrf}, "tenant": {"acme"}, "customer": {"cus_typo"}}))
	require.Contains(t, page(), "cus_typo calendar months ("+mappings.UncheckedReason+")", "the history shows it was not checked")
}

// The tenants table shows each tenant's invoice grace ("node default"
// when its mapping names none), and the tenant form sets it: empty is the
// node's default; no duration, or one Stripe does not allow, is refused
// on the page with the API's code, and nothing is saved.
func TestMappingsPageShowsTheTenantsInvoiceGrace(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar}
	resp, err := postSignIn(client, s.url, s.token(t, "olive", auth.RoleOperator))
	require.NoError(t, err)
	resp.Body.Close()
	page := func() string {
		t.Helper()
		resp, err := client.Get(s.url + "/console/mappings")
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return string(b)
	}
	p := page()
	csrf := csrfPattern.FindStringSubmatch(p)[1]
	form := p[strings.Index(p, `data-testid="tenant-form"`):]
	form = form[:strings.Index(form, "</form>")]
	require.Contains(t, form, `<input name="invoice_grace" placeholder="node default"`)
	graceOf := func(page, tenant string) string {
		t.Helper()
		m := regexp.MustCompile(`<tr data-testid="tenant-` + tenant + `">.*?<td data-testid="invoice-grace">([^<]*)</td>`).FindStringSubmatch(page)
		require.NotNil(t, m, "tenant %s in the table", tenant)
		return m[1]
	}
	require.Equal(t, "node default", graceOf(p, "beta"))

	to := s.url + "/console/mappings/tenants"
	save := func(tenant, grace string) string {
		t.Helper()
		return postMapping(t, client, to, url.Values{"csrf": {csrf}, "tenant": {tenant}, "customer": {"cus_" + tenant}, "invoice_grace": {grace}})
	}
	require.Equal(t, "saved tenant_saved", save("acme", " 90m "))
	require.Equal(t, "saved tenant_saved", save("zeta", ""))
	p = page()
	require.Equal(t, "1h30m0s", graceOf(p, "acme"))
	require.Equal(t, "node default", graceOf(p, "zeta"))
	require.Equal(t, "node default", graceOf(p, "beta"))
	require.Contains(t, p, "cus_acme calendar months grace 1h30m0s", "the history shows it")

	for _, bad := range []string{"soon", "73h", "-1h", "1.5s"} {
		require.Equal(t, "refused invalid_mapping", save("acme", bad), bad)
	}
	tn, err := s.env.Maps.GetTenant(s.env.Ctx, s.env.Pool, "acme")
	require.NoError(t, err)
	require.NotNil(t, tn.InvoiceGrace)
	require.Equal(t, mappings.Duration(90*time.Minute), *tn.InvoiceGrace, "nothing refused was saved")
	require.Equal(t, "1h30m0s", graceOf(page(), "acme"))
}
