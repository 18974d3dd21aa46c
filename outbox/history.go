package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// Snapshot is the number of items in one state at one moment, as the
// maintenance pass keeps it (at most one set every five minutes) for the
// console's charts.
type Snapshot struct {
	At    time.Time
	State State
	Items int64
}

// sqlSnapshots reads the snapshots of some states taken within a span
// before the database's clock, oldest first.
const sqlSnapshots = `SELECT at, state, items FROM outbox_snapshots
	WHERE at > clock_timestamp() - @within::interval AND state = ANY (@states::text[])
	ORDER BY at`

// Snapshots reads the maintenance pass's snapshots of the given states taken
// within the last span (by the database's clock), oldest first.
func (s *Store) Snapshots(ctx context.Context, q pgdb.Querier, within time.Duration, states []State) ([]Snapshot, error) {
	names := make([]string, len(states))
	for i, st := range states {
		names[i] = string(st)
	}
	rows, err := q.Query(ctx, sqlSnapshots, pgx.NamedArgs{"within": within, "states": names})
	if err != nil {
		return nil, fmt.Errorf("outbox: reading snapshots: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Snapshot, error) {
		var sn Snapshot
		err := row.Scan(&sn.At, &sn.State, &sn.Items)
		return sn, err
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: reading snapshots: %w", err)
	}
	return out, nil
}

// HourCount is a count of the things of one hour.
type HourCount struct {
	// Hour is the hour's start (date_trunc in the database session's time
	// zone).
	Hour  time.Time
	Count int64
}

// sqlAcceptedPerHour counts the accepted outcomes of the attempt log per
// hour of recording, within a span before the database's clock.
const sqlAcceptedPerHour = `SELECT date_trunc('hour', recorded_at) AS h, count(*) FROM outbox_attempts
	WHERE outcome = 'accepted' AND recorded_at > statement_timestamp() - @within::interval GROUP BY 1 ORDER BY 1`

// AcceptedPerHour counts the attempts whose outcome was accepted, per
// hour in which they were recorded, within the last span (by the database's
// clock), oldest hour first. An hour without one is absent.
func (s *Store) AcceptedPerHour(ctx context.Context, q pgdb.Querier, within time.Duration) ([]HourCount, error) {
	rows, err := q.Query(ctx, sqlAcceptedPerHour, pgx.NamedArgs{"within": within})
	if err != nil {
		return nil, fmt.Errorf("outbox: counting accepted attempts: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (HourCount, error) {
		var h HourCount
		err := row.Scan(&h.Hour, &h.Count)
		return h, err
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: counting accepted attempts: %w", err)
	}
	return out, nil
}
