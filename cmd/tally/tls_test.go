package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testcert"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// startServe runs `tally serve` with env on a free address and waits until
// client gets 200 from scheme://addr/healthz; it returns the base URL and
// the process's output.
func startServe(t *testing.T, client *http.Client, scheme string, env ...string) (string, *bytes.Buffer) {
	t.Helper()
	addr := freeAddr(t)
	out := new(bytes.Buffer)
	cmd := exec.Command(binary, "serve")
	cmd.Env = append(append(os.Environ(), "TALLY_DATABASE_URL="+testdb.URL(t), "TALLY_LISTEN="+addr,
		"TALLY_SHUTDOWN_TIMEOUT=5s", "TALLY_LOG_LEVEL=info"), env...)
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Signal(syscall.SIGTERM); _ = cmd.Wait() })
	base := scheme + "://" + addr
	require.Eventually(t, func() bool {
		resp, err := client.Get(base + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 60*time.Second, 50*time.Millisecond, "tally serve starts: %s", out)
	return base, out
}

// fetch GETs url with the headers and returns the response, its body read.
func fetch(t *testing.T, client *http.Client, url string, header map[string]string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := client.Do(req)
	require.NoError(t, err)
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	resp.Body.Close()
	return resp
}

// testAdminToken is a strong admin token for the TLS tests' sign-ins.
const testAdminToken = "tly_adm_3f9c1e7a52b84d06e1c9a7f35b2d8e40"

// signIn posts the console's sign-in form with the admin token, from
// origin, with the extra headers, and returns the session cookie the answer
// sets (nil when none).
func signIn(t *testing.T, client *http.Client, base, origin string, header map[string]string) *http.Cookie {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, base+"/console/login", strings.NewReader(url.Values{"token": {testAdminToken}}.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", origin)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	client = &http.Client{Timeout: client.Timeout, Transport: client.Transport,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Less(t, resp.StatusCode, 400, "the sign-in is accepted")
	for _, c := range resp.Cookies() {
		if c.Value != "" {
			return c
		}
	}
	return nil
}

// TestServeOverTLS runs `tally serve` with TALLY_TLS_CERT and TALLY_TLS_KEY:
// it speaks HTTPS only, TLS 1.2 and later; every response — the API's, the
// console's, the metrics' and the probes' — carries HSTS and the security
// headers (the console keeps its own policy); a forged X-Forwarded-Proto
// from a peer that is no configured proxy changes nothing; and a renewed
// pair written over the files is served to new connections without a
// restart.
func TestServeOverTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	first, renewed := testcert.New(t, 1), testcert.New(t, 2)
	first.Write(t, certFile, keyFile)
	roots := x509.NewCertPool()
	roots.AddCert(first.X509)
	roots.AddCert(renewed.X509)
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots}, DisableKeepAlives: true}}

	base, out := startServe(t, client, "https", "TALLY_TLS_CERT="+certFile, "TALLY_TLS_KEY="+keyFile,
		"TALLY_ADMIN_TOKEN="+testAdminToken)
	require.Contains(t, out.String(), `"addr":"https://`)
	cookie := signIn(t, client, base, base, nil)
	require.NotNil(t, cookie, "a session cookie")
	require.True(t, cookie.Secure, "the session cookie is Secure over TLS")
	require.True(t, cookie.HttpOnly)

	for _, path := range []string{"/healthz", "/readyz", "/metrics", "/v1/outbox/summary", "/console/login", "/console/", "/nowhere"} {
		resp := fetch(t, client, base+path, map[string]string{"X-Forwarded-Proto": "http"})
		require.Equal(t, "max-age=31536000", resp.Header.Get("Strict-Transport-Security"), path)
		require.Equal(t, "nosniff", resp.Header.Get("X-Content-Type-Options"), path)
		require.Equal(t, "DENY", resp.Header.Get("X-Frame-Options"), path)
		require.Equal(t, "same-origin", resp.Header.Get("Referrer-Policy"), path)
		require.Len(t, resp.Header.Values("Content-Security-Policy"), 1, path)
		require.Contains(t, resp.Header.Get("Content-Security-Policy"), "frame-ancestors 'none'", path)
	}
	resp := fetch(t, client, base+"/v1/outbox/summary", nil)
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	resp = fetch(t, client, base+"/console/login", nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, resp.Header.Get("Content-Security-Policy"), "style-src 'self'", "the console's own policy is kept")

	// Plain HTTP to the TLS port is not served.
	code, body := get("http://" + base[len("https://"):] + "/healthz")
	require.Equal(t, http.StatusBadRequest, code, body)
	// Nor is TLS below 1.2.
	old := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS10, MaxVersion: tls.VersionTLS11}}}
	_, err := old.Get(base + "/healthz")
	require.Error(t, err)

	served := func() int64 {
		resp := fetch(t, client, base+"/healthz", nil)
		return resp.TLS.PeerCertificates[0].SerialNumber.Int64()
	}
	require.Equal(t, int64(1), served())
	renewed.Write(t, certFile, keyFile)
	require.Eventually(t, func() bool { return served() == 2 }, 30*time.Second, 200*time.Millisecond,
		"the renewed certificate is served without a restart: %s", out)
	require.Contains(t, out.String(), "TLS certificate reloaded")
	require.NotContains(t, out.String(), "PRIVATE KEY")
}

