package main

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/reconcile"
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

// Every refusal code has an exit status and prints its condition; an error
// without a code is a failure (1) printed as it is.
func TestExitStatusOfEveryCode(t *testing.T) {
	t.Parallel()
	cmd := command{name: "requeue"}
	for _, tc := range []struct {
		err    error
		status int
		line   string
	}{
		{errcode.New(errcode.NotFound, "", "outbox: no such item"), 1, "tally requeue: not_found: outbox: no such item\n"},
		{errcode.New(errcode.Conflict, "successor_exists", "x"), 1, "tally requeue: successor_exists: x\n"},
		{errcode.New(errcode.Stale, "", "x"), 1, "tally requeue: stale: x\n"},
		{errcode.New(errcode.Forbidden, "", "x"), 1, "tally requeue: forbidden: x\n"},
		{errcode.New(errcode.Unavailable, "", "x"), 1, "tally requeue: unavailable: x\n"},
		{fmt.Errorf("%w: a reason is required", reconcile.ErrInvalidRecovery), 2, "tally requeue: reconcile: invalid recovery: a reason is required\n"},
		{&reconcile.ExpectedStateError{ID: 4, Expected: "uncertain", Current: "pending"}, 1, "tally requeue: expected_state_mismatch: item 4 is pending, not uncertain\n"},
		{usageError{"--limit must be 1 to 10000"}, 2, "tally requeue: --limit must be 1 to 10000\n"},
		{errors.New("connection refused"), 1, "tally requeue: connection refused\n"},
	} {
		var stderr bytes.Buffer
		require.Equal(t, tc.status, exitStatus(cmd, &stderr, tc.err), "%v", tc.err)
		require.Equal(t, tc.line, stderr.String())
	}
	for _, c := range errcode.Codes {
		var stderr bytes.Buffer
		require.NotZero(t, exitStatus(cmd, &stderr, errcode.New(c, "", "x")), c)
	}
}
