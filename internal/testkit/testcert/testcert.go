// Package testcert makes TLS certificates for tests: a self-signed key pair
// for 127.0.0.1 and localhost, PEM-encoded, with its parsed certificate so
// that a client can trust it, or one signed by a test's own authority (CA).
// It is a test kit; no non-test code imports it.
package testcert

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"testing"
	"time"
)

// Pair is a self-signed certificate and its private key, PEM-encoded.
type Pair struct {
	Cert, Key []byte
	// X509 is the parsed certificate, for a client's root pool.
	X509 *x509.Certificate
}

// New makes a pair valid for an hour around now, for 127.0.0.1 and
// localhost, with serial as its serial number (tests tell renewals apart
// by it).
func New(t testing.TB, serial int64) Pair {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "tally test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, DNSNames: []string{"localhost"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA: true, BasicConstraintsValid: true,
	}
	return sign(t, tmpl, tmpl, key, key)
}

// sign makes the pair of tmpl and key, signed by parent's signer (tmpl and
// key themselves for a self-signed pair).
func sign(t testing.TB, tmpl, parent *x509.Certificate, key, signer *ecdsa.PrivateKey) Pair {
	t.Helper()
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, signer)
	if err != nil {
		t.Fatal(err)
	}
	parsed, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return Pair{Cert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		Key: pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), X509: parsed}
}

// Write puts the pair in certFile and keyFile (mode 0600), the certificate
// first, as a renewal might.
func (p Pair) Write(t testing.TB, certFile, keyFile string) {
	t.Helper()
	if err := os.WriteFile(certFile, p.Cert, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, p.Key, 0o600); err != nil {
		t.Fatal(err)
	}
}

// CA is a certificate authority of a test's own, to verify a server's
// certificate against (sslmode=verify-full) as a managed Postgres's is.
type CA struct {
	// Cert is the authority's certificate, PEM-encoded: the client's root.
	Cert []byte
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// NewCA makes an authority valid for a day around now.
func NewCA(t testing.TB) CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "tally test CA"},
		NotBefore: time.Now().Add(-24 * time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageCertSign, IsCA: true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return CA{Cert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), cert: cert, key: key}
}

// Issue makes a server's pair for 127.0.0.1 and localhost, valid for a day
// around now and signed by ca (not self-signed, not an authority).
func (ca CA) Issue(t testing.TB, serial int64) Pair {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "localhost"},
		NotBefore: time.Now().Add(-24 * time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, DNSNames: []string{"localhost"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	return sign(t, tmpl, ca.cert, key, ca.key)
}
