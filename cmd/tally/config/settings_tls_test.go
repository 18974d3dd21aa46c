package config_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// writePair writes a self-signed certificate and its key into dir and
// returns their paths.
func writePair(t *testing.T, dir, name string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), DNSNames: []string{"localhost"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	certFile, keyFile = filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
	require.NoError(t, os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	require.NoError(t, os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600))
	return certFile, keyFile
}

func TestTLSConfigurationProblems(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	certA, keyA := writePair(t, dir, "a")
	_, keyB := writePair(t, dir, "b")
	for _, tc := range []struct {
		name    string
		env     map[string]string
		wantErr string
	}{
		{"only the certificate", map[string]string{"TALLY_TLS_CERT": certA}, "TALLY_TLS_CERT is set without TALLY_TLS_KEY"},
		{"only the key", map[string]string{"TALLY_TLS_KEY": keyA}, "TALLY_TLS_KEY is set without TALLY_TLS_CERT"},
		{"a missing file", map[string]string{"TALLY_TLS_CERT": certA, "TALLY_TLS_KEY": filepath.Join(dir, "nope.key")}, "nope.key"},
		{"a key of another certificate", map[string]string{"TALLY_TLS_CERT": certA, "TALLY_TLS_KEY": keyB}, "private key does not match public key"},
		{"the files swapped", map[string]string{"TALLY_TLS_CERT": keyA, "TALLY_TLS_KEY": certA}, "TLS certificate"},
		{"a bad proxy prefix", map[string]string{"TALLY_TRUSTED_PROXIES": "10.0.0.1, 10.0.0.0/40"}, `TALLY_TRUSTED_PROXIES: not an IP address or CIDR prefix: "10.0.0.0/40"`},
		{"a proxy by name", map[string]string{"TALLY_TRUSTED_PROXIES": "lb.internal"}, `"lb.internal"`},
	} {
		_, err := load(t, tc.env)
		require.ErrorContains(t, err, tc.wantErr, tc.name)
	}
}

func TestTLSConfiguration(t *testing.T) {
	t.Parallel()
	certFile, keyFile := writePair(t, t.TempDir(), "a")
	c, err := load(t, map[string]string{"TALLY_TLS_CERT": certFile, "TALLY_TRUSTED_PROXIES": "10.0.0.0/8, 192.0.2.1"}, "--tls-key", keyFile)
	require.NoError(t, err)
	require.True(t, c.TLS.Enabled())
	require.Equal(t, certFile, c.TLS.CertFile)
	require.Equal(t, keyFile, c.TLS.KeyFile)
	require.True(t, c.TLS.TrustedProxies.Trusts(netip.MustParseAddr("10.1.2.3")))
	require.False(t, c.TLS.TrustedProxies.Trusts(netip.MustParseAddr("192.0.2.2")))

	c, err = load(t, nil)
	require.NoError(t, err)
	require.False(t, c.TLS.Enabled(), "plain HTTP by default")
	require.True(t, c.TLS.TrustedProxies.Empty(), "no proxy believed by default")
}
