package main

import (
	"bytes"
	"context"
	"flag"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/stripesim"
)

// tally dev --sim-fault sets the fault switches of the simulator dev
// starts, with tally stripe-sim's names; a name or value it does not know
// is a usage error, and with STRIPE_API_KEY set (no simulator) it is
// refused.
func TestDevSimFault(t *testing.T) {
	t.Parallel()
	devFlagsOf := func(args ...string) (*devFlags, error) {
		f := &devFlags{}
		fs := flag.NewFlagSet("tally dev", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		f.register(fs)
		return f, fs.Parse(args)
	}
	for _, bad := range []string{"nope=1", "lose-reply", "latency=soon", "hang=x"} {
		_, err := devFlagsOf("--sim-fault", bad)
		require.Error(t, err, bad)
	}
	_, err := devFlagsOf("--sim-fault", "nope=1")
	require.ErrorContains(t, err, "lose-reply", "the error lists the faults")

	f, err := devFlagsOf("--sim-fault", "rate-limit-fault=1")
	require.NoError(t, err)
	_, err = f.prepare(context.Background(), &config.Config{StripeAPIKey: "sk_test_mine"}, io.Discard)
	require.ErrorContains(t, err, "STRIPE_API_KEY")

	f, err = devFlagsOf("--sim-listen", "127.0.0.1:0", "--sim-fault", "rate-limit-fault=1", "--sim-fault", "latency=1ms")
	require.NoError(t, err)
	cfg := config.Config{Listen: "127.0.0.1:1"}
	sim, err := f.prepare(context.Background(), &cfg, io.Discard)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sim.Close() })
	form := url.Values{"event_name": {"api_calls"}, "payload[stripe_customer_id]": {"cus_acme"}, "payload[value]": {"1"}}
	req, err := http.NewRequest(http.MethodPost, cfg.StripeAPIBase+"/v1/billing/meter_events", strings.NewReader(form.Encode()))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+stripesim.DefaultKey)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusTooManyRequests, resp.StatusCode, "every call meets the fault")
}

// tally dev with STRIPE_API_KEY starts no simulator and maps no demo, so
// it prints neither: no simulator address, demo or demo curl, even when
// STRIPE_API_BASE is the address dev's own simulator would take.
func TestDevPrintsNoSimulatorLinesWithoutOne(t *testing.T) {
	t.Parallel()
	f := &devFlags{simListen: "127.0.0.1:12111"}
	var out bytes.Buffer
	e := &env{cfg: config.Config{StripeAPIKey: "sk_test_mine", StripeAPIBase: "http://127.0.0.1:12111"}, stdout: &out}
	f.printReady(e, "127.0.0.1:8080", "tally_admin", "tally_ingest", "")
	for _, line := range []string{"_sim", "simulator at", "Demo", "acme", "Post usage"} {
		require.NotContains(t, out.String(), line)
	}
	require.Contains(t, out.String(), "Stripe:       STRIPE_API_KEY's account at http://127.0.0.1:12111 (no simulator started, no demo mapped)")
	require.Contains(t, out.String(), "Ingest token: tally_ingest")

	f.simStarted = true
	out.Reset()
	f.printReady(e, "127.0.0.1:8080", "tally_admin", "tally_ingest", "")
	require.Contains(t, out.String(), "the built-in simulator at http://127.0.0.1:12111")
	require.Contains(t, out.String(), "curl -sS http://127.0.0.1:12111/_sim/events")
}
