package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"time"
)

// healthcheckTimeout bounds tally healthcheck's request.
const healthcheckTimeout = 5 * time.Second

// healthcheckCommand is tally healthcheck: GET /healthz of the serve that
// this configuration describes, on this machine, succeeding on 200. It is
// the container image's HEALTHCHECK, which has no shell or curl to run.
func healthcheckCommand() command {
	return command{name: "healthcheck", noDB: true, run: func(ctx context.Context, e *env, _ []string) error {
		return healthcheck(ctx, e.cfg.Listen, e.cfg.TLS.Enabled())
	}}
}

// healthcheck asks GET /healthz of a serve listening on listen (TLS on
// with useTLS) from this machine: a wildcard host is asked on loopback.
func healthcheck(ctx context.Context, listen string, useTLS bool) error {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return fmt.Errorf("TALLY_LISTEN %q: %w", listen, err)
	}
	switch host {
	case "", "0.0.0.0":
		host = "127.0.0.1"
	case "::":
		host = "::1"
	}
	// No proxy: the node is asked on this machine.
	scheme, transport := "http", &http.Transport{}
	if useTLS {
		// The certificate names the service, not the loopback address
		// asked; the probe sends nothing and reads only the status.
		scheme, transport.TLSClientConfig = "https", &tls.Config{InsecureSkipVerify: true}
	}
	ctx, cancel := context.WithTimeout(ctx, healthcheckTimeout)
	defer cancel()
	url := scheme + "://" + net.JoinHostPort(host, port) + "/healthz"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := (&http.Client{Transport: transport}).Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return nil
}
