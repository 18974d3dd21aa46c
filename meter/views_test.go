package meter_test

import (
	"context"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/meter"
)

type otherJob struct{}

func (otherJob) Kind() string { return "other" }

// The last staging pass is the latest completed staging job, by the
// database's clock; other jobs and unfinished passes do not count.
func TestSinceLastStage(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	_, ok, err := meter.SinceLastStage(ctx, pool)
	require.NoError(t, err)
	require.False(t, ok, "no pass yet")

	rc, err := river.NewClient(riverpgxv5.New(pool), &river.Config{}) // insert-only
	require.NoError(t, err)
	finish := func(args river.JobArgs, state string, ago time.Duration) {
		t.Helper()
		res, err := rc.Insert(ctx, args, nil)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `UPDATE river_job SET state = $2, attempt = 1, attempted_at = clock_timestamp() - $3::interval,
			finalized_at = clock_timestamp() - $3::interval WHERE id = $1`, res.Job.ID, state, ago)
		require.NoError(t, err)
	}
	finish(meter.StageArgs{}, "completed", 10*time.Minute)
	finish(meter.StageArgs{}, "completed", 2*time.Minute)
	finish(meter.StageArgs{}, "discarded", time.Second)
	finish(otherJob{}, "completed", time.Second)

	age, ok, err := meter.SinceLastStage(ctx, pool)
	require.NoError(t, err)
	require.True(t, ok)
	require.InDelta(t, (2 * time.Minute).Seconds(), age.Seconds(), 30)
}
