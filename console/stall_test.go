package console_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// While export is stalled every page says so, with each reason and what
// waits in the ledger meanwhile; once it resumes the banner is gone.
// (Plain HTTP: this runs without a browser.)
func TestEveryPageShowsABannerWhileExportIsStalled(t *testing.T) {
	t.Parallel()
	env := stagetest.New(t, outbox.Config{})
	env.Feature(t, "api", mappings.Sum, time.Hour)
	env.Stager.Target = func(context.Context) (meter.Target, bool) { return meter.Target{}, false }
	env.MustIngest(t, stagetest.Ev("a1", "acme", "api", 5, stagetest.Ago(time.Hour)), stagetest.Ev("a2", "acme", "api", 1, nil))

	var stalled atomic.Bool
	stalled.Store(true)
	con, err := console.New(console.Deps{Pool: env.Pool, Outbox: env.Outbox, Mappings: env.Maps,
		Requeuer: &quarantine.Requeuer{Outbox: env.Outbox, Stager: env.Stager}, Logger: slog.New(slog.DiscardHandler),
		ExportStalls: func(context.Context) []console.ExportStall {
			if !stalled.Load() {
				return nil
			}
			return []console.ExportStall{{Reason: "no_key", Text: "STRIPE_API_KEY is unset on this node."}}
		}})
	require.NoError(t, err)
	srv := httptest.NewServer(api.New(api.Options{Console: con.Handler(), Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)
	tok, err := auth.CreateToken(env.Ctx, env.Pool, "fred", auth.RoleFinance, nil)
	require.NoError(t, err)
	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar}
	resp, err := postSignIn(client, srv.URL, tok.Secret)
	require.NoError(t, err)
	resp.Body.Close()
	get := func(path string) string {
		t.Helper()
		resp, err := client.Get(srv.URL + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, path)
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return string(b)
	}

	pages := []string{"/console/", "/console/quarantine", "/console/uncertain", "/console/mappings", "/console/reconcile", "/console/completeness"}
	for _, p := range pages {
		page := get(p)
		require.Contains(t, page, `data-testid="export-stalled"`, p)
		require.Contains(t, page, `data-testid="stall-no_key"`, p)
		require.Contains(t, page, "STRIPE_API_KEY is unset on this node.", p)
		require.Contains(t, page, "2 events wait in the ledger", p)
	}
	stalled.Store(false)
	for _, p := range pages {
		require.NotContains(t, get(p), `data-testid="export-stalled"`, p)
	}
}

// For each reason export stalls, the banner names the alert that fires on
// it (one that deploy/prometheus/alerts.yml defines), links that alert's
// section of the runbook, and counts the items waiting pending, not only
// the events waiting in the ledger.
func TestTheStallBannerNamesEachReasonsAlertAndLinksItsRunbook(t *testing.T) {
	t.Parallel()
	alerts, err := os.ReadFile("../deploy/prometheus/alerts.yml")
	require.NoError(t, err)
	runbook, err := os.ReadFile("../docs/operations.md")
	require.NoError(t, err)
	want := map[exporter.StallReason]string{
		exporter.StallNoKey: "TallyExportNoKey", exporter.StallKeyRefused: "TallyExportKeyRefused",
		exporter.StallStripeUnreachable: "TallyExportStripeUnreachable", exporter.StallRetrying: "TallyExportRetrying",
		exporter.StallAccountRefused: "TallyConnectedAccountRefused", exporter.StallMeterDeactivated: "TallyMeterDeactivated",
	}
	require.Len(t, want, len(exporter.StallReasons()), "a reason without an alert")

	env := stagetest.New(t, outbox.Config{})
	env.Feature(t, "api", mappings.Sum, time.Hour)
	_, _, err = env.Maps.PutTenant(env.Ctx, env.Pool, "beta", mappings.TenantInput{StripeCustomerID: "cus_beta"}, "test")
	require.NoError(t, err)
	env.MustIngest(t, stagetest.Ev("b1", "beta", "api", 4, stagetest.Ago(3*time.Hour)),
		stagetest.Ev("b2", "beta", "api", 1, stagetest.Ago(3*time.Hour)))
	env.Pass(t) // one pending item, summing both
	env.MustIngest(t, stagetest.Ev("b3", "beta", "api", 1, nil))

	var reason atomic.Value
	con, err := console.New(console.Deps{Pool: env.Pool, Outbox: env.Outbox, Mappings: env.Maps,
		Requeuer: &quarantine.Requeuer{Outbox: env.Outbox, Stager: env.Stager}, Logger: slog.New(slog.DiscardHandler),
		ExportStalls: func(context.Context) []console.ExportStall {
			r, _ := reason.Load().(exporter.StallReason)
			if r == "" {
				return nil // the sign-in's redirect, before the first reason
			}
			return []console.ExportStall{{Reason: string(r), Text: r.Explain()}}
		}})
	require.NoError(t, err)
	srv := httptest.NewServer(api.New(api.Options{Console: con.Handler(), Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)
	tok, err := auth.CreateToken(env.Ctx, env.Pool, "olga", auth.RoleOperator, nil)
	require.NoError(t, err)
	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar}
	resp, err := postSignIn(client, srv.URL, tok.Secret)
	require.NoError(t, err)
	resp.Body.Close()

	for r, alert := range want {
		require.Contains(t, string(alerts), "alert: "+alert+"\n", r)
		require.Contains(t, string(runbook), "\n## "+alert+"\n", r)
		reason.Store(r)
		resp, err := client.Get(srv.URL + "/console/")
		require.NoError(t, err)
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		page := string(b)
		require.Contains(t, page, `data-testid="stall-`+string(r)+`"`, r)
		require.Contains(t, page, "(alert <code>"+alert+"</code>)", r)
		require.Contains(t, page, `<a href="`+console.DefaultRunbook+"#"+strings.ToLower(alert)+`" data-testid="runbook-`+alert+`">`, r)
		require.Contains(t, page, "1 item waits pending in the outbox", r)
		require.Contains(t, page, "1 event waits in the ledger", r)
		require.NotContains(t, page, "TallyExportStalled", r)
	}
}
