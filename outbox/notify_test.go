package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// The channel and payload deliverers listen for; a listener built before
// the outbox sent its own notification hears these.
const (
	wakeChannel = "tally_outbox"
	wakePayload = ""
	sentinel    = "sentinel"
)

// listen LISTENs on the outbox's channel on a connection of its own and
// returns a check of what the transactions committed before it heard:
// woke, the outbox's notification once, then nothing more. It commits a
// sentinel notification of its own and reads up to it: notifications are
// delivered in commit order, so nothing sent before the sentinel is
// missed and no wait for a notification that never comes is needed.
func listen(t *testing.T, b *testBundle) func(t *testing.T, woke bool) {
	t.Helper()
	conn, err := b.pool.Acquire(b.ctx)
	require.NoError(t, err)
	t.Cleanup(conn.Release)
	_, err = conn.Exec(b.ctx, "LISTEN "+wakeChannel)
	require.NoError(t, err)
	return func(t *testing.T, woke bool) {
		t.Helper()
		_, err := b.pool.Exec(b.ctx, `SELECT pg_notify($1, $2)`, wakeChannel, sentinel)
		require.NoError(t, err)
		var heard []string
		for len(heard) == 0 || heard[len(heard)-1] != sentinel {
			ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
			n, err := conn.Conn().WaitForNotification(ctx)
			cancel()
			require.NoError(t, err, "heard %q before the sentinel", heard)
			require.Equal(t, wakeChannel, n.Channel)
			heard = append(heard, n.Payload)
		}
		if woke {
			require.Equal(t, []string{wakePayload, sentinel}, heard, "the deliverers are woken once, after the commit")
		} else {
			require.Equal(t, []string{sentinel}, heard, "nothing wakes the deliverers")
		}
	}
}

// inTx runs f in a transaction, committed or rolled back.
func inTx(t *testing.T, b *testBundle, commit bool, f func(tx pgx.Tx)) {
	t.Helper()
	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	f(tx)
	if commit {
		require.NoError(t, tx.Commit(b.ctx))
	} else {
		require.NoError(t, tx.Rollback(b.ctx))
	}
}

func TestNotifyChannelIsTheListenersOne(t *testing.T) {
	t.Parallel()
	require.Equal(t, wakeChannel, outbox.NotifyChannel)
}

// TestStageWakesTheDeliverersAfterCommit: a stage that inserts a pending
// item wakes the deliverers when its transaction commits, once however many
// items it inserts; rolled back, or inserting no pending item, it wakes
// nobody.
func TestStageWakesTheDeliverersAfterCommit(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	heard := listen(t, b)

	inTx(t, b, false, func(tx pgx.Tx) {
		_, err := b.store.Enqueue(b.ctx, tx, newItem(1))
		require.NoError(t, err)
	})
	heard(t, false)

	inTx(t, b, true, func(tx pgx.Tx) {
		_, err := b.store.Enqueue(b.ctx, tx, newItem(1))
		require.NoError(t, err)
		_, err = b.store.Enqueue(b.ctx, tx, newItem(2))
		require.NoError(t, err)
	})
	heard(t, true)

	inTx(t, b, false, func(tx pgx.Tx) {
		_, err := b.store.EnqueueBatch(b.ctx, tx, []outbox.NewItem{newItem(3), newItem(4)})
		require.NoError(t, err)
	})
	heard(t, false)

	inTx(t, b, true, func(tx pgx.Tx) {
		_, err := b.store.EnqueueBatch(b.ctx, tx, []outbox.NewItem{newItem(3), newItem(4)})
		require.NoError(t, err)
	})
	heard(t, true)

	// Nothing new to send: an item staged again, one staged quarantined or
	// withdrawn.
	quarantined, withdrawn := newItem(5), newItem(6)
	quarantined.Quarantine = outbox.ReasonNoCustomer
	withdrawn.Withdrawn = true
	inTx(t, b, true, func(tx pgx.Tx) {
		res, err := b.store.Enqueue(b.ctx, tx, newItem(1))
		require.NoError(t, err)
		require.False(t, res.Inserted)
		_, err = b.store.Enqueue(b.ctx, tx, quarantined)
		require.NoError(t, err)
		_, err = b.store.Enqueue(b.ctx, tx, withdrawn)
		require.NoError(t, err)
		_, err = b.store.EnqueueBatch(b.ctx, tx, []outbox.NewItem{newItem(3)})
		require.NoError(t, err)
	})
	heard(t, false)
}

