package meter

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// A pass whose process was killed stays 'running' in river_job. It must
// hold up staging only until the next bucket, not until River's rescuer
// (an hour) — the end-to-end kill test found staging stopped for good.
func TestStageJobAfterCrashedPass(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testdb.URL(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	rc, err := river.NewClient(riverpgxv5.New(pool), &river.Config{}) // insert-only
	require.NoError(t, err)

	const period = time.Second
	// Start early in a bucket so the first two inserts share it.
	time.Sleep(time.Until(time.Now().Truncate(period).Add(period)))
	first, err := rc.Insert(ctx, StageArgs{}, stageInsertOpts(period))
	require.NoError(t, err)
	require.False(t, first.UniqueSkippedAsDuplicate)
	// The process running it dies: the row stays 'running'.
	_, err = pool.Exec(ctx, `UPDATE river_job SET state = 'running', attempt = 1, attempted_at = now() WHERE id = $1`, first.Job.ID)
	require.NoError(t, err)

	again, err := rc.Insert(ctx, StageArgs{}, stageInsertOpts(period))
	require.NoError(t, err)
	require.True(t, again.UniqueSkippedAsDuplicate, "one pass per bucket while one runs")

	time.Sleep(time.Until(time.Now().Truncate(period).Add(period)))
	next, err := rc.Insert(ctx, StageArgs{}, stageInsertOpts(period))
	require.NoError(t, err)
	require.False(t, next.UniqueSkippedAsDuplicate, "the next bucket's pass is not held up by the dead one")
}
