package console_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/console"
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
