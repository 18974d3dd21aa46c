package config_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/meter"
)

func TestGroupCommitSettingsRefuseWhatCouldNotWork(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env     map[string]string
		wantErr string
	}{
		{map[string]string{"TALLY_INGEST_GROUP_COMMIT_WAIT": "-1ms"}, "TALLY_INGEST_GROUP_COMMIT_WAIT must be 0 to 1s"},
		{map[string]string{"TALLY_INGEST_GROUP_COMMIT_WAIT": "2s"}, "TALLY_INGEST_GROUP_COMMIT_WAIT must be 0 to 1s"},
		{map[string]string{"TALLY_INGEST_GROUP_COMMIT_EVENTS": "-1"}, "TALLY_INGEST_GROUP_COMMIT_EVENTS must be 0 to 10000"},
		{map[string]string{"TALLY_INGEST_GROUP_COMMIT_EVENTS": "10001"}, "TALLY_INGEST_GROUP_COMMIT_EVENTS must be 0 to 10000"},
		{map[string]string{"TALLY_INGEST_GROUP_COMMIT_BYTES": "0"}, "TALLY_INGEST_GROUP_COMMIT_BYTES must be positive"},
		{map[string]string{"TALLY_INGEST_GROUP_COMMIT_COMMITS": "0"}, "TALLY_INGEST_GROUP_COMMIT_COMMITS must be at least 1"},
		{map[string]string{"TALLY_INGEST_GROUP_COMMIT_WAIT": "soon"}, "not a duration"},
	} {
		_, err := load(t, tc.env)
		require.ErrorContains(t, err, tc.wantErr, "%v", tc.env)
	}
	c, err := load(t, map[string]string{"TALLY_INGEST_GROUP_COMMIT_WAIT": "2ms", "TALLY_INGEST_GROUP_COMMIT_EVENTS": "0"})
	require.NoError(t, err)
	require.Equal(t, meter.GroupCommit{Wait: 2 * time.Millisecond, MaxBytes: meter.DefaultGroupCommitBytes, Commits: meter.DefaultGroupCommitCommits}, c.GroupCommit)
}

// The group commit settings' old names still work, each noted for a
// warning, and the new name wins when both are given.
func TestGroupCommitOldNamesStillWork(t *testing.T) {
	t.Parallel()
	c, err := load(t, map[string]string{"TALLY_INGEST_COALESCE_WAIT": "2ms", "TALLY_INGEST_COALESCE_EVENTS": "100"},
		"--ingest-coalesce-commits", "3")
	require.NoError(t, err)
	require.Equal(t, meter.GroupCommit{Wait: 2 * time.Millisecond, MaxEvents: 100, MaxBytes: meter.DefaultGroupCommitBytes, Commits: 3}, c.GroupCommit)
	require.ElementsMatch(t, []config.OldName{
		{Old: "TALLY_INGEST_COALESCE_WAIT", New: "TALLY_INGEST_GROUP_COMMIT_WAIT"},
		{Old: "TALLY_INGEST_COALESCE_EVENTS", New: "TALLY_INGEST_GROUP_COMMIT_EVENTS"},
		{Old: "--ingest-coalesce-commits", New: "--ingest-group-commit-commits"},
	}, c.OldNames)

	c, err = load(t, map[string]string{"TALLY_INGEST_COALESCE_WAIT": "2ms", "TALLY_INGEST_GROUP_COMMIT_WAIT": "3ms"},
		"--ingest-coalesce-events", "100", "--ingest-group-commit-events", "200")
	require.NoError(t, err)
	require.Equal(t, 3*time.Millisecond, c.GroupCommit.Wait)
	require.Equal(t, 200, c.GroupCommit.MaxEvents)
	require.Len(t, c.OldNames, 2)

	_, err = load(t, map[string]string{"TALLY_INGEST_COALESCE_WAIT": "soon"})
	require.ErrorContains(t, err, "TALLY_INGEST_COALESCE_WAIT: ")

	c, err = load(t, nil)
	require.NoError(t, err)
	require.Empty(t, c.OldNames)
}