// TestRequeueWakesTheDeliverersAfterCommit: an operator's requeue wakes the
// deliverers when its transaction commits, and not when it rolls back or is
// refused.
func TestRequeueWakesTheDeliverersAfterCommit(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, newItem(1))
	l := b.claimOne(t)
	require.NoError(t, b.store.Quarantine(b.ctx, b.pool, l, outbox.ReasonMeterNotFound, outbox.ErrorInfo{Code: "meter_not_found", Status: 400}))
	heard := listen(t, b)

	inTx(t, b, false, func(tx pgx.Tx) { require.NoError(t, b.store.Requeue(b.ctx, tx, ids[0], 1)) })
	heard(t, false)
	inTx(t, b, true, func(tx pgx.Tx) {
		require.ErrorIs(t, b.store.Requeue(b.ctx, tx, ids[0], 2), outbox.ErrMappingChanged)
	})
	heard(t, false)
	inTx(t, b, true, func(tx pgx.Tx) { require.NoError(t, b.store.Requeue(b.ctx, tx, ids[0], 1)) })
	heard(t, true)
	require.Equal(t, outbox.StatePending, b.get(t, ids[0]).State)
}

// TestRecoverWakesTheDeliverersAfterCommit: an operator's recovery of an
// uncertain item to pending wakes the deliverers when its transaction
// commits; rolled back, or to accepted or rejected, it wakes nobody.
func TestRecoverWakesTheDeliverersAfterCommit(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, newItem(1), newItem(2))
	for range ids {
		require.NoError(t, b.store.MarkUncertain(b.ctx, b.pool, b.claimOne(t), outbox.ErrorInfo{Code: "timeout"}, false))
	}
	heard := listen(t, b)

	toPending := outbox.Recovery{To: outbox.StatePending, ExpectLeaseToken: 1}
	inTx(t, b, false, func(tx pgx.Tx) { require.NoError(t, b.store.Recover(b.ctx, tx, ids[0], toPending)) })
	heard(t, false)
	inTx(t, b, true, func(tx pgx.Tx) {
		require.NoError(t, b.store.Recover(b.ctx, tx, ids[1], outbox.Recovery{To: outbox.StateRejected, ExpectLeaseToken: 1}))
	})
	heard(t, false)
	inTx(t, b, true, func(tx pgx.Tx) { require.NoError(t, b.store.Recover(b.ctx, tx, ids[0], toPending)) })
	heard(t, true)
	require.Equal(t, outbox.StatePending, b.get(t, ids[0]).State)
}

// TestSupersedeWakesTheDeliverersForItsSuccessor: a re-addressed item's
// successor, staged pending in the supersede's transaction, wakes the
// deliverers when it commits.
func TestSupersedeWakesTheDeliverersForItsSuccessor(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	it := newItem(1)
	it.Quarantine = outbox.ReasonNoCustomer
	it.Payload.Customer = ""
	ids := b.enqueue(t, it)
	heard := listen(t, b)

	succ := newItem(1)
	succ.MappingVersion = 2
	inTx(t, b, false, func(tx pgx.Tx) {
		_, err := b.store.Supersede(b.ctx, tx, ids[0], 1, succ)
		require.NoError(t, err)
	})
	heard(t, false)
	inTx(t, b, true, func(tx pgx.Tx) {
		_, err := b.store.Supersede(b.ctx, tx, ids[0], 1, succ)
		require.NoError(t, err)
	})
	heard(t, true)
}

// TestSettlingWakesNobody: a retry falls due later and the deliverers'
// poll finds it; the outcomes that end delivery have nothing to send.
func TestSettlingWakesNobody(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, newItem(1), newItem(2))
	heard := listen(t, b)

	st, err := b.store.Retry(b.ctx, b.pool, b.claimOne(t), outbox.ErrorInfo{Code: "timeout"}, false)
	require.NoError(t, err)
	require.Equal(t, outbox.StatePending, st)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, b.claimOne(t), "ref"))
	heard(t, false)
}
