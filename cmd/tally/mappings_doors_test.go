package main

import (
	"context"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// doorsAdmin is the admin token of TestTheSameBadMappingIsRefusedAtEveryDoor.
const doorsAdmin = "doors-admin-token-0123456789abcdef"

// A bad mapping — a meter Stripe does not have, a customer it does not
// have, a customer it deleted — is refused alike by the API, by `tally
// mappings … set` and by the console, with the same code, and saved by
// none; a good one passes every door.
func TestTheSameBadMappingIsRefusedAtEveryDoor(t *testing.T) {
	t.Parallel()
	d := newDoors(t)
	for _, tc := range []struct {
		name string
		kind string // features or tenants
		api  map[string]string
		cli  []string
		form url.Values
		code string
	}{
		{"unknown meter", "features", map[string]string{"event_name": "api_callz", "aggregation": "sum"},
			[]string{"--event-name", "api_callz", "--aggregation", "sum"}, url.Values{"event_name": {"api_callz"}, "aggregation": {"sum"}}, "meter_not_found"},
		{"unknown customer", "tenants", map[string]string{"stripe_customer_id": "cus_acmee"},
			[]string{"--customer", "cus_acmee"}, url.Values{"customer": {"cus_acmee"}}, "customer_not_found"},
		{"deleted customer", "tenants", map[string]string{"stripe_customer_id": "cus_gone"},
			[]string{"--customer", "cus_gone"}, url.Values{"customer": {"cus_gone"}}, "customer_deleted"},
	} {
		name := map[string]string{"features": "api_calls", "tenants": "acme"}[tc.kind]
		code, body := post(t, http.MethodPut, d.base+"/v1/mappings/"+tc.kind+"/"+name, doorsAdmin, tc.api)
		require.Equal(t, http.StatusUnprocessableEntity, code, "API, %s: %s", tc.name, body)
		require.Contains(t, body, `"code":"`+tc.code+`"`, "API, %s", tc.name)

		status, _, stderr := d.cli(append([]string{"mappings", tc.kind, "set", name}, tc.cli...)...)
		require.Equal(t, 1, status, "CLI, %s: %s", tc.name, stderr)
		require.Contains(t, stderr, tc.code+": ", "CLI, %s", tc.name)

		field := map[string]string{"features": "feature", "tenants": "tenant"}[tc.kind]
		tc.form.Set(field, name)
		require.Equal(t, "refused "+tc.code, d.console(tc.kind, tc.form), "console, %s", tc.name)

		code, body = post(t, http.MethodGet, d.base+"/v1/mappings/"+tc.kind+"/"+name, doorsAdmin, nil)
		require.Equal(t, http.StatusNotFound, code, "%s: nothing saved: %s", tc.name, body)
	}

	status, out, stderr := d.cli("mappings", "tenants", "set", "acme", "--customer", "cus_acme")
	require.Equal(t, 0, status, stderr)
	require.NotContains(t, out+stderr, "warning", "checked against Stripe")
	require.Equal(t, "saved feature_saved", d.console("features", url.Values{"feature": {"api_calls"}, "event_name": {"api_calls"}, "aggregation": {"sum"}}))
	code, body := post(t, http.MethodPut, d.base+"/v1/mappings/tenants/globex", doorsAdmin, map[string]string{"stripe_customer_id": "cus_globex"})
	require.Equal(t, http.StatusOK, code, body)
	require.NotContains(t, body, "warning")
}

// doors is a `tally serve` node on a simulator, the environment its CLI
// runs with, and a console session.
type doors struct {
	t      *testing.T
	base   string
	env    []string
	client *http.Client
	csrf   string
}

func newDoors(t *testing.T) *doors {
	t.Helper()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "api_calls", Formula: "sum"})
	for _, id := range []string{"cus_acme", "cus_globex", "cus_gone"} {
		sim.CreateCustomer(stripesim.DefaultAccount, id)
	}
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	_, err = c.Stripe().V1Customers.Delete(context.Background(), "cus_gone", nil)
	require.NoError(t, err)

	env := []string{"TALLY_DATABASE_URL=" + testdb.URL(t), "STRIPE_API_KEY=" + stripesim.DefaultKey,
		"STRIPE_API_BASE=" + srv.URL, "STRIPE_METER_EVENTS_BASE=" + srv.URL, "TALLY_LOG_LEVEL=warn"}
	n := &node{t: t, addr: freeAddr(t), env: append(env, "TALLY_ADMIN_TOKEN="+doorsAdmin)}
	n.env = append(n.env, "TALLY_LISTEN="+n.addr)
	n.start()
	t.Cleanup(n.stop)
	d := &doors{t: t, base: "http://" + n.addr, env: env}
	d.signIn()
	return d
}

// cli runs tally with the node's database and Stripe settings.
func (d *doors) cli(args ...string) (int, string, string) {
	d.t.Helper()
	var out, errb strings.Builder
	cmd := exec.Command(binary, args...)
	cmd.Env = append(os.Environ(), d.env...)
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), out.String(), errb.String()
	}
	require.NoError(d.t, err)
	return 0, out.String(), errb.String()
}