// TestServeBehindATrustedProxy runs plain `tally serve` with
// TALLY_TRUSTED_PROXIES=127.0.0.1: X-Forwarded-Proto https from that peer
// makes the client side HTTPS (HSTS), the same header from another peer
// (127.0.0.2) is ignored, and a plain request gets no HSTS.
func TestServeBehindATrustedProxy(t *testing.T) {
	t.Parallel()
	// from is a client whose connections come from the address ip.
	from := func(ip string) *http.Client {
		dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 5 * time.Second}
		return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				return dialer.DialContext(ctx, network, addr)
			}, DisableKeepAlives: true}}
	}
	proxy, stranger := from("127.0.0.1"), from("127.0.0.2")
	// Linux answers on all of 127/8; elsewhere 127.0.0.2 may not exist,
	// and the untrusted peer is then left to TestServeOverTLS and httpsec.
	strangerExists := true
	if l, err := net.Listen("tcp", "127.0.0.2:0"); err != nil {
		strangerExists = false
		t.Logf("no 127.0.0.2 here (%v): the untrusted peer is not tried", err)
	} else {
		l.Close()
	}
	base, _ := startServe(t, proxy, "http", "TALLY_TRUSTED_PROXIES=127.0.0.1", "TALLY_ADMIN_TOKEN="+testAdminToken)
	https := map[string]string{"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.9"}
	origin := "https://" + strings.TrimPrefix(base, "http://")
	cookie := signIn(t, proxy, base, origin, https)
	require.NotNil(t, cookie)
	require.True(t, cookie.Secure, "the session cookie is Secure when the proxy says the client side is HTTPS")
	if strangerExists {
		cookie = signIn(t, stranger, base, origin, https)
		require.NotNil(t, cookie)
		require.False(t, cookie.Secure, "another peer's X-Forwarded-Proto is not believed")
	}
	cookie = signIn(t, proxy, base, base, nil)
	require.NotNil(t, cookie)
	require.False(t, cookie.Secure, "plain HTTP from the proxy")

	for _, path := range []string{"/healthz", "/metrics", "/v1/outbox/summary", "/console/login"} {
		resp := fetch(t, proxy, base+path, https)
		require.Equal(t, "max-age=31536000", resp.Header.Get("Strict-Transport-Security"), "%s from the proxy", path)
		require.Equal(t, "nosniff", resp.Header.Get("X-Content-Type-Options"), path)
		require.Equal(t, "DENY", resp.Header.Get("X-Frame-Options"), path)

		if strangerExists {
			resp = fetch(t, stranger, base+path, https)
			require.Empty(t, resp.Header.Get("Strict-Transport-Security"), "%s from another peer", path)
			require.Equal(t, "nosniff", resp.Header.Get("X-Content-Type-Options"), path)
			require.Equal(t, "DENY", resp.Header.Get("X-Frame-Options"), path)
		}

		resp = fetch(t, proxy, base+path, nil)
		require.Empty(t, resp.Header.Get("Strict-Transport-Security"), "%s plain from the proxy", path)
	}
}

// A half-given or broken TLS configuration stops serve before anything
// starts, naming the files, never their content.
func TestTLSConfigurationErrorsStopServe(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	a, b := testcert.New(t, 1), testcert.New(t, 2)
	a.Write(t, certFile, keyFile)
	require.NoError(t, os.WriteFile(keyFile, b.Key, 0o600))
	token := filepath.Join(dir, "admin-token")
	require.NoError(t, os.WriteFile(token, []byte("tly_adm_0123456789abcdef0123456789abcdef\n"), 0o600))
	for _, tc := range []struct {
		env  []string
		want string
	}{
		{[]string{"TALLY_TLS_CERT=" + certFile}, "TALLY_TLS_CERT is set without TALLY_TLS_KEY"},
		{[]string{"TALLY_TLS_CERT=" + certFile, "TALLY_TLS_KEY=" + keyFile}, "private key does not match public key"},
		{[]string{"TALLY_TRUSTED_PROXIES=10.0.0.0/99"}, "TALLY_TRUSTED_PROXIES"},
		{[]string{"TALLY_ADMIN_TOKEN_FILE=" + token, "TALLY_ADMIN_TOKEN=tly_adm_0123456789abcdef0123456789abcdef"}, "are both set"},
		{[]string{"TALLY_DATABASE_URL_FILE=" + filepath.Join(dir, "absent")}, "TALLY_DATABASE_URL_FILE: open " + filepath.Join(dir, "absent")},
	} {
		dataDir := t.TempDir()
		cmd := exec.Command(binary, "serve")
		cmd.Env = append(append(os.Environ(), "TALLY_DATA_DIR="+dataDir), tc.env...)
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, "%v", tc.env)
		require.Equal(t, 2, ee.ExitCode(), "%s", out)
		require.Contains(t, string(out), tc.want)
		require.NotContains(t, string(out), "PRIVATE KEY")
		entries, _ := os.ReadDir(dataDir)
		require.Empty(t, entries, "nothing started")
	}
}

// TestDevRefusesTLS: dev is plain HTTP on loopback (its simulator posts
// error reports to it over HTTP); TLS settings are refused before anything
// starts.
func TestDevRefusesTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	testcert.New(t, 1).Write(t, certFile, keyFile)
	dataDir := t.TempDir()
	cmd := exec.Command(binary, "dev")
	cmd.Env = append(os.Environ(), "TALLY_DATA_DIR="+dataDir, "TALLY_TLS_CERT="+certFile, "TALLY_TLS_KEY="+keyFile)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, "%s", out)
	require.Equal(t, 1, ee.ExitCode(), "%s", out)
	require.Contains(t, string(out), "dev serves plain HTTP")
	entries, _ := os.ReadDir(dataDir)
	require.Empty(t, entries, "nothing started")
}
