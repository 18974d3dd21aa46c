package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/tallymeter/tally/outbox"
)

// LatestSucceeded returns the id of the latest run that succeeded (the
// greatest id), and false when no run has.
func LatestSucceeded(ctx context.Context, q outbox.Querier) (int64, bool, error) {
	var id *int64
	if err := q.QueryRow(ctx, `SELECT max(id) FROM reconcile_runs WHERE status = 'succeeded'`).Scan(&id); err != nil {
		return 0, false, fmt.Errorf("reconcile: reading the latest successful run: %w", err)
	}
	if id == nil {
		return 0, false, nil
	}
	return *id, true, nil
}

// SinceLastSuccess is how long ago, by the database's clock, the run that
// succeeded last finished, on any node, and false when no run has
// succeeded.
func SinceLastSuccess(ctx context.Context, q outbox.Querier) (time.Duration, bool, error) {
	var seconds *float64
	err := q.QueryRow(ctx, `SELECT extract(epoch FROM clock_timestamp() - max(finished_at))::float8 FROM reconcile_runs
		WHERE status = 'succeeded'`).Scan(&seconds)
	if err != nil {
		return 0, false, fmt.Errorf("reconcile: reading the last successful run: %w", err)
	}
	if seconds == nil {
		return 0, false, nil
	}
	return time.Duration(*seconds * float64(time.Second)), true, nil
}

// EventRecorded reports whether Stripe's event with the id is recorded
// already (RecordReport records each once): a delivery of it again is a
// duplicate.
func EventRecorded(ctx context.Context, q outbox.Querier, id string) (bool, error) {
	var seen bool
	if err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM stripe_events WHERE id = $1)`, id).Scan(&seen); err != nil {
		return false, fmt.Errorf("reconcile: reading Stripe event %s: %w", id, err)
	}
	return seen, nil
}
