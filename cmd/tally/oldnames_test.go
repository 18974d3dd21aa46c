package main

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/config"
)

// A setting given by its old name is one warning line at start, naming
// the old and the new name.
func TestOldSettingNamesAreOneWarningEach(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&buf, nil))
	warnOldNames(logger, []config.OldName{
		{Old: "TALLY_INGEST_COALESCE_WAIT", New: "TALLY_INGEST_GROUP_COMMIT_WAIT"},
		{Old: "--ingest-coalesce-events", New: "--ingest-group-commit-events"},
	})
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.Len(t, lines, 2)
	require.Contains(t, lines[0], "level=WARN")
	require.Contains(t, lines[0], "old=TALLY_INGEST_COALESCE_WAIT new=TALLY_INGEST_GROUP_COMMIT_WAIT")
	require.Contains(t, lines[1], "old=--ingest-coalesce-events new=--ingest-group-commit-events")

	buf.Reset()
	warnOldNames(logger, nil)
	require.Empty(t, buf.String())
}
