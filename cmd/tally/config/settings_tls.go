package config

import (
	"errors"

	"github.com/tallymeter/tally/internal/httpsec"
)

// TLSConfig is how the node meets its clients: over TLS itself, or behind
// reverse proxies that terminate it.
type TLSConfig struct {
	// CertFile and KeyFile are TALLY_TLS_CERT and TALLY_TLS_KEY: a PEM
	// certificate (chain) and its key. Both set: serve speaks HTTPS only
	// (TLS 1.2 and later) and reloads the pair when the files change
	// (httpsec.CertReloader). Neither: plain HTTP.
	CertFile, KeyFile string
	// TrustedProxies is TALLY_TRUSTED_PROXIES: the reverse proxies whose
	// X-Forwarded-Proto and X-Forwarded-For are believed. Empty: no one's.
	TrustedProxies httpsec.Proxies
}

// Enabled reports whether serve speaks TLS itself.
func (t TLSConfig) Enabled() bool { return t.CertFile != "" }

// tlsSettings say how the node meets its clients: its certificate, and the
// proxies it believes.
func tlsSettings() []setting {
	return []setting{
		{"TALLY_TLS_CERT", "tls-cert", "PEM certificate (chain) file; with TALLY_TLS_KEY, serve speaks HTTPS (TLS 1.2+) and reloads the pair when the files change; unset: plain HTTP", "",
			str(func(c *Config) *string { return &c.TLS.CertFile })},
		{"TALLY_TLS_KEY", "tls-key", "PEM private key file of TALLY_TLS_CERT", "",
			str(func(c *Config) *string { return &c.TLS.KeyFile })},
		{"TALLY_TRUSTED_PROXIES", "trusted-proxies", "comma-separated IPs or CIDRs of the reverse proxies whose X-Forwarded-Proto and X-Forwarded-For are believed; unset: no one's", "",
			func(c *Config, v string) error {
				p, err := httpsec.ParseProxies(v)
				c.TLS.TrustedProxies = p
				return err
			}},
	}
}

// tlsProblems: the certificate and key come together, readable and
// matching.
func (c *Config) tlsProblems() []error {
	t := c.TLS
	switch {
	case t.CertFile == "" && t.KeyFile == "":
		return nil
	case t.KeyFile == "":
		return []error{errors.New("TALLY_TLS_CERT is set without TALLY_TLS_KEY: set both, or neither for plain HTTP")}
	case t.CertFile == "":
		return []error{errors.New("TALLY_TLS_KEY is set without TALLY_TLS_CERT: set both, or neither for plain HTTP")}
	}
	if _, err := httpsec.LoadPair(t.CertFile, t.KeyFile); err != nil {
		return []error{err}
	}
	return nil
}
