package exporter

import (
	"bytes"
	"context"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
)

// A key Stripe refuses on the account lookup is logged once, as an error
// naming the status and nothing of the key or the answer's body, however
// often the lookup is tried again; once the key works, that is logged and
// Run ends.
func TestRunLogsARefusedKeyOnce(t *testing.T) {
	t.Parallel()
	const key = "sk_test_rolled0123456789"
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(srv.Close)
	r, err := NewResolver(Settings{Key: key, APIBase: srv.URL})
	require.NoError(t, err)
	r.retry = time.Millisecond

	var log bytes.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx, slog.New(slog.NewTextHandler(&log, nil))) }()
	require.Eventually(t, func() bool { return len(sim.Requests()) >= 5 }, 10*time.Second, time.Millisecond, "the lookup is tried again")
	require.Equal(t, StallKeyRefused, r.Stall())
	sim.AddKey(key, stripesim.DefaultAccount)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not end once the key worked")
	}

	text := log.String()
	require.Equal(t, 1, strings.Count(text, "Stripe refused the API key"), "logged once, not once a try: %s", text)
	require.Contains(t, text, "level=ERROR")
	require.Contains(t, text, "status=401")
	require.Contains(t, text, "Stripe's account lookup works")
	require.NotContains(t, text, "rolled0123456789", "no key in the log")
	require.NotContains(t, text, "Invalid API Key", "no answer's body in the log")
}
