package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/tallymeter/tally/internal/pgdb"
)

// sqlOldestRetrying finds the first attempt of the item retrying longest:
// pending again after a failed attempt (a retry, or rate-limited) within
// its current attempt budget, or leased again after one. Its WHERE is the
// predicate of the partial index outbox_item_states_retrying, which answers
// it from its left edge however many items wait.
const sqlOldestRetrying = `SELECT extract(epoch FROM statement_timestamp() - min(first_attempt_at))::float8 FROM outbox_item_states
	WHERE (state = 'pending' AND attempts > attempts_base) OR (state = 'leased' AND attempts > attempts_base + 1)`

// OldestRetrying is how long ago, by the database's clock, the item that
// has been retrying longest was first attempted, and false when no item is
// retrying. Export that keeps failing (Stripe unreachable, answering 5xx,
// refusing the key) makes it grow without bound; one that recovers makes
// it small again. Cheap enough to read at every scrape.
func (s *Store) OldestRetrying(ctx context.Context, q pgdb.Querier) (time.Duration, bool, error) {
	var seconds *float64
	if err := q.QueryRow(ctx, sqlOldestRetrying).Scan(&seconds); err != nil {
		return 0, false, fmt.Errorf("outbox: reading the oldest retrying item: %w", err)
	}
	if seconds == nil {
		return 0, false, nil
	}
	return time.Duration(max(*seconds, 0) * float64(time.Second)), true, nil
}
