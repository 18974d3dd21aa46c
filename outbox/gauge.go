package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// Gauge is one reading of the outbox: the count of every state and the age
// of the oldest item not yet answered.
type Gauge struct {
	// Counts has an entry for every state, zero included.
	Counts map[State]int64
	// OldestPendingAgeSeconds is how long ago the oldest pending or leased
	// item was created, by the database clock; 0 when there is none.
	OldestPendingAgeSeconds float64
}

// sqlGauge is the gauge in one query, whose cost does not grow with the
// items that reached confirmed: every other state is counted
// through a partial index of its own (superseded through
// outbox_item_states_superseded_by: superseded_by is set exactly when an item is
// superseded), and confirmed is every item less those. Every item is @items,
// the items below the watermark @below (sqlGaugeSettled, counted once when
// it advanced: sqlGaugeAdvance), and those from it on. @below is a
// parameter, not a subquery, so that the planner sees how few items lie
// beyond it (by the primary key's actual end). The oldest item not yet
// answered is the older of the oldest pending one (its own index) and the
// oldest leased one (among the few in flight): no index a claim writes
// serves the gauge alone. The oldest pending one is the index's first
// entry, asked for as such (ORDER BY … LIMIT 1), not as min(): the planner
// may compute min() by reading every entry, as it does where its statistics
// say nothing is pending (a history analysed before a backlog), and a
// backlog of a million would then be a million entries read. Both pending
// reads say "created_at IS NOT NULL" (always true): the index's predicate
// says it too, so that no claim can read the index whole.
const sqlGauge = `
SELECT (SELECT count(*) FROM outbox_item_states WHERE state = 'pending' AND created_at IS NOT NULL),
       (SELECT count(*) FROM outbox_item_states WHERE state = 'leased'),
       (SELECT count(*) FROM outbox_item_states WHERE state = 'accepted'),
       (SELECT count(*) FROM outbox_item_states WHERE state = 'uncertain'),
       (SELECT count(*) FROM outbox_item_states WHERE state = 'rejected'),
       (SELECT count(*) FROM outbox_item_states WHERE state = 'quarantined'),
       (SELECT count(*) FROM outbox_item_states WHERE superseded_by IS NOT NULL),
       (SELECT count(*) FROM outbox_item_states WHERE state = 'withdrawn'),
       @items::bigint + (SELECT count(*) FROM outbox_item_states WHERE id >= @below::bigint),
       coalesce(extract(epoch FROM statement_timestamp() - least(
           (SELECT created_at FROM outbox_item_states WHERE state = 'pending' AND created_at IS NOT NULL ORDER BY created_at LIMIT 1),
           (SELECT min(created_at) FROM outbox_item_states WHERE state = 'leased'))), 0)::float8`

// sqlGaugeSettled reads the watermark and the items below it. A pair read
// once stays true: no item is ever added below a watermark after it
// advanced, nor deleted, so sqlGauge may read the items from it in a later
// snapshot.
const sqlGaugeSettled = `SELECT below, items FROM outbox_gauge_settled`

// The gauge's watermark moves in three steps, at most one each per
// maintenance pass, every step a conditional UPDATE of the one row
// (two nodes racing: one wins, the other changes nothing):
//
//   - promote: when every transaction that held an id at the arming has
//     ended (the oldest running transaction is at or past next_xmax), no
//     item can still appear below next_below: count the items from below to
//     next_below once, and make next_below the watermark;
//   - arm: a pass after the pick, note the next transaction id. A
//     transaction that took an id below next_below before the pick has
//     written its row (and so holds a transaction id) long before: a pass
//     is seconds, taking an id and writing its row microseconds;
//   - pick: the next watermark is past the highest id committed now.
//
// A promotion counts the items inserted since the previous one, by the
// primary key: the gauge reads at most a few passes' items beyond it.
//
// Each step is its own statement on outbox_gauge_settled alone, a table
// of the coordinator; the counts of the items it needs are read first, by
// statements of their own (on a distributed database they read every
// shard, and Citus joins no coordinator table with them).
const (
	sqlGaugeStep = `SELECT below, next_below, next_xmax::text,
       next_xmax IS NOT NULL AND pg_snapshot_xmin(pg_current_snapshot()) >= next_xmax
FROM outbox_gauge_settled`
	sqlGaugeRange   = `SELECT count(*) FROM outbox_item_states WHERE id >= $1 AND id < $2`
	sqlGaugePromote = `UPDATE outbox_gauge_settled SET items = items + $3, below = next_below, next_below = NULL, next_xmax = NULL
WHERE below = $1 AND next_below = $2 AND next_xmax IS NOT NULL AND pg_snapshot_xmin(pg_current_snapshot()) >= next_xmax`
	sqlGaugeArm = `UPDATE outbox_gauge_settled SET next_xmax = pg_snapshot_xmax(pg_current_snapshot())
WHERE next_below IS NOT NULL AND next_xmax IS NULL`
	sqlGaugeNext = `SELECT coalesce(max(id), 0) + 1 FROM outbox_item_states`
	sqlGaugePick = `UPDATE outbox_gauge_settled SET next_below = $1 WHERE next_below IS NULL AND $1 > below`
)

