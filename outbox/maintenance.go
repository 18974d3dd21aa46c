package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// sqlSweep is the sweep, run by the maintenance pass, to items no deliverer may
// send again: pending, or leased with an expired lease, and past the attempt
// cap (a crash loop that never reached an answer) or past the horizon while
// some attempt may have reached the provider. The claim already refuses
// them; this makes them visible as uncertain. A swept expired lease records
// its attempt as abandoned. "due" locks the rows in id order and reads their
// state as locked; rows another transaction holds are skipped until the next
// pass. Only an attempted item can be past either (the cap is at least
// one), so pending items are read from the index of attempted ones: the
// backlog never sent costs a pass nothing. The update finds the rows "due"
// locked by primary key and compares their state under collation "C",
// which no partial index's predicate uses, as the claim's lease does: else
// the planner may read every pending item through the partial indexes.
const sqlSweep = `
WITH due AS MATERIALIZED (
    SELECT o.id, o.state AS prev_state FROM outbox_item_states o
    WHERE ((o.state = 'pending' AND o.attempts > 0) OR (` + leaseExpired + `))
      AND (o.attempts - o.attempts_base >= @max
           OR (o.refused_attempts < o.attempts AND o.first_attempt_at + @horizon::interval <= statement_timestamp()))
    ORDER BY o.id
    FOR UPDATE SKIP LOCKED
),
t AS (
    UPDATE outbox_item_states o SET
        state             = 'uncertain',
        last_error_code   = CASE WHEN o.attempts - o.attempts_base >= @max THEN 'attempt_cap' ELSE 'horizon' END,
        last_error_status = NULL,
        last_error        = CASE WHEN o.attempts - o.attempts_base >= @max
                                 THEN 'attempt cap reached without an answer'
                                 ELSE 'idempotency horizon passed before the item could be sent again' END,
        lease_expires_at  = NULL,
        updated_at        = statement_timestamp()
    FROM due d
    WHERE o.id = d.id
      AND (o.state = 'pending' COLLATE "C" OR (o.state = 'leased' COLLATE "C" AND o.lease_expires_at < statement_timestamp()))
      AND (o.attempts - o.attempts_base >= @max
           OR (o.refused_attempts < o.attempts AND o.first_attempt_at + @horizon::interval <= statement_timestamp()))
    RETURNING o.id, d.prev_state, o.lease_token, o.lease_owner, o.leased_at, o.last_error_code, o.last_error, o.bucket
),
log AS (
    INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused,
                                 error_code, error_message, bucket)
    SELECT id, lease_token, lease_owner, leased_at, 'abandoned', 'uncertain', false, last_error_code, last_error, bucket
    FROM t WHERE prev_state = 'leased'
)
SELECT id FROM t`

// Sweep runs the sweep transition over every item past its cap or horizon
// that no deliverer holds, and returns the ids it made uncertain. Safe to run
// on every node at once: each row moves at most once.
func (s *Store) Sweep(ctx context.Context, q pgdb.Querier) ([]int64, error) {
	rows, err := q.Query(ctx, sqlSweep, pgx.NamedArgs{"max": s.cfg.MaxAttempts, "horizon": s.cfg.Horizon})
	if err != nil {
		return nil, fmt.Errorf("outbox: sweep: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("outbox: sweep: %w", err)
	}
	for range ids {
		s.metrics.moved(TransitionSweep, StateUncertain)
	}
	return ids, nil
}

// MaintenanceResult is what one maintenance pass did.
type MaintenanceResult struct {
	// Swept are the items the pass made uncertain (the sweep).
	Swept []int64
	// Gauge is the reading taken after the sweep.
	Gauge Gauge
}

// Maintain runs one maintenance pass: the sweep, then the gauge (its
// watermark advanced first).
func (s *Store) Maintain(ctx context.Context, q pgdb.Querier) (MaintenanceResult, error) {
	swept, err := s.Sweep(ctx, q)
	if err != nil {
		return MaintenanceResult{}, err
	}
	if err := advanceGauge(ctx, q); err != nil {
		return MaintenanceResult{Swept: swept}, err
	}
	g, err := s.ReadGauge(ctx, q)
	if err != nil {
		return MaintenanceResult{Swept: swept}, err
	}
	if err := s.snapshot(ctx, q, g); err != nil {
		return MaintenanceResult{Swept: swept, Gauge: g}, err
	}
	return MaintenanceResult{Swept: swept, Gauge: g}, nil
}

// snapshot keeps the gauge for the console's charts: at most one row per
// state every five minutes across every node (the clock compared in SQL),
// the minute as key so that two nodes racing write once. The latest
// snapshot is max(at), read from the key's end: a search for any snapshot
// after a bound that clock_timestamp() sets would read every snapshot ever
// kept.
func (s *Store) snapshot(ctx context.Context, q pgdb.Querier, g Gauge) error {
	states := make([]string, 0, len(g.Counts))
	counts := make([]int64, 0, len(g.Counts))
	for st, n := range g.Counts {
		states, counts = append(states, string(st)), append(counts, n)
	}
	_, err := q.Exec(ctx, `INSERT INTO outbox_snapshots (at, state, items)
		SELECT date_trunc('minute', clock_timestamp()), s, n FROM unnest(@states::text[], @counts::bigint[]) AS u(s, n)
		WHERE coalesce((SELECT max(at) FROM outbox_snapshots) <= clock_timestamp() - interval '5 minutes', true)
		ON CONFLICT DO NOTHING`, pgx.NamedArgs{"states": states, "counts": counts})
	if err != nil {
		return fmt.Errorf("outbox: snapshot: %w", err)
	}
	return nil
}

// RunMaintenance runs Maintain every interval until ctx ends. A failed pass is
// logged and the next one runs on schedule; it returns ctx's error. Every node
// may run it: every write it makes is conditional.
func (s *Store) RunMaintenance(ctx context.Context, q pgdb.Querier, interval time.Duration, logger *slog.Logger) error {
	if interval <= 0 {
		return fmt.Errorf("outbox: maintenance interval must be positive, got %s", interval)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		res, err := s.Maintain(ctx, q)
		if err == nil {
			s.lastMaintained.Store(time.Now().UnixNano())
		}
		switch {
		case err != nil && ctx.Err() == nil:
			logger.ErrorContext(ctx, "outbox maintenance failed", "error", err)
		case len(res.Swept) > 0:
			logger.WarnContext(ctx, "outbox items made uncertain: past the attempt cap or the horizon; they need a human",
				"count", len(res.Swept))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
