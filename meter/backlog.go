package meter

import (
	"context"
	"fmt"
	"time"

	"github.com/tallymeter/tally/internal/pgdb"
)

// Backlog is the ledger's usage that no staging pass has put into an
// outbox item yet: while export is stalled it grows here, not in the
// outbox.
type Backlog struct {
	// Events counts the unstaged ledger rows up to BacklogCountCap: at
	// the cap there are at least that many.
	Events int64
	// OldestAge is how long ago, by the database's clock, the oldest
	// unstaged row was received; 0 when there is none.
	OldestAge time.Duration
}

// BacklogCountCap bounds the count of a backlog reading, so that a scrape
// costs the same however long export has been stalled: a count grows with
// the rows it reads. Past it the oldest row's age says how bad the stall
// is.
const BacklogCountCap = 100_000

// backlogSQL reads both from the partial index usage_events_unstaged_received:
// the oldest from its left edge, the count from its first BacklogCountCap
// entries (the ORDER BY keeps the planner on it: a scan of the table in any
// other order would read every staged row before the newest unstaged ones).
// The index's predicate has a term no other statement states
// (received_at > '-infinity'), so that staging's lookups are never
// planned on it; both reads state it.
const backlogSQL = `
	SELECT (SELECT count(*) FROM (SELECT FROM usage_events WHERE item_id IS NULL AND received_at > '-infinity'
			ORDER BY received_at LIMIT $1) AS unstaged),
		coalesce(extract(epoch FROM statement_timestamp() - (SELECT min(received_at) FROM usage_events
			WHERE item_id IS NULL AND received_at > '-infinity')), 0)::float8`

// ReadBacklog reads the ledger backlog: cheap enough to read at every
// scrape (the metrics tally_ledger_unstaged_events and
// tally_ledger_oldest_unstaged_age_seconds).
func ReadBacklog(ctx context.Context, q pgdb.Querier) (Backlog, error) {
	var (
		b       Backlog
		seconds float64
	)
	if err := q.QueryRow(ctx, backlogSQL, BacklogCountCap).Scan(&b.Events, &seconds); err != nil {
		return Backlog{}, fmt.Errorf("meter: reading the ledger backlog: %w", err)
	}
	b.OldestAge = time.Duration(max(seconds, 0) * float64(time.Second))
	return b, nil
}
