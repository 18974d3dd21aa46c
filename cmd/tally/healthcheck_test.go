package main

import (
	"crypto/tls"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testcert"
)

// TestHealthcheckAsksHealthzOnThisMachine runs tally healthcheck, the
// container image's HEALTHCHECK: it fails on no answer and on a status
// other than 200 first, then succeeds on 200, asking a wildcard
// TALLY_LISTEN on loopback, over HTTPS when TALLY_TLS_CERT is set.
func TestHealthcheckAsksHealthzOnThisMachine(t *testing.T) {
	t.Parallel()
	wildcard := func(addr string) string {
		_, port, err := net.SplitHostPort(addr)
		require.NoError(t, err)
		return "TALLY_LISTEN=0.0.0.0:" + port
	}
	answer := func(status int) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/healthz" {
				http.NotFound(w, r)
				return
			}
			w.WriteHeader(status)
		})
	}

	code, _, errs := tallyEnv(t, []string{"TALLY_LISTEN=" + freeAddr(t)}, "healthcheck")
	require.Equal(t, 1, code, "nothing listens")
	require.Contains(t, errs, "connection refused")

	down := httptest.NewServer(answer(http.StatusServiceUnavailable))
	defer down.Close()
	code, _, errs = tallyEnv(t, []string{wildcard(down.Listener.Addr().String())}, "healthcheck")
	require.Equal(t, 1, code)
	require.Contains(t, errs, "503 Service Unavailable")
	require.Equal(t, 1, strings.Count(errs, "\n"), "one line: %s", errs)

	up := httptest.NewServer(answer(http.StatusOK))
	defer up.Close()
	code, _, errs = tallyEnv(t, []string{wildcard(up.Listener.Addr().String())}, "healthcheck")
	require.Equal(t, 0, code, errs)

	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	pair := testcert.New(t, 1)
	pair.Write(t, certFile, keyFile)
	cert, err := tls.X509KeyPair(pair.Cert, pair.Key)
	require.NoError(t, err)
	secure := httptest.NewUnstartedServer(answer(http.StatusOK))
	secure.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	secure.StartTLS()
	defer secure.Close()
	tlsEnv := []string{wildcard(secure.Listener.Addr().String()), "TALLY_TLS_CERT=" + certFile, "TALLY_TLS_KEY=" + keyFile}
	code, _, errs = tallyEnv(t, tlsEnv, "healthcheck")
	require.Equal(t, 0, code, errs)
	code, _, errs = tallyEnv(t, []string{wildcard(secure.Listener.Addr().String())}, "healthcheck")
	require.Equal(t, 1, code, "plain HTTP to a TLS port: %s", errs)
}

// TestVersionIsPrinted: an unstamped build says dev.
func TestVersionIsPrinted(t *testing.T) {
	t.Parallel()
	for _, arg := range []string{"version", "--version"} {
		code, out, errs := tallyEnv(t, nil, arg)
		require.Equal(t, 0, code, errs)
		require.Equal(t, "tally dev\n", out)
	}
}
