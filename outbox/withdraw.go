package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/tenantbucket"
)

// sqlWithdraw is the withdraw transition: a pending or quarantined item none
// of whose attempts may have reached the provider ends withdrawn. A pending
// item is not leased, so no send of it is in flight; the predicate is
// re-checked on the row the UPDATE locks. A quarantined item's reason is
// cleared (a CHECK allows one only on quarantined and superseded items); the
// cancellation that withdrew it says why.
const sqlWithdraw = `
UPDATE outbox_item_states SET state = 'withdrawn', quarantine_reason = NULL, updated_at = statement_timestamp()
WHERE bucket = @bucket AND id = @id AND state IN ('pending', 'quarantined') AND refused_attempts = attempts`

// Withdraw is the withdraw transition, inside the caller's transaction: item
// id of bucket (its tenant's, tenantbucket.Of), pending or quarantined, ends withdrawn, never to be sent, because the
// usage it carries was cancelled. Only an item proven not to have reached the
// provider may be withdrawn: otherwise ErrMayHaveReached (the usage must be
// taken back from the provider instead). In another state it is a *StateError
// (leased: ask again once the lease ends). A write that changes nothing is
// counted as stale and reported, never retried here; the caller rolls back.
func (s *Store) Withdraw(ctx context.Context, tx pgx.Tx, id int64, bucket int16) error {
	tag, err := tx.Exec(ctx, sqlWithdraw, pgx.NamedArgs{"id": id, "bucket": bucket})
	if err != nil {
		return fmt.Errorf("outbox: withdraw item %d: %w", id, err)
	}
	if tag.RowsAffected() == 1 {
		s.metrics.moved(TransitionWithdraw, StateWithdrawn)
		return nil
	}
	s.metrics.staleWrites(TransitionWithdraw, 1)
	var (
		state             State
		token             int64
		refused, attempts int
	)
	err = tx.QueryRow(ctx, `SELECT state, lease_token, refused_attempts, attempts FROM outbox_item_states WHERE bucket = $2 AND id = $1`, id, bucket).
		Scan(&state, &token, &refused, &attempts)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: %d", ErrNotFound, id)
	case err != nil:
		return fmt.Errorf("outbox: withdraw: re-reading item %d: %w", id, err)
	case state != StatePending && state != StateQuarantined:
		return &StateError{ID: id, Transition: TransitionWithdraw, Expected: StatePending, Current: state, CurrentLeaseToken: token}
	case refused != attempts:
		return fmt.Errorf("%w: item %d", ErrMayHaveReached, id)
	}
	return fmt.Errorf("outbox: withdraw: item %d changed nothing for no reason found", id)
}

// sqlLockLive follows an item's chain of successors to the one that carries
// its usage now and locks that item's state row: a cancellation decides on
// it, and no transition of another writer may slip in before its own. A
// successor is its predecessor's tenant's, so the chain stays in the
// item's bucket, which every reference names: one shard's statement.
const sqlLockLive = `
WITH RECURSIVE chain (id, next, depth) AS (
    SELECT id, superseded_by, 0 FROM outbox_item_states WHERE bucket = @bucket AND id = @id
    UNION ALL
    SELECT o.id, o.superseded_by, c.depth + 1 FROM outbox_item_states o JOIN chain c ON o.id = c.next
    WHERE o.bucket = @bucket AND c.depth < 1000
)
SELECT s.id FROM outbox_item_states s
WHERE s.bucket = @bucket AND s.id = (SELECT id FROM chain WHERE next IS NULL) FOR UPDATE`

// sqlLiveItem reads the item LockLive locked, by its bucket.
var sqlLiveItem = "SELECT " + columns() + " FROM outbox_items WHERE bucket = $2 AND id = $1"

// LockLive locks, inside the caller's transaction, the item that carries
// the usage of item id of bucket (its tenant's) now (id itself, or the
// end of its chain of successors) and returns it as read under the lock.
// A re-address that commits between following the chain and taking the
// lock (a supersede of another transaction, which the lock waited for)
// leaves the locked item superseded: LockLive then follows on from it, and
// locks its successor.
func (s *Store) LockLive(ctx context.Context, tx pgx.Tx, id int64, bucket int16) (Item, error) {
	from := id
	for range maxChain {
		var live int64
		err := tx.QueryRow(ctx, sqlLockLive, pgx.NamedArgs{"id": from, "bucket": bucket}).Scan(&live)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return Item{}, fmt.Errorf("%w: %d", ErrNotFound, id)
		case err != nil:
			return Item{}, fmt.Errorf("outbox: locking the item that carries item %d: %w", id, err)
		}
		it, err := scanItem(tx.QueryRow(ctx, sqlLiveItem, live, bucket))
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return Item{}, fmt.Errorf("%w: %d", ErrNotFound, live)
		case err != nil:
			return Item{}, fmt.Errorf("outbox: reading item %d: %w", live, err)
		case it.State != StateSuperseded || it.SupersededBy == nil:
			return it, nil
		}
		from = *it.SupersededBy
	}
	return Item{}, fmt.Errorf("outbox: the chain of successors of item %d is longer than %d", id, maxChain)
}

// maxChain bounds the chains of successors LockLive follows, as
// sqlLockLive and tally_live_item bound their own.
const maxChain = 1000

// sqlSupersedeCancelled is the supersede_cancelled transition: supersede's
// predicate, from pending as well as quarantined.
const sqlSupersedeCancelled = `
UPDATE outbox_item_states SET state = 'superseded', superseded_by = @successor, updated_at = statement_timestamp()
WHERE bucket = @bucket AND id = @id AND state IN ('pending', 'quarantined') AND refused_attempts = attempts`

// SupersedeCancelled is the supersede_cancelled transition, inside the
// caller's transaction: a window's item, pending or quarantined, none of
// whose attempts may have reached the provider, is re-addressed without an
// event that was cancelled — the successor (rebuilt from the rows left, under
// an identity of its own) is enqueued and the item superseded by it.
// Otherwise ErrMayHaveReached or a *StateError; the caller rolls back, and
// the successor is not kept. The successor's tenant is the item's, and
// names the bucket of both.
func (s *Store) SupersedeCancelled(ctx context.Context, tx pgx.Tx, id int64, successor NewItem) (Enqueued, error) {
	old, enq, err := s.enqueueSuccessor(ctx, tx, TransitionSupersedeCancelled, id, successor)
	if err != nil {
		return Enqueued{}, err
	}
	tag, err := tx.Exec(ctx, sqlSupersedeCancelled, pgx.NamedArgs{"id": id, "successor": enq.ID, "bucket": tenantbucket.Of(successor.TenantKey)})
	if err != nil {
		return Enqueued{}, fmt.Errorf("outbox: supersede cancelled item %d: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		s.metrics.staleWrites(TransitionSupersedeCancelled, 1)
		switch {
		case old.State != StatePending && old.State != StateQuarantined:
			return Enqueued{}, &StateError{ID: id, Transition: TransitionSupersedeCancelled, Expected: StatePending, Current: old.State, CurrentLeaseToken: old.LeaseToken}
		case old.RefusedAttempts != old.Attempts:
			return Enqueued{}, fmt.Errorf("%w: item %d", ErrMayHaveReached, id)
		}
		return Enqueued{}, fmt.Errorf("outbox: supersede cancelled: item %d changed meanwhile", id)
	}
	s.metrics.moved(TransitionSupersedeCancelled, StateSuperseded)
	return enq, nil
}
