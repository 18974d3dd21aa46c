package outbox_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// TestLateItemsAreCounted: an item staged late (Payload.Late) counts in
// tally_outbox_late_items_total whether it is quarantined period_closed
// or sent, by Enqueue and EnqueueBatch alike, and the reason has a series
// at 0 before the first.
func TestLateItemsAreCounted(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	require.Equal(t, 0.0, b.counterValue("tally_outbox_late_items_total"))
	require.Equal(t, 0.0, b.counterValue("tally_outbox_quarantined_total", "reason", "period_closed"))

	quarantined, sent, onTime := newItem(1), newItem(2), newItem(3)
	quarantined.Payload.Late, quarantined.Quarantine = true, outbox.ReasonPeriodClosed
	sent.Payload.Late = true
	ids := b.enqueue(t, quarantined)
	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	_, err = b.store.EnqueueBatch(b.ctx, tx, []outbox.NewItem{sent, onTime})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(b.ctx))

	require.Equal(t, 2.0, b.counterValue("tally_outbox_late_items_total"))
	require.Equal(t, 1.0, b.counterValue("tally_outbox_quarantined_total", "reason", "period_closed"))
	it, err := b.store.Get(b.ctx, b.pool, ids[0])
	require.NoError(t, err)
	require.Equal(t, outbox.StateQuarantined, it.State)
	require.True(t, it.Payload.Late, "the mark is stored with the payload")
}
