package console_test

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/outbox"
)

// signInSite is a console on an empty database, without a browser: the
// console itself (to call its handler with any client address), and a
// server of it.
type signInSite struct {
	env     *stagetest.Env
	con     *console.Console
	handler http.Handler
	url     string
}

func newSignInSite(t *testing.T, d console.Deps) *signInSite {
	t.Helper()
	env := stagetest.New(t, outbox.Config{})
	d.Pool, d.Outbox, d.Mappings, d.Logger = env.Pool, env.Outbox, env.Maps, slog.New(slog.DiscardHandler)
	con, err := console.New(d)
	require.NoError(t, err)
	h := api.New(api.Options{Console: con.Handler(), Logger: slog.New(slog.DiscardHandler)})
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &signInSite{env: env, con: con, handler: h, url: srv.URL}
}

func (s *signInSite) token(t *testing.T, name string, role auth.Role) string {
	t.Helper()
	tok, err := auth.CreateToken(s.env.Ctx, s.env.Pool, name, role, nil)
	require.NoError(t, err)
	return tok.Secret
}

// signInFrom posts the sign-in form from a client address, with the
// site's origin, straight to the handler.
func (s *signInSite) signInFrom(addr, token string) *httptest.ResponseRecorder {
	r := httptest.NewRequest(http.MethodPost, "http://console.test/console/login", strings.NewReader(url.Values{"token": {token}}.Encode()))
	r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	r.Header.Set("Origin", "http://console.test")
	r.RemoteAddr = addr + ":40000"
	w := httptest.NewRecorder()
	s.handler.ServeHTTP(w, r)
	return w
}

func (s *signInSite) auditActions(t *testing.T) []string {
	t.Helper()
	entries, err := audit.List(s.env.Ctx, s.env.Pool, "", 1000)
	require.NoError(t, err)
	var out []string
	for _, e := range entries {
		out = append(out, e.Action+" "+e.Subject)
	}
	return out
}

func (s *signInSite) sessions(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT count(*) FROM console_sessions`).Scan(&n))
	return n
}

// A sign-in posted from another site — by Origin, by Referer when there is
// no Origin, an opaque origin, or naming no origin at all — is refused with
// a page that says why, and opens no session; the console's own form
// signs in.
func TestCrossOriginSignInIsRefused(t *testing.T) {
	t.Parallel()
	s := newSignInSite(t, console.Deps{})
	token := s.token(t, "fin", auth.RoleFinance)
	post := func(header map[string]string) *http.Response {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, s.url+"/console/login", strings.NewReader(url.Values{"token": {token}}.Encode()))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		for k, v := range header {
			req.Header.Set(k, v)
		}
		c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		resp, err := c.Do(req)
		require.NoError(t, err)
		return resp
	}
	for _, h := range []map[string]string{
		{"Origin": "https://evil.example"},
		{"Origin": "https://evil.example", "Referer": s.url + "/console/login"},
		{"Origin": strings.Replace(s.url, "127.0.0.1", "127.0.0.2", 1)},
		{"Origin": "null"},
		{"Referer": "https://evil.example/console/login"},
		{"Referer": "::not a url"},
		{},
	} {
		resp := post(h)
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusForbidden, resp.StatusCode, "%v", h)
		require.Contains(t, string(b), "did not come from the console&#39;s own sign-in page", "%v", h)
		require.Empty(t, resp.Cookies(), "%v", h)
	}
	require.Zero(t, s.sessions(t))
	require.Empty(t, s.auditActions(t), "the token was not even tried")

	for _, h := range []map[string]string{{"Origin": s.url}, {"Referer": s.url + "/console/login"}} {
		resp := post(h)
		resp.Body.Close()
		require.Equal(t, http.StatusSeeOther, resp.StatusCode, "%v", h)
		require.Len(t, resp.Cookies(), 1, "%v", h)
	}
	require.Equal(t, 2, s.sessions(t))
}

// In a real browser: a page of another site that posts a valid token to
// the console's sign-in gets no session; the console's own form does.
func TestCrossOriginSignInInABrowser(t *testing.T) {
	t.Parallel()
	s := newSignInSite(t, console.Deps{})
	token := s.token(t, "fin", auth.RoleFinance)
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprintf(w, `<!doctype html><form id="f" method="post" action="%s/console/login">
			<input name="token" value="%s"><button>go</button></form>`, s.url, token)
	}))
	t.Cleanup(evil.Close)
	// The other site is another origin: the same machine by another name.
	evilURL := strings.Replace(evil.URL, "127.0.0.1", "localhost", 1)

	ctx, consoleErrors := browse(t)
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(evilURL), chromedp.WaitVisible(chromedp.CSS(`#f`)),
		chromedp.Submit(chromedp.CSS(`#f input`)), chromedp.WaitVisible(chromedp.CSS(`[data-testid=flash]`))))
	require.Contains(t, text(t, ctx, `[data-testid=flash]`), "did not come from the console's own sign-in page")
	screenshot(t, ctx, "signin-cross-origin-refused")
	require.Zero(t, s.sessions(t))

	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/"), chromedp.WaitVisible(chromedp.CSS(`input[name=token]`))),
		"still signed out")
	require.NoError(t, chromedp.Do(ctx, signIn(token, s.url)))
	require.Equal(t, 1, s.sessions(t))
	for _, e := range consoleErrors() {
		require.Contains(t, e, "status of 403", "the refusal is the only error")
	}
}

