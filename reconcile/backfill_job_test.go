package reconcile_test

import (
	"context"
	"testing"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/reconcile"
)

// One listing at a time in the cluster: while one is queued or running,
// another node's insert (River's periodic enqueuer, on a new leader) is
// skipped as a duplicate.
func TestBackfillJobIsUnique(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	workers := river.NewWorkers()
	river.AddWorker(workers, &reconcile.BackfillWorker{})
	client, err := river.NewClient(riverpgxv5.New(testdb.New(t)), &river.Config{Workers: workers})
	require.NoError(t, err)
	first, err := client.Insert(ctx, reconcile.BackfillArgs{}, nil)
	require.NoError(t, err)
	require.False(t, first.UniqueSkippedAsDuplicate)
	require.Equal(t, reconcile.BackfillQueue, first.Job.Queue)
	again, err := client.Insert(ctx, reconcile.BackfillArgs{}, nil)
	require.NoError(t, err)
	require.True(t, again.UniqueSkippedAsDuplicate)
	require.Equal(t, first.Job.ID, again.Job.ID)
	require.NotNil(t, reconcile.PeriodicBackfill(reconcile.DefaultBackfillInterval))
}
