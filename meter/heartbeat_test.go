package meter_test

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/meter"
)

// A staging pass skipped because export is stalled (no destination) staged
// nothing: it completes, but it does not refresh the staging heartbeat; a
// pass that could stage does.
func TestSkippedStagingPassIsNoHeartbeat(t *testing.T) {
	t.Parallel()
	e := setup(t).Env
	var stalled atomic.Bool
	target := e.Stager.Target
	stager := &meter.Stager{Outbox: e.Outbox, Grace: time.Minute, Target: func(ctx context.Context) (meter.Target, bool) {
		if stalled.Load() {
			return meter.Target{}, false
		}
		return target(ctx)
	}}
	workers := river.NewWorkers()
	river.AddWorker(workers, &meter.StageWorker{Stager: stager, DB: e.Pool, Logger: slog.Default()})
	rc, err := river.NewClient(riverpgxv5.New(e.Pool), &river.Config{Queues: map[string]river.QueueConfig{
		river.QueueDefault: {MaxWorkers: 1}}, Workers: workers, FetchPollInterval: 100 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	done, cancel := rc.Subscribe(river.EventKindJobCompleted, river.EventKindJobFailed)
	t.Cleanup(cancel)
	require.NoError(t, rc.Start(e.Ctx))
	t.Cleanup(func() { _ = rc.Stop(context.Background()) })
	pass := func() int64 {
		t.Helper()
		res, err := rc.Insert(e.Ctx, meter.StageArgs{}, nil)
		require.NoError(t, err)
		select {
		case ev := <-done:
			require.Equal(t, res.Job.ID, ev.Job.ID)
			require.Equal(t, rivertype.JobStateCompleted, ev.Job.State)
		case <-time.After(30 * time.Second):
			t.Fatal("the staging pass did not finish")
		}
		return res.Job.ID
	}
	since := func() (time.Duration, bool) {
		t.Helper()
		age, ok, err := meter.SinceLastStage(e.Ctx, e.Pool)
		require.NoError(t, err)
		return age, ok
	}

	stalled.Store(true)
	pass()
	_, ok := since()
	require.False(t, ok, "a skipped pass is no heartbeat")

	stalled.Store(false)
	staged := pass()
	age, ok := since()
	require.True(t, ok, "a pass that could stage is a heartbeat")
	require.Less(t, age, time.Minute)

	// That pass was ten minutes ago; export stalls and the next pass skips.
	_, err = e.Pool.Exec(e.Ctx, `UPDATE river_job SET finalized_at = clock_timestamp() - interval '10 minutes' WHERE id = $1`, staged)
	require.NoError(t, err)
	stalled.Store(true)
	pass()
	age, ok = since()
	require.True(t, ok)
	require.InDelta(t, (10 * time.Minute).Seconds(), age.Seconds(), 30, "the skipped pass did not refresh the heartbeat")
}