// Failed sign-ins are throttled per client address: past the limit the
// address gets 429 with Retry-After, even with a correct token, which is
// not looked at (no session, nothing audited); another address signs in;
// the address may try again once it has earned another attempt.
func TestSignInThrottledPerAddress(t *testing.T) {
	t.Parallel()
	s := newSignInSite(t, console.Deps{})
	var (
		mu  sync.Mutex
		now = time.Now()
	)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	console.SetSignInThrottle(s.con, 3, time.Minute, 100, time.Second, clock)
	good := s.token(t, "fin", auth.RoleFinance)

	for range 3 {
		require.Equal(t, http.StatusUnauthorized, s.signInFrom("192.0.2.1", "tly_tok_wrong").Code)
	}
	w := s.signInFrom("192.0.2.1", good)
	require.Equal(t, http.StatusTooManyRequests, w.Code)
	retry, err := strconv.Atoi(w.Header().Get("Retry-After"))
	require.NoError(t, err)
	require.Equal(t, 60, retry)
	require.Contains(t, w.Body.String(), "Too many failed sign-ins")
	require.Empty(t, w.Result().Cookies())
	require.Zero(t, s.sessions(t), "the correct token was not checked")
	require.Len(t, s.auditActions(t), 3, "three refusals, and nothing of the throttled attempt")

	require.Equal(t, http.StatusSeeOther, s.signInFrom("192.0.2.2", good).Code, "another address is unaffected")
	require.Equal(t, http.StatusTooManyRequests, s.signInFrom("192.0.2.1", good).Code)

	mu.Lock()
	now = now.Add(61 * time.Second)
	mu.Unlock()
	require.Equal(t, http.StatusSeeOther, s.signInFrom("192.0.2.1", good).Code, "a minute later it may try again")
	require.Equal(t, http.StatusSeeOther, s.signInFrom("192.0.2.1", good).Code, "and successes spend nothing")
}

// Failed sign-ins from all addresses together have a ceiling that holds
// back the addresses that failed lately — but never locks out one that has
// not failed: others' guessing cannot keep an operator out.
func TestSignInThrottledInAll(t *testing.T) {
	t.Parallel()
	s := newSignInSite(t, console.Deps{})
	console.SetSignInThrottle(s.con, 10, time.Minute, 3, 10*time.Second, time.Now)
	good := s.token(t, "fin", auth.RoleFinance)
	for i := range 3 {
		require.Equal(t, http.StatusUnauthorized, s.signInFrom(fmt.Sprintf("198.51.100.%d", i), "tly_tok_wrong").Code)
	}
	w := s.signInFrom("198.51.100.0", good)
	require.Equal(t, http.StatusTooManyRequests, w.Code, "an address that failed lately waits for the ceiling")
	retry, err := strconv.Atoi(w.Header().Get("Retry-After"))
	require.NoError(t, err)
	require.InDelta(t, 10, retry, 1)
	require.Zero(t, s.sessions(t))
	require.Equal(t, http.StatusSeeOther, s.signInFrom("198.51.100.200", good).Code, "an address that has not failed is not locked out")
	require.Equal(t, 1, s.sessions(t))
}

// Refused sign-ins are audited one by one up to a node-wide bound (100 at
// once, then one a second): a flood from many addresses cannot fill the
// audit log, from which nothing is deleted.
func TestRefusedSignInsAuditedUpToABound(t *testing.T) {
	t.Parallel()
	s := newSignInSite(t, console.Deps{})
	start := time.Now()
	for i := range 150 {
		require.Equal(t, http.StatusUnauthorized, s.signInFrom(fmt.Sprintf("203.0.113.%d", i), "tly_tok_wrong").Code)
	}
	refused := 0
	for _, a := range s.auditActions(t) {
		if strings.HasPrefix(a, auth.ActionSignInRefused+" ") {
			refused++
		}
	}
	require.GreaterOrEqual(t, refused, 100, "the first ones are each recorded")
	require.LessOrEqual(t, refused, 100+int(time.Since(start)/time.Second)+1, "then one a second")
}

