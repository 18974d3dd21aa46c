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

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/mappings"
)

// The tenants table shows each tenant's Stripe account ("node default"
// when its mapping names none) and the connected accounts current mappings
// name, with their tenants; the tenant form sets the account, checked at
// Stripe: an account the platform's key may not act for is refused
// account_unreachable on the page, a customer the account does not have
// customer_not_found naming the account, a malformed id invalid_mapping;
// nothing refused is saved. Empty goes back to the node's destination.
func TestMappingsPageShowsTheTenantsStripeAccount(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	sim := stripesim.New(stripesim.Options{})
	simSrv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); simSrv.Close() })
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_platform")
	sim.CreateCustomer("acct_one", "cus_one")
	sim.CreateCustomer("acct_one", "cus_two")
	sim.CreateCustomer("acct_gone", "cus_gone")
	sim.RevokeAccess("acct_gone")
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: simSrv.URL})
	require.NoError(t, err)
	store := &mappings.Store{Checker: mappings.StripeMeters{Client: c}}
	con, err := console.New(console.Deps{Pool: s.env.Pool, Outbox: s.env.Outbox, Mappings: store, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	srv := httptest.NewServer(api.New(api.Options{Console: con.Handler(), Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)

	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar}
	resp, err := postSignIn(client, srv.URL, s.token(t, "olive", auth.RoleOperator))
	require.NoError(t, err)
	resp.Body.Close()
	page := func() string {
		t.Helper()
		resp, err := client.Get(srv.URL + "/console/mappings")
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return string(b)
	}
	accountOf := func(page, tenant string) string {
		t.Helper()
		m := regexp.MustCompile(`<tr data-testid="tenant-` + tenant + `">.*?<td data-testid="stripe-account">([^<]*)</td>`).FindStringSubmatch(page)
		require.NotNil(t, m, "tenant %s in the table", tenant)
		return m[1]
	}
	p := page()
	csrf := csrfPattern.FindStringSubmatch(p)[1]
	form := p[strings.Index(p, `data-testid="tenant-form"`):]
	form = form[:strings.Index(form, "</form>")]
	require.Contains(t, form, `<input name="stripe_account" placeholder="node default"`)
	require.Equal(t, "node default", accountOf(p, "beta"))
	require.NotContains(t, p, `data-testid="accounts"`, "no tenant names an account")

	to := srv.URL + "/console/mappings/tenants"
	// refused posts the form and returns the refusal's message as the page
	// shows it.
	refused := func(tenant, customer, account, code string) string {
		t.Helper()
		resp, err := client.PostForm(to, url.Values{"csrf": {csrf}, "tenant": {tenant}, "customer": {customer}, "stripe_account": {account}})
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		m := regexp.MustCompile(`data-testid="flash" data-code="([a-z_]+)">([^<]*)`).FindStringSubmatch(string(b))
		require.NotNil(t, m, "%s in %s: refused: %s", customer, account, b)
		require.Equal(t, code, m[1], "%s in %s", customer, account)
		return html.UnescapeString(m[2])
	}
	require.Contains(t, refused("acme", "cus_gone", "acct_gone", "account_unreachable"),
		"the platform's key may not act for Stripe account acct_gone (not connected, or access revoked); connect it first or leave stripe_account empty")
	require.Contains(t, refused("acme", "cus_platform", "acct_one", "customer_not_found"),
		"Stripe has no customer cus_platform in Stripe account acct_one")
	refused("acme", "cus_one", "cus_one", "invalid_mapping")
	_, err = store.GetTenant(s.env.Ctx, s.env.Pool, "acme")
	require.ErrorIs(t, err, mappings.ErrNotFound, "nothing saved")

	save := func(tenant, customer, account string) string {
		t.Helper()
		return postMapping(t, client, to, url.Values{"csrf": {csrf}, "tenant": {tenant}, "customer": {customer}, "stripe_account": {account}})
	}
	require.Equal(t, "saved tenant_saved", save("acme", "cus_one", " acct_one "))
	require.Equal(t, "saved tenant_saved", save("zeta", "cus_two", "acct_one"))
	p = page()
	require.Equal(t, "acct_one", accountOf(p, "acme"))
	require.Equal(t, "acct_one", accountOf(p, "zeta"))
	require.Equal(t, "node default", accountOf(p, "beta"))
	require.Contains(t, p, `<tr data-testid="account-acct_one"><td>acct_one</td><td class="num">2</td></tr>`, "the account and its tenants")
	require.Contains(t, p, "cus_one account acct_one calendar months", "the history shows it")

	require.Equal(t, "saved tenant_saved", save("acme", "cus_platform", ""), "empty: the node's destination")
	p = page()
	require.Equal(t, "node default", accountOf(p, "acme"))
	require.Contains(t, p, `<tr data-testid="account-acct_one"><td>acct_one</td><td class="num">1</td></tr>`)
	tn, err := store.GetTenant(s.env.Ctx, s.env.Pool, "acme")
	require.NoError(t, err)
	require.Empty(t, tn.StripeAccount)
}
