package reconcile_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// The latest successful run is the greatest id among the succeeded ones;
// its age is since the latest finish among them, by the database's clock.
func TestLatestSucceededAndSinceLastSuccess(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	_, ok, err := reconcile.LatestSucceeded(ctx, pool)
	require.NoError(t, err)
	require.False(t, ok, "no run yet")
	_, ok, err = reconcile.SinceLastSuccess(ctx, pool)
	require.NoError(t, err)
	require.False(t, ok, "no run yet")

	var ids []int64
	for i := 0; i < 3; i++ {
		id, err := reconcile.Queue(ctx, pool, reconcile.TriggerAPI, "test", reconcile.Options{})
		require.NoError(t, err)
		ids = append(ids, id)
	}
	// The first finished an hour ago, the second two hours ago; the third
	// failed a minute ago.
	_, err = pool.Exec(ctx, `UPDATE reconcile_runs SET status = CASE WHEN id = $3 THEN 'failed' ELSE 'succeeded' END,
		finished_at = clock_timestamp() - CASE id WHEN $1 THEN interval '1 hour' WHEN $2 THEN interval '2 hours' ELSE interval '1 minute' END`,
		ids[0], ids[1], ids[2])
	require.NoError(t, err)

	id, ok, err := reconcile.LatestSucceeded(ctx, pool)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, ids[1], id)
	age, ok, err := reconcile.SinceLastSuccess(ctx, pool)
	require.NoError(t, err)
	require.True(t, ok)
	require.InDelta(t, time.Hour.Seconds(), age.Seconds(), 30)
}

// A Stripe event is recorded once RecordReport has recorded it.
func TestEventRecorded(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	store, err := outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)
	seen, err := reconcile.EventRecorded(ctx, pool, "evt_1")
	require.NoError(t, err)
	require.False(t, seen)

	res, err := reconcile.RecordReport(ctx, pool, store, stripeapi.MeterErrorReport{ID: "evt_1",
		Type: stripeapi.EventNoMeterFound, Created: time.Now(), ErrorCount: 1})
	require.NoError(t, err)
	require.True(t, res.Recorded)
	seen, err = reconcile.EventRecorded(ctx, pool, "evt_1")
	require.NoError(t, err)
	require.True(t, seen)
	seen, err = reconcile.EventRecorded(ctx, pool, "evt_2")
	require.NoError(t, err)
	require.False(t, seen)
}