// Sign-ins, refusals (with the address and nothing of the token) and
// sign-outs are in the audit log.
func TestSignInsAndSignOutsAreAudited(t *testing.T) {
	t.Parallel()
	s := newSignInSite(t, console.Deps{})
	ing := s.token(t, "svc", auth.RoleIngest)
	good := s.token(t, "fin", auth.RoleFinance)
	require.Equal(t, http.StatusUnauthorized, s.signInFrom("192.0.2.5", "tly_tok_secretguess").Code)
	require.Equal(t, http.StatusForbidden, s.signInFrom("192.0.2.5", ing).Code, "an ingest token may not sign in")

	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	c := &http.Client{Jar: jar}
	resp, err := postSignIn(c, s.url, good)
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	m := csrfPattern.FindSubmatch(b)
	require.NotNil(t, m)
	req, err := http.NewRequest(http.MethodPost, s.url+"/console/logout", strings.NewReader(url.Values{"csrf": {string(m[1])}}.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err = c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, s.url+"/console/login", resp.Request.URL.String(), "signed out")

	entries, err := audit.List(s.env.Ctx, s.env.Pool, "", 10)
	require.NoError(t, err)
	type row struct{ actor, action, subject, reason, address string }
	var got []row
	for _, e := range entries {
		got = append(got, row{e.Actor, e.Action, e.Subject, e.Reason, e.Details["address"].(string)})
		require.NotContains(t, fmt.Sprint(e), "secretguess")
		require.NotContains(t, fmt.Sprint(e), ing)
	}
	require.Equal(t, []row{
		{"console:fin", auth.ActionSignOut, "token:fin", "", "127.0.0.1"},
		{"console:fin", auth.ActionSignIn, "token:fin", "", "127.0.0.1"},
		{"console:anonymous", auth.ActionSignInRefused, "address:192.0.2.5", "sign-in refused", "192.0.2.5"},
		{"console:anonymous", auth.ActionSignInRefused, "address:192.0.2.5", "sign-in refused", "192.0.2.5"},
	}, got)
}

// A session unused for the idle timeout ends though its absolute expiry
// is hours away: the browser is sent to sign in again, told why, and its
// cookie cleared. The cookie lives as long as the session may.
func TestIdleSessionEnds(t *testing.T) {
	t.Parallel()
	s := newSignInSite(t, console.Deps{SessionTTL: 3 * time.Hour, SessionIdle: 20 * time.Minute})
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	c := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := postSignIn(c, s.url, s.token(t, "fin", auth.RoleFinance))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	require.Len(t, resp.Cookies(), 1)
	require.Equal(t, 3*60*60, resp.Cookies()[0].MaxAge)
	get := func() *http.Response {
		t.Helper()
		resp, err := c.Get(s.url + "/console/mappings")
		require.NoError(t, err)
		resp.Body.Close()
		return resp
	}
	_, err = s.env.Pool.Exec(s.env.Ctx, `UPDATE console_sessions SET last_seen_at = clock_timestamp() - interval '19 minutes'`)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, get().StatusCode, "used within the idle timeout")

	_, err = s.env.Pool.Exec(s.env.Ctx, `UPDATE console_sessions SET last_seen_at = clock_timestamp() - interval '21 minutes'`)
	require.NoError(t, err)
	resp = get()
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	require.Equal(t, "/console/login?ended=1", resp.Header.Get("Location"))
	require.Len(t, resp.Cookies(), 1)
	require.Equal(t, -1, resp.Cookies()[0].MaxAge, "the cookie is cleared")

	resp, err = c.Get(s.url + "/console/login?ended=1")
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Contains(t, string(b), "Your session has ended: sign in again.")
}

// Each sign-in deletes sessions that have ended (expired, idle, signed
// out) and keeps the live ones.
func TestSignInPurgesEndedSessions(t *testing.T) {
	t.Parallel()
	s := newSignInSite(t, console.Deps{})
	good := s.token(t, "fin", auth.RoleFinance)
	for range 3 {
		require.Equal(t, http.StatusSeeOther, s.signInFrom("192.0.2.1", good).Code)
	}
	_, err := s.env.Pool.Exec(s.env.Ctx, `UPDATE console_sessions SET expires_at = clock_timestamp()
		WHERE id_hash = (SELECT id_hash FROM console_sessions ORDER BY created_at OFFSET 1 LIMIT 1)`)
	require.NoError(t, err)
	_, err = s.env.Pool.Exec(s.env.Ctx, `UPDATE console_sessions SET last_seen_at = clock_timestamp() - interval '1 hour'
		WHERE id_hash = (SELECT id_hash FROM console_sessions ORDER BY created_at OFFSET 2 LIMIT 1)`)
	require.NoError(t, err)
	var first []byte
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT id_hash FROM console_sessions ORDER BY created_at LIMIT 1`).Scan(&first))

	require.Equal(t, http.StatusSeeOther, s.signInFrom("192.0.2.1", good).Code)
	require.Equal(t, 2, s.sessions(t), "the expired and the idle are gone")
	var kept bool
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT EXISTS (SELECT 1 FROM console_sessions WHERE id_hash = $1)`, first).Scan(&kept))
	require.True(t, kept, "the first, live, session is kept")
}
