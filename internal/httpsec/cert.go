package httpsec

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// DefaultCertCheckInterval is how often, at most, CertReloader looks at
// its files for a change.
const DefaultCertCheckInterval = 5 * time.Second

// LoadPair reads a PEM certificate (chain) and its private key and checks
// that they belong together. Its errors name the files, never their
// content.
func LoadPair(certFile, keyFile string) (*tls.Certificate, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate %s and key %s: %w", certFile, keyFile, err)
	}
	return &cert, nil
}

// CertReloader serves a certificate from a pair of files and picks up a
// new pair when the files change: at most every Interval, a handshake looks
// at the files' sizes and modification times, and when they changed it
// loads the pair again. A new pair that does not load — half written, or a
// key that does not match — is logged as an error and the current
// certificate is kept; it is tried again once the files change again.
type CertReloader struct {
	certFile, keyFile string
	interval          time.Duration
	logger            *slog.Logger

	mu sync.Mutex
	// cert is the certificate served.
	cert *tls.Certificate
	// seen is the files' stamp last loaded or tried.
	seen stamp
	// checked is when the files were last looked at.
	checked time.Time
}

// stamp is what tells a pair of files changed.
type stamp struct {
	certMod, keyMod   time.Time
	certSize, keySize int64
}

// NewCertReloader loads the pair and returns its reloader. interval
// defaults to DefaultCertCheckInterval when not positive; logger to
// slog.Default().
func NewCertReloader(certFile, keyFile string, interval time.Duration, logger *slog.Logger) (*CertReloader, error) {
	if interval <= 0 {
		interval = DefaultCertCheckInterval
	}
	if logger == nil {
		logger = slog.Default()
	}
	st, err := stampOf(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	cert, err := LoadPair(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	return &CertReloader{certFile: certFile, keyFile: keyFile, interval: interval, logger: logger,
		cert: cert, seen: st, checked: time.Now()}, nil
}

// GetCertificate is tls.Config's GetCertificate: the current certificate,
// reloaded first if the files changed.
func (c *CertReloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if now := time.Now(); now.Sub(c.checked) >= c.interval {
		c.checked = now
		c.reload()
	}
	return c.cert, nil
}

// reload loads the pair again if the files changed since they were last
// loaded or tried. Called with mu held.
func (c *CertReloader) reload() {
	st, err := stampOf(c.certFile, c.keyFile)
	if err != nil {
		if st != c.seen {
			c.seen = st
			c.logger.Error("the TLS certificate files cannot be read; keeping the current certificate", "error", err)
		}
		return
	}
	if st == c.seen {
		return
	}
	c.seen = st
	cert, err := LoadPair(c.certFile, c.keyFile)
	if err != nil {
		c.logger.Error("the changed TLS certificate files do not load; keeping the current certificate", "error", err)
		return
	}
	c.cert = cert
	if cert.Leaf != nil {
		c.logger.Info("TLS certificate reloaded", "cert", c.certFile, "not_after", cert.Leaf.NotAfter)
	}
}

// stampOf is the pair's stamp; when a file cannot be read, the stamp has
// what could be read and the error names the file.
func stampOf(certFile, keyFile string) (stamp, error) {
	var st stamp
	ci, err := os.Stat(certFile)
	if err != nil {
		return st, fmt.Errorf("TLS certificate: %w", err)
	}
	st.certMod, st.certSize = ci.ModTime(), ci.Size()
	ki, err := os.Stat(keyFile)
	if err != nil {
		return st, fmt.Errorf("TLS key: %w", err)
	}
	st.keyMod, st.keySize = ki.ModTime(), ki.Size()
	return st, nil
}
