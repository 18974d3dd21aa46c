package outbox_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// tableCounts counts the items of every state from the table itself: what
// the gauge must answer.
func (b *testBundle) tableCounts(t *testing.T) map[outbox.State]int64 {
	t.Helper()
	want := make(map[outbox.State]int64, len(outbox.States))
	for _, st := range outbox.States {
		want[st] = 0
	}
	rows, err := b.pool.Query(b.ctx, "SELECT state, count(*) FROM outbox_items GROUP BY state")
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var st outbox.State
		var n int64
		require.NoError(t, rows.Scan(&st, &n))
		want[st] = n
	}
	require.NoError(t, rows.Err())
	return want
}

// watermark is the gauge's watermark: items below it are counted once.
func (b *testBundle) watermark(t *testing.T) int64 {
	t.Helper()
	var below int64
	require.NoError(t, b.pool.QueryRow(b.ctx, "SELECT below FROM outbox_gauge_settled").Scan(&below))
	return below
}

// maintainUntilWatermarkPasses runs maintenance passes until the watermark
// is past below. A promotion waits for every transaction of the cluster
// that was running at its arming, the other tests' included.
func (b *testBundle) maintainUntilWatermarkPasses(t *testing.T, below int64) {
	t.Helper()
	require.Eventually(t, func() bool {
		_, err := b.store.Maintain(b.ctx, b.pool)
		require.NoError(t, err)
		return b.watermark(t) > below
	}, 30*time.Second, 5*time.Millisecond, "the watermark never passed %d", below)
}

func (b *testBundle) requireGaugeIsTheTable(t *testing.T) {
	t.Helper()
	g, err := b.store.ReadGauge(b.ctx, b.pool)
	require.NoError(t, err)
	require.Equal(t, b.tableCounts(t), g.Counts)
}

// An item below the watermark may still change state (here: confirmed,
// rejected after the watermark passed it); the gauge follows every state
// through the partial indexes and derives confirmed from the item count.
func TestGaugeCountsEveryStateWhileItsWatermarkMoves(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	var accepted []int64
	for round := range 4 {
		items := make([]outbox.NewItem, 6)
		for i := range items {
			items[i] = newItem(round*10 + i)
		}
		items[5].Quarantine = outbox.ReasonTimestampWindow
		b.enqueue(t, items...)
		leases := b.claim(t, outbox.ClaimOptions{Limit: 3})
		require.NoError(t, b.store.Accept(b.ctx, b.pool, leases[0], "r"))
		require.NoError(t, b.store.Accept(b.ctx, b.pool, leases[1], "r"))
		accepted = append(accepted, leases[0].ID, leases[1].ID)
		if round > 0 { // items from the first round, below the watermark by now
			_, _, err := b.store.Confirm(b.ctx, b.pool, accepted[:2*round])
			require.NoError(t, err)
		}
		require.NoError(t, b.store.Reject(b.ctx, b.pool, leases[2], outbox.ErrorInfo{Code: "bad", Status: 400}))
		for range 3 {
			_, err := b.store.Maintain(b.ctx, b.pool)
			require.NoError(t, err)
			b.requireGaugeIsTheTable(t)
		}
	}
	b.maintainUntilWatermarkPasses(t, 1)
	b.requireGaugeIsTheTable(t)
	require.Positive(t, b.tableCounts(t)[outbox.StateConfirmed])
}

// A transaction that took an item's id before the watermark was picked may
// commit after: the watermark passes it only once that transaction ended,
// so the item is counted once and never lost below the watermark.
func TestGaugeWatermarkWaitsForTransactionsThatMayStillAddItems(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	open, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = open.Rollback(b.ctx) }()
	_, err = b.store.Enqueue(b.ctx, open, newItem(1)) // id 1, not yet committed
	require.NoError(t, err)
	b.enqueue(t, newItem(2)) // id 2, committed

	for range 5 { // pick, arm, then promotions refused while the enqueue is open
		_, err := b.store.Maintain(b.ctx, b.pool)
		require.NoError(t, err)
	}
	require.Equal(t, int64(1), b.watermark(t))

	require.NoError(t, open.Commit(b.ctx))
	b.maintainUntilWatermarkPasses(t, 1)
	require.Equal(t, int64(3), b.watermark(t))
	b.requireGaugeIsTheTable(t)
	g, err := b.store.ReadGauge(b.ctx, b.pool)
	require.NoError(t, err)
	require.Equal(t, int64(2), g.Counts[outbox.StatePending])
	require.Zero(t, g.Counts[outbox.StateConfirmed])
}
