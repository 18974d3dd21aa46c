package console_test

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/console"
)

// The console's static files are served, its directories are not listed:
// 404, as for a file that is not there.
func TestStaticServesFilesAndNoDirectoryListing(t *testing.T) {
	t.Parallel()
	con, err := console.New(console.Deps{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	srv := httptest.NewServer(api.New(api.Options{Console: con.Handler(), Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := client.Get(srv.URL + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}

	for _, p := range []string{"/console/static/", "/console/static/.", "/console/static/missing.css"} {
		code, body := get(p)
		require.Equal(t, http.StatusNotFound, code, p)
		require.NotContains(t, body, "style.css", p)
	}
	code, body := get("/console/static/style.css")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, ".stall")
}
