package app

import (
	"bytes"
	"context"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
)

// River's logger passes on warnings and errors, except that an error about
// a context already canceled (River inserting a job as the node stops) is a
// warning; any other error stays an error, and info stays out.
func TestQuieterRiverLogger(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	log := slog.New(quieter{slog.NewTextHandler(&buf, nil), slog.LevelWarn})
	ctx := context.Background()

	log.InfoContext(ctx, "jobs worked")
	require.Empty(t, buf.String())
	log.ErrorContext(ctx, "Client: Failed to send job insert notification", "err", "timeout: context already done: context canceled")
	require.Contains(t, buf.String(), "level=WARN")
	require.NotContains(t, buf.String(), "level=ERROR")
	require.Contains(t, buf.String(), "context canceled")
	buf.Reset()
	log.ErrorContext(ctx, "Client: Failed to send job insert notification", "err", "connection refused")
	require.Contains(t, buf.String(), "level=ERROR")
}
