package config_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/meter"
)

func TestCoalesceSettingsRefuseWhatCouldNotWork(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env     map[string]string
		wantErr string
	}{
		{map[string]string{"TALLY_INGEST_COALESCE_WAIT": "-1ms"}, "TALLY_INGEST_COALESCE_WAIT must be 0 to 1s"},
		{map[string]string{"TALLY_INGEST_COALESCE_WAIT": "2s"}, "TALLY_INGEST_COALESCE_WAIT must be 0 to 1s"},
		{map[string]string{"TALLY_INGEST_COALESCE_EVENTS": "-1"}, "TALLY_INGEST_COALESCE_EVENTS must be 0 to 10000"},
		{map[string]string{"TALLY_INGEST_COALESCE_EVENTS": "10001"}, "TALLY_INGEST_COALESCE_EVENTS must be 0 to 10000"},
		{map[string]string{"TALLY_INGEST_COALESCE_BYTES": "0"}, "TALLY_INGEST_COALESCE_BYTES must be positive"},
		{map[string]string{"TALLY_INGEST_COALESCE_COMMITS": "0"}, "TALLY_INGEST_COALESCE_COMMITS must be at least 1"},
		{map[string]string{"TALLY_INGEST_COALESCE_WAIT": "soon"}, "not a duration"},
	} {
		_, err := load(t, tc.env)
		require.ErrorContains(t, err, tc.wantErr, "%v", tc.env)
	}
	c, err := load(t, map[string]string{"TALLY_INGEST_COALESCE_WAIT": "2ms", "TALLY_INGEST_COALESCE_EVENTS": "0"})
	require.NoError(t, err)
	require.Equal(t, meter.Coalescing{Wait: 2 * time.Millisecond, MaxBytes: meter.DefaultCoalesceBytes, Commits: meter.DefaultCoalesceCommits}, c.Coalesce)
}
