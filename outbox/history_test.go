package outbox_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// The snapshots are the asked states' within the span, oldest first.
func TestSnapshotsWithinSpanOldestFirst(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, newItem(1), newItem(2))
	_, err := b.store.Maintain(b.ctx, b.pool)
	require.NoError(t, err)
	_, err = b.pool.Exec(b.ctx, `INSERT INTO outbox_snapshots (at, state, items) VALUES
		(clock_timestamp() - interval '2 hours', 'pending', 7),
		(clock_timestamp() - interval '25 hours', 'pending', 9),
		(clock_timestamp() - interval '1 hour', 'confirmed', 3)`)
	require.NoError(t, err)

	got, err := b.store.Snapshots(b.ctx, b.pool, 24*time.Hour, []outbox.State{outbox.StatePending, outbox.StateUncertain})
	require.NoError(t, err)
	require.Len(t, got, 3, "the older pending row, then the maintenance pass's pending and uncertain")
	require.Equal(t, outbox.StatePending, got[0].State)
	require.Equal(t, int64(7), got[0].Items)
	counts := map[outbox.State]int64{}
	for _, sn := range got[1:] {
		require.True(t, sn.At.After(got[0].At), "oldest first")
		counts[sn.State] = sn.Items
	}
	require.Equal(t, map[outbox.State]int64{outbox.StatePending: 2, outbox.StateUncertain: 0}, counts)

	none, err := b.store.Snapshots(b.ctx, b.pool, 24*time.Hour, nil)
	require.NoError(t, err)
	require.Empty(t, none)
}

// Only accepted outcomes count, per hour of recording.
func TestAcceptedPerHourCountsAcceptedOnly(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, newItem(1), newItem(2), newItem(3))
	for i := 0; i < 2; i++ {
		require.NoError(t, b.store.Accept(b.ctx, b.pool, b.claimOne(t), fmt.Sprintf("evt_%d", i)))
	}
	_, err := b.store.Retry(b.ctx, b.pool, b.claimOne(t), outbox.ErrorInfo{Code: "timeout"}, false)
	require.NoError(t, err)

	hours, err := b.store.AcceptedPerHour(b.ctx, b.pool, 24*time.Hour)
	require.NoError(t, err)
	require.NotEmpty(t, hours)
	var total int64
	for i, h := range hours {
		require.Equal(t, h.Hour, h.Hour.Truncate(time.Hour), "an hour's start")
		if i > 0 {
			require.True(t, h.Hour.After(hours[i-1].Hour), "oldest hour first")
		}
		total += h.Count
	}
	require.Equal(t, int64(2), total)
}
