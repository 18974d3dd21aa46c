package console_test

import (
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/internal/auth"
)

// consoleRoutes is every route of the console with what each caller gets:
// no session, a finance session, an operator session (with its CSRF token).
var consoleRoutes = []struct {
	method, pattern, path string
	form                  url.Values
	anon, finance, op     int
}{
	{"GET", "/login", "/console/login", nil, 200, 200, 200},
	{"POST", "/login", "/console/login", url.Values{"token": {"nope"}}, 401, 401, 401},
	{"GET", "/static/*", "/console/static/style.css", nil, 200, 200, 200},
	{"GET", "/", "/console/", nil, 303, 200, 200},
	{"GET", "/quarantine", "/console/quarantine", nil, 303, 200, 200},
	{"GET", "/quarantine.csv", "/console/quarantine.csv", nil, 303, 200, 200},
	{"GET", "/items/{id}", "/console/items/424242", nil, 303, 404, 404},
	{"GET", "/uncertain", "/console/uncertain", nil, 303, 200, 200},
	{"GET", "/mappings", "/console/mappings", nil, 303, 200, 200},
	{"GET", "/reconcile", "/console/reconcile", nil, 303, 200, 200},
	{"GET", "/reconcile/{id}", "/console/reconcile/424242", nil, 303, 404, 404},
	{"GET", "/completeness", "/console/completeness", nil, 303, 200, 200},
	{"GET", "/completeness.csv", "/console/completeness.csv?period=2026-11", nil, 303, 200, 200},
	{"POST", "/items/{id}/requeue", "/console/items/424242/requeue", url.Values{"mapping_version": {"1"}}, 401, 403, 404},
	{"POST", "/quarantine/requeue", "/console/quarantine/requeue", url.Values{"reason": {"no_customer"}, "after": {"0"}}, 401, 403, 303},
	{"POST", "/items/{id}/recover", "/console/items/424242/recover", url.Values{"expect": {"uncertain"}, "to": {"pending"}}, 401, 403, 404},
	{"POST", "/mappings/features", "/console/mappings/features", url.Values{"feature": {"f1"}, "event_name": {"e1"}, "aggregation": {"sum"}}, 401, 403, 303},
	{"POST", "/mappings/tenants", "/console/mappings/tenants", url.Values{"tenant": {"t1"}, "customer": {"cus_1"}}, 401, 403, 303},
	{"POST", "/reconcile/runs", "/console/reconcile/runs", url.Values{"settle": {"1h"}}, 401, 403, 303},
	{"POST", "/reconcile/discrepancies/{id}/resolve", "/console/reconcile/discrepancies/424242/resolve", url.Values{"reason": {"reposted"}, "note": {"re-posted"}}, 401, 303, 303},
	{"GET", "/discrepancies", "/console/discrepancies?tenant=acme", nil, 303, 200, 200},
	{"GET", "/invoices", "/console/invoices", nil, 303, 200, 200},
	{"POST", "/invoices/checks/{id}/resolve", "/console/invoices/checks/424242/resolve", url.Values{"reason": {"accept_tally"}, "note": {"n"}}, 401, 303, 303},
	{"GET", "/uncertain/review", "/console/uncertain/review?to=accepted&item=424242", nil, 303, 403, 200},
	{"POST", "/uncertain/recover", "/console/uncertain/recover", url.Values{"to": {"accepted"}, "item": {"424242:1"}}, 401, 403, 303},
	{"GET", "/reconcile/{id}/plan", "/console/reconcile/424242/plan", nil, 303, 403, 404},
	{"POST", "/reconcile/{id}/plan", "/console/reconcile/424242/plan", nil, 401, 403, 404},
	{"POST", "/logout", "/console/logout", nil, 401, 303, 303},
}

var csrfPattern = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// Every console route, for every caller: the table lists them all (checked
// against the router), and each answers as it says. POSTs carry the
// site's origin, as a browser posting the console's forms does.
func TestConsoleAuthorizationTable(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	con, err := console.New(console.Deps{Pool: s.env.Pool, Outbox: s.env.Outbox, Mappings: s.env.Maps})
	require.NoError(t, err)
	var got, want []string
	require.NoError(t, chi.Walk(con.Handler().(chi.Routes), func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		got = append(got, method+" "+route)
		return nil
	}))
	for _, r := range consoleRoutes {
		want = append(want, r.method+" "+r.pattern)
	}
	require.ElementsMatch(t, want, got, "consoleRoutes must list every console route")

	session := func(role auth.Role) (*http.Client, string) {
		jar, _ := cookiejar.New(nil)
		c := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		resp, err := postSignIn(c, s.url, s.token(t, "t-"+string(role), role))
		require.NoError(t, err)
		resp.Body.Close()
		resp, err = c.Get(s.url + "/console/")
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		m := csrfPattern.FindSubmatch(b)
		require.NotNil(t, m, "the page carries the session's CSRF token")
		return c, string(m[1])
	}
	anon := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	fin, finCSRF := session(auth.RoleFinance)
	op, opCSRF := session(auth.RoleOperator)
	for _, r := range consoleRoutes {
		for _, c := range []struct {
			name   string
			client *http.Client
			csrf   string
			want   int
		}{{"no session", anon, "", r.anon}, {"finance", fin, finCSRF, r.finance}, {"operator", op, opCSRF, r.op}} {
			var resp *http.Response
			var err error
			if r.method == "GET" {
				resp, err = c.client.Get(s.url + r.path)
			} else {
				form := url.Values{}
				for k, v := range r.form {
					form[k] = v
				}
				if c.csrf != "" {
					form.Set("csrf", c.csrf)
				}
				req, rerr := http.NewRequest(http.MethodPost, s.url+r.path, strings.NewReader(form.Encode()))
				require.NoError(t, rerr)
				req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
				req.Header.Set("Origin", s.url) // as a browser posting the console's own forms
				resp, err = c.client.Do(req)
			}
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, c.want, resp.StatusCode, "%s %s as %s", r.method, r.path, c.name)
			if r.method == "GET" && resp.StatusCode == 200 && r.pattern != "/static/*" {
				require.Contains(t, resp.Header.Get("Content-Security-Policy"), "default-src 'none'")
			}
		}
	}
}
