package config_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/meter"
)

// TALLY_STAGE_WORKERS leaves the export pool a connection for the
// deliverers; 0 takes the node's cores, within half of the pool.
func TestStageWorkersLeaveTheDeliverersConnections(t *testing.T) {
	t.Parallel()
	for _, env := range []map[string]string{
		{"TALLY_STAGE_WORKERS": "-1"},
		{"TALLY_STAGE_WORKERS": "8"}, // the default export pool's 8
		{"TALLY_STAGE_WORKERS": "4", "TALLY_POOL_EXPORT": "4"},
	} {
		_, err := load(t, env)
		require.ErrorContains(t, err, "TALLY_STAGE_WORKERS must be 0 (the node's cores) or fewer than TALLY_POOL_EXPORT's", "%v", env)
	}
	c, err := load(t, map[string]string{"TALLY_STAGE_WORKERS": "3"})
	require.NoError(t, err)
	require.Equal(t, 3, meter.StageWorkers(c.StageWorkers, c.Pools.Export))
	c, err = load(t, nil)
	require.NoError(t, err)
	require.Zero(t, c.StageWorkers)
	n := meter.StageWorkers(c.StageWorkers, c.Pools.Export)
	require.True(t, n >= 1 && n <= c.Pools.Export/2, "%d workers on a pool of %d", n, c.Pools.Export)
}
