package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// sqlWithdraw is T11: a pending or quarantined item none of whose attempts
// may have reached the provider ends withdrawn. A pending item is not
// leased, so no send of it is in flight; the predicate is re-checked on the
// row the UPDATE locks. A quarantined item's reason is cleared (a CHECK
// allows one only on quarantined and superseded items); the cancellation
// that withdrew it says why.
const sqlWithdraw = `
UPDATE outbox_item_states SET state = 'withdrawn', quarantine_reason = NULL, updated_at = clock_timestamp()
WHERE id = @id AND state IN ('pending', 'quarantined') AND refused_attempts = attempts`

// Withdraw is T11, inside the caller's transaction: item id, pending or
// quarantined, ends withdrawn, never to be sent, because the usage it
// carries was cancelled. Only an item proven not to have reached the
// provider may be withdrawn: otherwise ErrMayHaveReached (the usage must be
// taken back from the provider instead). In another state it is a
// *StateError (leased: ask again once the lease ends). A write that changes
// nothing is counted as stale and reported, never retried here; the caller
// rolls back.
func (s *Store) Withdraw(ctx context.Context, tx pgx.Tx, id int64) error {
	tag, err := tx.Exec(ctx, sqlWithdraw, pgx.NamedArgs{"id": id})
	if err != nil {
		return fmt.Errorf("outbox: T11 withdraw item %d: %w", id, err)
	}
	if tag.RowsAffected() == 1 {
		s.metrics.moved("T11", StateWithdrawn)
		return nil
	}
	s.metrics.staleWrites("T11", 1)
	var (
		state             State
		token             int64
		refused, attempts int
	)
	err = tx.QueryRow(ctx, `SELECT state, lease_token, refused_attempts, attempts FROM outbox_item_states WHERE id = $1`, id).
		Scan(&state, &token, &refused, &attempts)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: %d", ErrNotFound, id)
	case err != nil:
		return fmt.Errorf("outbox: T11: re-reading item %d: %w", id, err)
	case state != StatePending && state != StateQuarantined:
		return &StateError{ID: id, Transition: "T11", Expected: StatePending, Current: state, CurrentLeaseToken: token}
	case refused != attempts:
		return fmt.Errorf("%w: item %d", ErrMayHaveReached, id)
	}
	return fmt.Errorf("outbox: T11: item %d changed nothing for no reason found", id)
}
