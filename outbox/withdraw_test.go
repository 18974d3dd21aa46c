package outbox_test

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/outbox"
)

// withdraw runs the withdraw transition on id in a transaction of its own,
// committed when it succeeds.
func (b *testBundle) withdraw(t *testing.T, id int64) error {
	t.Helper()
	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	if err := b.store.Withdraw(b.ctx, tx, id, tenantbucket.Of("acme")); err != nil {
		return err
	}
	return tx.Commit(b.ctx)
}

// withdraw takes a pending item, or a quarantined one, that no attempt may have
// reached the provider with, to withdrawn, which nothing leaves: no claim
// takes it, no requeue revives it, and the gauge counts it.
func TestWithdrawTakesOnlyItemsNothingOfWhichMayHaveReachedTheProvider(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	q := newItem(2)
	q.Quarantine = outbox.ReasonNoCustomer
	ids := b.enqueue(t, newItem(1), q, newItem(3), newItem(4), newItem(5))
	pending, quarantined, refusedOnce, mayHaveReached, leased := ids[0], ids[1], ids[2], ids[3], ids[4]

	// refusedOnce: an attempt the provider refused (nothing reached it);
	// mayHaveReached: a timeout (it may have).
	for _, l := range b.claim(t, outbox.ClaimOptions{Owner: "w", Limit: 10, Policy: outbox.BestEffort}) {
		switch l.ID {
		case refusedOnce:
			_, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "stripe_auth", Status: 401}, true)
			require.NoError(t, err)
		case mayHaveReached:
			_, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "timeout"}, false)
			require.NoError(t, err)
		case pending:
			_, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "limiter"}, true)
			require.NoError(t, err)
		}
	}

	require.NoError(t, b.withdraw(t, pending))
	require.NoError(t, b.withdraw(t, quarantined))
	require.NoError(t, b.withdraw(t, refusedOnce))
	for _, id := range []int64{pending, quarantined, refusedOnce} {
		it := b.get(t, id)
		require.Equal(t, outbox.StateWithdrawn, it.State)
		require.Empty(t, it.QuarantineReason)
	}
	require.ErrorIs(t, b.withdraw(t, mayHaveReached), outbox.ErrMayHaveReached)
	require.Equal(t, outbox.StatePending, b.get(t, mayHaveReached).State)

	var se *outbox.StateError
	require.True(t, errors.As(b.withdraw(t, leased), &se), "a leased item is not withdrawn")
	require.Equal(t, outbox.StateLeased, se.Current)
	require.True(t, errors.As(b.withdraw(t, pending), &se), "withdrawn is terminal")
	require.Equal(t, outbox.StateWithdrawn, se.Current)
	require.ErrorIs(t, b.withdraw(t, 1<<40), outbox.ErrNotFound)
	require.Equal(t, 4.0, b.stale(outbox.TransitionWithdraw), "every write that changed nothing is counted")

	// Nothing leaves withdrawn: no claim takes it, the database refuses any
	// edge out.
	for _, l := range b.claim(t, outbox.ClaimOptions{Owner: "w2", Limit: 10, Policy: outbox.BestEffort}) {
		require.NotContains(t, []int64{pending, quarantined, refusedOnce}, l.ID)
	}
	for _, to := range []string{"pending", "leased", "quarantined", "superseded", "accepted"} {
		_, err := b.pool.Exec(b.ctx, `UPDATE outbox_item_states SET state = $2 WHERE id = $1`, pending, to)
		require.ErrorContains(t, err, "not an edge of the state machine", to)
	}
	// The database holds the predicate too.
	_, err := b.pool.Exec(b.ctx, `UPDATE outbox_item_states SET state = 'withdrawn' WHERE id = $1`, mayHaveReached)
	require.ErrorContains(t, err, "outbox_items_withdrawn_check")
	_, err = b.pool.Exec(b.ctx, `UPDATE outbox_item_states SET state = 'superseded', superseded_by = $2 WHERE id = $1`, mayHaveReached, pending)
	require.ErrorContains(t, err, "outbox_items_withdrawn_check", "a pending item that may have reached the provider is never superseded")

	b.requireGaugeIsTheTable(t)
	g, err := b.store.ReadGauge(b.ctx, b.pool)
	require.NoError(t, err)
	require.Equal(t, int64(3), g.Counts[outbox.StateWithdrawn])
}

// stage_withdrawn: an item enqueued withdrawn needs nothing sendable, and
// never goes out; a withdrawn enqueue may not also be quarantined.
func TestEnqueueWithdrawn(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	it := newItem(1)
	it.Payload.Customer, it.Payload.EventName, it.DestinationAccount, it.MappingVersion = "", "", "", 0
	it.Withdrawn = true
	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	enq, err := b.store.Enqueue(b.ctx, tx, it)
	require.NoError(t, err)
	require.Equal(t, outbox.StateWithdrawn, enq.State)
	require.NoError(t, tx.Commit(b.ctx))
	require.Empty(t, b.claim(t, outbox.ClaimOptions{Owner: "w", Limit: 10, Policy: outbox.BestEffort}))

	both := newItem(2)
	both.Withdrawn, both.Quarantine = true, outbox.ReasonNoCustomer
	err = pgx.BeginFunc(b.ctx, b.pool, func(tx pgx.Tx) error {
		_, err := b.store.Enqueue(b.ctx, tx, both)
		return err
	})
	require.ErrorContains(t, err, "withdrawn or quarantined, not both")
}

// LockLive follows a re-address that commits while it waits for the lock:
// the item it found at the end of the chain is superseded by the time the
// lock is granted, and it locks and returns the successor instead — a
// cancellation racing the stager decides on the item that carries the
// usage, never on a superseded one.
func TestLockLiveFollowsAReaddressItWaitedFor(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	id := b.enqueue(t, newItem(1))[0]

	readdress, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = readdress.Rollback(b.ctx) }()
	succ := newItem(1)
	succ.SubjectRef = outbox.ReaddressRef(succ.SubjectRef)
	enq, err := b.store.SupersedeCancelled(b.ctx, readdress, id, succ)
	require.NoError(t, err)

	type locked struct {
		it  outbox.Item
		err error
	}
	cancel, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = cancel.Rollback(b.ctx) }()
	got := make(chan locked, 1)
	go func() {
		it, err := b.store.LockLive(b.ctx, cancel, id, tenantbucket.Of("acme"))
		got <- locked{it, err}
	}()
	require.Eventually(t, func() bool {
		var waiting bool
		_ = b.pool.QueryRow(b.ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database())`).Scan(&waiting)
		return waiting
	}, 10*time.Second, 5*time.Millisecond, "LockLive waits for the re-address")
	require.NoError(t, readdress.Commit(b.ctx))

	r := <-got
	require.NoError(t, r.err)
	require.Equal(t, enq.ID, r.it.ID, "the successor carries the usage now")
	require.Equal(t, outbox.StatePending, r.it.State)
	_, err = b.pool.Exec(b.ctx, `SELECT id FROM outbox_item_states WHERE id = $1 FOR UPDATE NOWAIT`, enq.ID)
	require.ErrorContains(t, err, "could not obtain lock", "the successor is locked for the caller")
}
