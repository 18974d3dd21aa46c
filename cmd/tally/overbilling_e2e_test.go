package main

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// TestOverBillingInAConfirmedHourEndToEnd is over-billing seen end to
// end: after `tally reconcile` confirms an hour, an extra event
// that Stripe counts in that hour — sent straight to the simulator, as a
// second integration would — makes the next `tally reconcile` find Stripe
// having more and exit 2, naming it first; the console's overview shows
// it, linking to it; finance resolves it (credited in Stripe, confirming
// nothing a second time), and the next run exits 0 with nothing open.
func TestOverBillingInAConfirmedHourEndToEnd(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{Seed: 35})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "api", EventName: "api", Formula: "sum"})
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_acme")
	env := stagetest.New(t, outbox.Config{})
	env.Target.Account = stripesim.DefaultAccount
	env.Feature(t, "api", mappings.Sum, time.Hour)
	env.Tenant(t, "acme", nil)
	url := testdb.URLOf(t, env.Pool)
	stripeFlags := []string{"--stripe-api-key", stripesim.DefaultKey, "--stripe-api-base", srv.URL, "--invoice-grace", "72h"}
	reconcileCmd := func(args ...string) (int, string, string) {
		t.Helper()
		return tally(t, url, append(append([]string{"reconcile"}, args...), stripeFlags...)...)
	}

	// Usage of one hour, exported and accepted; the first run confirms it.
	hour := time.Now().UTC().Add(-4 * time.Hour).Truncate(time.Hour)
	at := hour.Add(10 * time.Minute)
	env.MustIngest(t, stagetest.Ev("u1", "acme", "api", 10, &at), stagetest.Ev("u2", "acme", "api", 4, &at))
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	deliverAll(t, env, exporter.NewStripeV1(client, 5*time.Second))
	code, out, errs := reconcileCmd("--settle", "0s")
	require.Equal(t, 0, code, "%s\n%s", out, errs)
	var items []int64
	rows, err := env.Pool.Query(env.Ctx, `SELECT id FROM outbox_items WHERE state = 'confirmed' ORDER BY id`)
	require.NoError(t, err)
	for rows.Next() {
		var id int64
		require.NoError(t, rows.Scan(&id))
		items = append(items, id)
	}
	require.NoError(t, rows.Err())
	require.Len(t, items, 1, "the hour's window, confirmed")

	// Another integration sends 3 more to the same meter and customer in
	// that hour.
	_, err = client.Stripe().V1BillingMeterEvents.Create(env.Ctx, &stripe.BillingMeterEventCreateParams{
		EventName: stripe.String("api"), Identifier: stripe.String("another-integration-1"), Timestamp: stripe.Int64(at.Add(5 * time.Minute).Unix()),
		Payload: map[string]string{"stripe_customer_id": "cus_acme", "value": "3"}})
	require.NoError(t, err)

	code, out, errs = reconcileCmd("--settle", "0s")
	require.Equal(t, 2, code, "a discrepancy is open: %s\n%s", out, errs)
	require.Contains(t, out, "stripe_has_more")
	require.Contains(t, out, "1 where Stripe has more: a customer may be billed too much")
	require.Contains(t, errs, "1 discrepancies are open")
	code, out, errs = tally(t, url, "reconcile", "discrepancies", "--format", "json")
	require.Equal(t, 0, code, errs)
	var list struct {
		Discrepancies []struct {
			ID             int64   `json:"id"`
			Kind           string  `json:"kind"`
			Expected       string  `json:"expected"`
			Provider       string  `json:"provider"`
			ConfirmedItems []int64 `json:"confirmed_items"`
		} `json:"discrepancies"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &list), out)
	require.Len(t, list.Discrepancies, 1)
	d := list.Discrepancies[0]
	require.Equal(t, "stripe_has_more", d.Kind)
	require.Equal(t, "14", d.Expected)
	require.Equal(t, "17", d.Provider)
	require.Equal(t, items, d.ConfirmedItems, "Stripe's number moved after the hour was confirmed")

	// The console's overview shows it, first, and links to it.
	site := consoleOf(t, env)
	overview := site.get(t, "/console/")
	require.Contains(t, overview, "Stripe counts more than Tally in 1 hour: a customer may be billed too much")
	require.Contains(t, overview, `href="/console/discrepancies?kind=stripe_has_more" data-testid="open-stripe_has_more"><div class="n bad">1</div>`)
	require.Contains(t, site.get(t, "/console/reconcile"), `id="discrepancy-`+strconv.FormatInt(d.ID, 10)+`"`)

	// Finance credits the customer in Stripe and resolves it: nothing is
	// confirmed again, nothing is open, and the next run exits 0.
	code, out, errs = tally(t, url, "reconcile", "resolve", strconv.FormatInt(d.ID, 10), "--reason", "credited_in_stripe",
		"--note", "credited 3 calls on invoice in_123")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, "0 accepted items confirmed")
	code, out, errs = reconcileCmd("--settle", "0s")
	require.Equal(t, 0, code, "%s\n%s", out, errs)
	require.NotContains(t, out, "open discrepancies")
	code, out, _ = tally(t, url, "reconcile", "discrepancies")
	require.Equal(t, 0, code)
	require.Contains(t, out, "0 open discrepancies")
	require.NotContains(t, site.get(t, "/console/"), "Stripe counts more than Tally")
}

// deliverAll stages what is due and sends every pending item through exp
// until none is pending or leased, as the deliverer does.
func deliverAll(t *testing.T, env *stagetest.Env, exp exporter.Exporter) {
	t.Helper()
	env.Pass(t)
	for deadline := time.Now().Add(30 * time.Second); ; {
		leases, err := env.Outbox.Claim(env.Ctx, env.Pool, outbox.ClaimOptions{Owner: "test", Limit: 100})
		require.NoError(t, err)
		if len(leases) == 0 {
			g, err := env.Outbox.ReadGauge(env.Ctx, env.Pool)
			require.NoError(t, err)
			if g.Counts[outbox.StatePending]+g.Counts[outbox.StateLeased] == 0 {
				return
			}
			require.False(t, time.Now().After(deadline), "items never drained: %v", g.Counts)
			time.Sleep(5 * time.Millisecond)
			continue
		}
		outcomes := make([]outbox.Outcome, len(leases))
		for i, l := range leases {
			outcomes[i] = exp.Send(env.Ctx, l)
			outcomes[i].Lease = l
		}
		_, err = env.Outbox.Record(env.Ctx, env.Pool, outcomes)
		require.NoError(t, err)
	}
}

// consoleSite is the console on env's database, signed in as finance.
type consoleSite struct {
	url    string
	client *http.Client
}

func consoleOf(t *testing.T, env *stagetest.Env) *consoleSite {
	t.Helper()
	con, err := console.New(console.Deps{Pool: env.Pool, Outbox: env.Outbox, Mappings: env.Maps,
		Requeuer: &quarantine.Requeuer{Outbox: env.Outbox, Stager: env.Stager}, Settle: 2 * time.Hour,
		Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	srv := httptest.NewServer(api.New(api.Options{Console: con.Handler(), Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)
	tok, err := auth.CreateToken(env.Ctx, env.Pool, "fiona", auth.RoleFinance, nil)
	require.NoError(t, err)
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	c := &http.Client{Jar: jar}
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/console/login", strings.NewReader(url.Values{"token": {tok.Secret}}.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", srv.URL)
	resp, err := c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "signed in, redirected to the overview")
	return &consoleSite{url: srv.URL, client: c}
}

// get reads a console page.
func (s *consoleSite) get(t *testing.T, path string) string {
	t.Helper()
	resp, err := s.client.Get(s.url + path)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	return string(b)
}