var (
	doorsCSRF    = regexp.MustCompile(`name="csrf" value="([^"]+)"`)
	doorsRefusal = regexp.MustCompile(`data-testid="flash" data-code="([a-z_]+)"`)
)

// signIn signs in to the console with the admin token and keeps the page's
// CSRF token.
func (d *doors) signIn() {
	d.t.Helper()
	jar, _ := cookiejar.New(nil)
	d.client = &http.Client{Jar: jar}
	req, err := http.NewRequest(http.MethodPost, d.base+"/console/login", strings.NewReader(url.Values{"token": {doorsAdmin}}.Encode()))
	require.NoError(d.t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", d.base)
	resp, err := d.client.Do(req)
	require.NoError(d.t, err)
	resp.Body.Close()
	resp, err = d.client.Get(d.base + "/console/mappings")
	require.NoError(d.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(d.t, err)
	m := doorsCSRF.FindSubmatch(b)
	require.NotNil(d.t, m, "signed in: %s", b)
	d.csrf = string(m[1])
}

// console posts the mappings form of kind and says what the console
// answered: "saved <flash>" or "refused <code>".
func (d *doors) console(kind string, form url.Values) string {
	d.t.Helper()
	form.Set("csrf", d.csrf)
	req, err := http.NewRequest(http.MethodPost, d.base+"/console/mappings/"+kind, strings.NewReader(form.Encode()))
	require.NoError(d.t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", d.base)
	resp, err := d.client.Do(req)
	require.NoError(d.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(d.t, err)
	require.Equal(d.t, http.StatusOK, resp.StatusCode, "%s", b)
	if m := doorsRefusal.FindSubmatch(b); m != nil {
		return "refused " + string(m[1])
	}
	return "saved " + resp.Request.URL.Query().Get("flash")
}

// Without a Stripe key, `tally mappings … set` saves the mapping and says,
// on stderr and in its JSON, that it was not checked.
func TestMappingsSetWithoutAKeyWarns(t *testing.T) {
	t.Parallel()
	d := &doors{t: t, env: []string{"TALLY_DATABASE_URL=" + testdb.URL(t), "TALLY_DATA_DIR=" + t.TempDir()}}
	status, out, stderr := d.cli("mappings", "tenants", "set", "acme", "--customer", "cus_typo")
	require.Equal(t, 0, status, stderr)
	require.Contains(t, stderr, "warning: saved without checking Stripe")
	require.Contains(t, out, `"warning": "saved without checking Stripe`)
}

// `tally mappings tenants set --invoice-grace` sets the tenant mapping's
// invoice grace (shown as Go's duration text), versioned like its other
// fields; left out, the mapping names none (the node's TALLY_INVOICE_GRACE,
// which is never read as the mapping's). A value that is no duration, or
// not one Stripe allows, is a usage error that saves nothing.
func TestMappingsTenantsSetInvoiceGrace(t *testing.T) {
	t.Parallel()
	d := &doors{t: t, env: []string{"TALLY_DATABASE_URL=" + testdb.URL(t), "TALLY_DATA_DIR=" + t.TempDir()}}
	set := func(args ...string) (int, string, string) {
		t.Helper()
		return d.cli(append([]string{"mappings", "tenants", "set", "acme", "--customer", "cus_1"}, args...)...)
	}
	status, out, stderr := set("--invoice-grace", "2h")
	require.Equal(t, 0, status, stderr)
	require.Contains(t, out, `"invoice_grace": "2h0m0s"`)
	require.Contains(t, out, `"changed": true`)
	status, out, stderr = set("--invoice-grace", "120m")
	require.Equal(t, 0, status, stderr)
	require.Contains(t, out, `"changed": false`, "the same grace")

	for _, bad := range []struct{ grace, says string }{
		{"soon", "--invoice-grace: want a duration"},
		{"73h", "invalid_mapping: invalid input: invoice_grace: a duration from 0s to 72h"},
		{"-1h", "invalid_mapping: invalid input: invoice_grace"},
		{"1.5s", "in whole seconds"},
	} {
		status, _, stderr = set("--invoice-grace", bad.grace)
		require.Equal(t, 2, status, "%s: %s", bad.grace, stderr)
		require.Contains(t, stderr, bad.says, bad.grace)
	}
	status, out, stderr = d.cli("mappings", "tenants", "get", "acme")
	require.Equal(t, 0, status, stderr)
	require.Equal(t, 2, strings.Count(out, `"invoice_grace": "2h0m0s"`), "the mapping and its one version; nothing refused was saved: %s", out)

	d.env = append(d.env, "TALLY_INVOICE_GRACE=5h")
	status, out, stderr = set()
	require.Equal(t, 0, status, stderr)
	require.Contains(t, out, `"changed": true`, "left out: the node's default again")
	require.NotContains(t, out, "invoice_grace", "the node's setting is not the mapping's")
	status, out, stderr = d.cli("mappings", "tenants", "-h")
	require.Equal(t, 0, status, stderr)
	require.Contains(t, out+stderr, "the tenant's invoice finalization grace period")
}