// advanceGauge runs one step of the gauge's watermark.
func advanceGauge(ctx context.Context, q pgdb.Querier) error {
	if err := gaugeStep(ctx, q); err != nil {
		return fmt.Errorf("outbox: advancing the gauge's watermark: %w", err)
	}
	return nil
}

func gaugeStep(ctx context.Context, q pgdb.Querier) error {
	var (
		below     int64
		nextBelow *int64
		nextXmax  *string
		promote   bool
	)
	err := q.QueryRow(ctx, sqlGaugeStep).Scan(&below, &nextBelow, &nextXmax, &promote)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return err
	}
	switch {
	case promote:
		var n int64
		if err := q.QueryRow(ctx, sqlGaugeRange, below, *nextBelow).Scan(&n); err != nil {
			return err
		}
		_, err = q.Exec(ctx, sqlGaugePromote, below, *nextBelow, n)
	case nextBelow != nil && nextXmax == nil:
		_, err = q.Exec(ctx, sqlGaugeArm)
	case nextBelow == nil:
		var next int64
		if err := q.QueryRow(ctx, sqlGaugeNext).Scan(&next); err != nil {
			return err
		}
		_, err = q.Exec(ctx, sqlGaugePick, next)
	}
	return err
}

// gaugeStates are sqlGauge's counted states, in its columns' order.
var gaugeStates = []State{StatePending, StateLeased, StateAccepted, StateUncertain, StateRejected, StateQuarantined,
	StateSuperseded, StateWithdrawn}

// ReadGauge reads the gauge and publishes it to the outbox's metrics.
func (s *Store) ReadGauge(ctx context.Context, q pgdb.Querier) (Gauge, error) {
	below, items := int64(1), int64(0)
	if err := q.QueryRow(ctx, sqlGaugeSettled).Scan(&below, &items); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return Gauge{}, fmt.Errorf("outbox: gauge: %w", err)
	}
	counts := make([]int64, len(gaugeStates))
	var total int64
	g := Gauge{Counts: make(map[State]int64, len(States))}
	dest := make([]any, 0, len(counts)+2)
	for i := range counts {
		dest = append(dest, &counts[i])
	}
	// An unnamed statement, planned for this watermark each time: a cached
	// generic plan guesses a third of the table beyond it, and starts
	// parallel workers to count the few items there.
	err := q.QueryRow(ctx, sqlGauge, pgx.QueryExecModeExec, pgx.NamedArgs{"below": below, "items": items}).
		Scan(append(dest, &total, &g.OldestPendingAgeSeconds)...)
	if err != nil {
		return Gauge{}, fmt.Errorf("outbox: gauge: %w", err)
	}
	for _, st := range States {
		g.Counts[st] = 0
	}
	confirmed := total
	for i, st := range gaugeStates {
		g.Counts[st] = counts[i]
		confirmed -= counts[i]
	}
	g.Counts[StateConfirmed] = confirmed
	for st, n := range g.Counts {
		s.metrics.items.WithLabelValues(string(st)).Set(float64(n))
	}
	s.metrics.oldest.Set(g.OldestPendingAgeSeconds)
	return g, nil
}
