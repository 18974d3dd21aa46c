package outbox

import (
	"context"
	"fmt"

	"github.com/tallymeter/tally/internal/pgdb"
)

// NotifyChannel is the channel the outbox notifies, with an empty payload,
// when items become pending: deliverers LISTEN on it and claim at once
// instead of waiting for their poll. A notification is delivered when its
// transaction commits, and never after a rollback; those of one
// transaction are delivered once.
const NotifyChannel = "tally_outbox"

// sqlNotify wakes the deliverers when the transaction that runs it commits.
// It is a statement of its own that reads no table, so that a distributed
// database runs it where the transaction began, never on the node that
// holds an item (a NOTIFY there would keep a write to two nodes from
// committing).
const sqlNotify = `SELECT pg_notify('` + NotifyChannel + `', '')`

// notify sends sqlNotify on q: given a transaction, inside it. The outbox
// sends it once per statement that makes items pending — stage, and an
// operator's requeue or recovery to pending — and never per row; a retry
// falls due later, when the deliverers' poll finds it.
func notify(ctx context.Context, q pgdb.Querier) error {
	if _, err := q.Exec(ctx, sqlNotify); err != nil {
		return fmt.Errorf("outbox: notifying the deliverers: %w", err)
	}
	return nil
}
