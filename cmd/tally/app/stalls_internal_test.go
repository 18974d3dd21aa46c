package app

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// The console's banner names each connected account Stripe refuses, one
// line an account, beside the node's own reasons; the metric only counts
// them.
func TestConsoleStallsNameEachRefusedConnectedAccount(t *testing.T) {
	t.Parallel()
	res, err := exporter.NewResolver(exporter.Settings{Key: stripesim.DefaultKey, APIBase: "http://127.0.0.1:1"})
	require.NoError(t, err)
	ob, err := outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)
	stalls := consoleStalls(exporter.NewStalls(res, ob, testdb.New(t), 0))
	ctx := context.Background()
	for _, s := range stalls(ctx) {
		require.NotEqual(t, string(exporter.StallAccountRefused), s.Reason)
	}

	res.Connected().Refused("acct_1Beta", 403)
	res.Connected().Refused("acct_1Alpha", 400)
	var lines []string
	for _, s := range stalls(ctx) {
		if s.Reason == string(exporter.StallAccountRefused) {
			lines = append(lines, s.Text)
		}
	}
	require.Len(t, lines, 2, "one line an account")
	require.Contains(t, lines[0], "acct_1Alpha")
	require.Contains(t, lines[0], "status 400")
	require.Contains(t, lines[1], "acct_1Beta")

	res.Connected().Works("acct_1Alpha")
	res.Connected().Works("acct_1Beta")
	for _, s := range stalls(ctx) {
		require.NotEqual(t, string(exporter.StallAccountRefused), s.Reason)
	}
}
