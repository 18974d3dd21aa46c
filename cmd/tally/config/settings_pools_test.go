package config_test

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPoolSettingsRefuseSizesThatWouldStarveAWorkload(t *testing.T) {
	t.Parallel()
	_, err := load(t, map[string]string{"TALLY_POOL_READS": "0", "TALLY_POOL_RIVER": "2",
		"TALLY_READ_TIMEOUT": "0s", "TALLY_READS_PER_TOKEN": "0", "TALLY_REPORT_MAX_AGE": "-1s", "TALLY_REPORT_TIMEOUT": "0s"})
	require.Error(t, err)
	for _, want := range []string{"TALLY_POOL_READS must be at least 1", "TALLY_POOL_RIVER must be at least 3, got 2",
		"TALLY_READ_TIMEOUT must be positive", "TALLY_READS_PER_TOKEN must be at least 1", "TALLY_REPORT_MAX_AGE must not be negative", "TALLY_REPORT_TIMEOUT must be positive"} {
		require.Contains(t, err.Error(), want)
	}
}

func TestPoolSettingsAreRead(t *testing.T) {
	t.Parallel()
	c, err := load(t, map[string]string{"TALLY_POOL_INGEST": "3", "TALLY_POOL_EXPORT": "5", "TALLY_POOL_RIVER": "3",
		"TALLY_POOL_READS": "2", "TALLY_READ_TIMEOUT": "2s", "TALLY_READS_PER_TOKEN": "1", "TALLY_REPORT_MAX_AGE": "0"})
	require.NoError(t, err)
	require.Equal(t, 3, c.Pools.Ingest)
	require.Equal(t, 5, c.Pools.Export)
	require.Equal(t, 3, c.Pools.River)
	require.Equal(t, 2, c.Pools.Reads)
	require.Equal(t, "2s", c.Pools.ReadTimeout.String())
	require.Equal(t, 1, c.Pools.ReadsPerToken)
	require.Zero(t, c.Pools.ReportMaxAge, "0 is allowed: compute whenever no computation runs")
}
