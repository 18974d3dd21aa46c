package outbox

import (
	"context"
	"fmt"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// NotifyChannel is the channel the outbox notifies when items become
// pending: deliverers LISTEN on it and claim at once instead of waiting for
// their poll. On one server the payload is empty; on a distributed
// database it names the buckets of the items (Store.Stir reads it), empty
// when they may be anywhere. A notification is delivered when its
// transaction commits, and never after a rollback; equal ones of one
// transaction are delivered once.
const NotifyChannel = "tally_outbox"

// sqlNotify wakes the deliverers when the transaction that runs it commits.
// It is a statement of its own that reads no table, so that a distributed
// database runs it where the transaction began, never on the node that
// holds an item (a NOTIFY there would keep a write to two nodes from
// committing).
const sqlNotify = `SELECT pg_notify('` + NotifyChannel + `', $1)`

// notify sends sqlNotify on q: given a transaction, inside it. The outbox
// sends it once per statement that makes items pending — stage, and an
// operator's requeue or recovery to pending — and never per row; a retry
// falls due later, when the deliverers' poll finds it. buckets are those
// of the items on a distributed database; without shards or buckets the
// notification names none (any bucket), as on one server, whose claims
// read every bucket at once.
func notify(ctx context.Context, q pgdb.Querier, shards *tenantbucket.Shards, buckets []int16) error {
	payload := ""
	if shards != nil && shards.Distributed() {
		payload = formatBuckets(buckets)
	}
	if _, err := q.Exec(ctx, sqlNotify, payload); err != nil {
		return fmt.Errorf("outbox: notifying the deliverers: %w", err)
	}
	return nil
}
