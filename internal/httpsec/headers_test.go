package httpsec_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/httpsec"
)

func serveHeaders(t *testing.T, proxies string, r *http.Request, h http.HandlerFunc) http.Header {
	t.Helper()
	p, err := httpsec.ParseProxies(proxies)
	require.NoError(t, err)
	w := httptest.NewRecorder()
	httpsec.Client(p)(httpsec.Headers(h)).ServeHTTP(w, r)
	return w.Result().Header
}

func TestHSTSOnlyWhenTheClientSideIsHTTPS(t *testing.T) {
	t.Parallel()
	ok := func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) }
	plain := serveHeaders(t, "", request("192.0.2.1:1", map[string][]string{"X-Forwarded-Proto": {"https"}}), ok)
	require.Empty(t, plain.Get("Strict-Transport-Security"), "a plain request, whatever it claims")
	proxied := serveHeaders(t, "10.0.0.1", request("10.0.0.1:1", map[string][]string{"X-Forwarded-Proto": {"https"}}), ok)
	require.Equal(t, "max-age=31536000", proxied.Get("Strict-Transport-Security"))
	proxiedPlain := serveHeaders(t, "10.0.0.1", request("10.0.0.1:1", map[string][]string{"X-Forwarded-Proto": {"http"}}), ok)
	require.Empty(t, proxiedPlain.Get("Strict-Transport-Security"))
}

func TestSecurityHeadersOnEveryResponse(t *testing.T) {
	t.Parallel()
	for name, h := range map[string]http.HandlerFunc{
		"ok":           func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("{}")) },
		"not found":    http.NotFound,
		"server error": func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "boom", http.StatusInternalServerError) },
	} {
		got := serveHeaders(t, "", request("192.0.2.1:1", nil), h)
		require.Equal(t, "nosniff", got.Get("X-Content-Type-Options"), name)
		require.Equal(t, "DENY", got.Get("X-Frame-Options"), name)
		require.Equal(t, "same-origin", got.Get("Referrer-Policy"), name)
		require.Equal(t, "default-src 'none'; frame-ancestors 'none'", got.Get("Content-Security-Policy"), name)
	}
}

// A handler serving pages keeps its own policy: the default is replaced,
// not combined with it.
func TestAPagesOwnPolicyReplacesTheDefault(t *testing.T) {
	t.Parallel()
	const own = "default-src 'none'; style-src 'self'; frame-ancestors 'none'"
	got := serveHeaders(t, "", request("192.0.2.1:1", nil), func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Security-Policy", own)
		w.Header().Set("Referrer-Policy", "no-referrer")
	})
	require.Equal(t, []string{own}, got.Values("Content-Security-Policy"))
	require.Equal(t, "no-referrer", got.Get("Referrer-Policy"))
}
