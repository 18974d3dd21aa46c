package httpsec_test

import (
	"crypto/tls"
	"crypto/x509"
	"io"
	"log"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/httpsec"
	"github.com/tallymeter/tally/internal/testkit/syncbuf"
	"github.com/tallymeter/tally/internal/testkit/testcert"
)

// write puts cert and key in place, the certificate first, as a renewal
// might — from different pairs, for a mismatched pair.
func write(t *testing.T, certFile, keyFile string, cert, key []byte) {
	t.Helper()
	require.NoError(t, os.WriteFile(certFile, cert, 0o600))
	require.NoError(t, os.WriteFile(keyFile, key, 0o600))
}

// syncBuffer is a log sink safe for the server's goroutines.
type syncBuffer = syncbuf.Buffer

func TestLoadPairErrorsNameTheFilesNeverTheirContent(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a, b := testcert.New(t, 1), testcert.New(t, 2)
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")

	_, err := httpsec.LoadPair(certFile, keyFile)
	require.ErrorContains(t, err, certFile, "missing")

	write(t, certFile, keyFile, a.Cert, b.Key)
	_, err = httpsec.LoadPair(certFile, keyFile)
	require.ErrorContains(t, err, "private key does not match public key")

	write(t, certFile, keyFile, a.Cert, []byte("-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1tYXRlcmlhbA==\n-----END PRIVATE KEY-----\n"))
	_, err = httpsec.LoadPair(certFile, keyFile)
	require.Error(t, err)
	require.NotContains(t, err.Error(), "c2VjcmV0LWtleS1tYXRlcmlhbA")
	require.Contains(t, err.Error(), keyFile)

	write(t, certFile, keyFile, a.Cert, a.Key)
	cert, err := httpsec.LoadPair(certFile, keyFile)
	require.NoError(t, err)
	require.Equal(t, a.X509.SerialNumber, cert.Leaf.SerialNumber)
}

// A server on a CertReloader picks up a renewed pair within the check
// interval, keeps serving the current one while the files hold a bad pair
// (and says so, once), and picks up the next good one.
func TestCertificateReloadedWhenTheFilesChange(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	first, second, third := testcert.New(t, 1), testcert.New(t, 2), testcert.New(t, 3)
	write(t, certFile, keyFile, first.Cert, first.Key)

	var logs syncBuffer
	const interval = 50 * time.Millisecond
	reloader, err := httpsec.NewCertReloader(certFile, keyFile, interval, slog.New(slog.NewTextHandler(&logs, nil)))
	require.NoError(t, err)
	// Not httptest's TLS server: with a certificate of its own in
	// Certificates, a hello without a server name never asks
	// GetCertificate.
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: reloader.GetCertificate})
	require.NoError(t, err)
	srv := &http.Server{Handler: http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}), ReadHeaderTimeout: time.Second,
		ErrorLog: log.New(io.Discard, "", 0)}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	url := "https://" + ln.Addr().String()

	roots := x509.NewCertPool()
	for _, p := range []testcert.Pair{first, second, third} {
		roots.AddCert(p.X509)
	}
	// served is the serial of the certificate a new connection is shown.
	served := func() int64 {
		client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}, DisableKeepAlives: true}}
		resp, err := client.Get(url)
		require.NoError(t, err)
		defer resp.Body.Close()
		return resp.TLS.PeerCertificates[0].SerialNumber.Int64()
	}
	require.Equal(t, int64(1), served())

	write(t, certFile, keyFile, second.Cert, second.Key)
	require.Eventually(t, func() bool { return served() == 2 }, 5*time.Second, interval/2, "the renewed pair is served")
	require.Contains(t, logs.String(), "TLS certificate reloaded")

	// A half-done renewal: the new certificate beside the old key.
	require.NoError(t, os.WriteFile(certFile, third.Cert, 0o600))
	require.Eventually(t, func() bool {
		require.Equal(t, int64(2), served(), "the current pair is kept")
		return strings.Contains(logs.String(), "level=ERROR")
	}, 5*time.Second, interval/2)
	for range 5 {
		require.Equal(t, int64(2), served(), "the current pair is kept")
		time.Sleep(interval)
	}
	require.Equal(t, 1, strings.Count(logs.String(), "level=ERROR"), "a bad pair is reported once, not on every handshake:\n%s", logs.String())
	require.Contains(t, logs.String(), "private key does not match public key")
	require.NotContains(t, logs.String(), string(third.Key[30:60]), "no key material in the log")

	require.NoError(t, os.WriteFile(keyFile, third.Key, 0o600))
	require.Eventually(t, func() bool { return served() == 3 }, 5*time.Second, interval/2, "the completed renewal is served")

	// The files gone: the current certificate stays.
	require.NoError(t, os.Remove(keyFile))
	time.Sleep(2 * interval)
	require.Equal(t, int64(3), served())
	require.Contains(t, logs.String(), "cannot be read")
}

func TestNewCertReloaderRefusesABadPair(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	_, err := httpsec.NewCertReloader(certFile, keyFile, 0, nil)
	require.ErrorContains(t, err, certFile)
	a, b := testcert.New(t, 1), testcert.New(t, 2)
	write(t, certFile, keyFile, a.Cert, b.Key)
	_, err = httpsec.NewCertReloader(certFile, keyFile, 0, nil)
	require.ErrorContains(t, err, "does not match")
}
