package console_test

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/outbox"
)

// fullLimiter refuses every read, recording the tokens it was asked for.
type fullLimiter struct {
	mu     sync.Mutex
	tokens []int64
}

func (f *fullLimiter) Acquire(token int64) (func(), bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.tokens = append(f.tokens, token)
	return nil, false
}

func (f *fullLimiter) RetryAfter() time.Duration { return 3 * time.Second }

func TestExpensivePagesOverTheBoundAnswer429WithAPageSayingSo(t *testing.T) {
	t.Parallel()
	env := stagetest.New(t, outbox.Config{})
	limit := &fullLimiter{}
	con, err := console.New(console.Deps{Pool: env.Pool, Outbox: env.Outbox, Mappings: env.Maps, ReadLimit: limit,
		Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	srv := httptest.NewServer(api.New(api.Options{Console: con.Handler(), Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(srv.Close)
	tok, err := auth.CreateToken(env.Ctx, env.Pool, "fred", auth.RoleFinance, nil)
	require.NoError(t, err)
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	c := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/console/login", strings.NewReader(url.Values{"token": {tok.Secret}}.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", srv.URL) // as a browser posting the console's own sign-in form
	resp, err := c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)

	for _, page := range []string{"/console/completeness", "/console/mappings", "/console/quarantine",
		"/console/quarantine.csv", "/console/reconcile"} {
		resp, err := c.Get(srv.URL + page)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusTooManyRequests, resp.StatusCode, page)
		require.Equal(t, "3", resp.Header.Get("Retry-After"), page)
		require.Contains(t, string(body), "reload this page in 3 seconds", page)
	}
	for _, page := range []string{"/console/", "/console/uncertain"} {
		resp, err := c.Get(srv.URL + page)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s is not bounded", page)
	}
	limit.mu.Lock()
	defer limit.mu.Unlock()
	require.Len(t, limit.tokens, 5)
	for _, id := range limit.tokens {
		require.Equal(t, tok.TokenID, id, "the slot asked for is the session's token's")
	}
}
