package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// sqlSweep is the sweep, run by the maintenance pass, to items no deliverer may
// send again: pending, or leased with an expired lease, and past the attempt
// cap (a crash loop that never reached an answer) or past the horizon while
// some attempt may have reached the provider. The claim already refuses
// them; this makes them visible as uncertain. A swept expired lease records
// its attempt as abandoned, by a second statement (sqlAttempts) from the
// rows this one returns. "due" locks the rows in id order and reads their
// state as locked; rows another transaction holds are skipped until the next
// pass. Only an attempted item can be past either (the cap is at least
// one), so pending items are read from the index of attempted ones: the
// backlog never sent costs a pass nothing. The update finds the rows "due"
// locked by primary key and compares their state under collation "C",
// which no partial index's predicate uses, as the claim's lease does: else
// the planner may read every pending item through the partial indexes.
// The horizon reads first_attempt_at <= now - horizon, the clock apart
// from the column, as Citus needs in an UPDATE. On Citus it runs once per
// shard group, each reference to the states with the group's buckets
// (sweepBuckets marks where); on one server once, without them.
const sqlSweep = `
WITH due AS MATERIALIZED (
    SELECT o.id, o.state AS prev_state FROM outbox_item_states o
    WHERE ` + sweepBuckets + sweepDue + `
    ORDER BY o.id
    FOR UPDATE SKIP LOCKED
)
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
WHERE ` + sweepBuckets + `o.id = d.id
  AND (o.state = 'pending' COLLATE "C" OR (o.state = 'leased' COLLATE "C" AND o.lease_expires_at < statement_timestamp()))
  AND (o.attempts - o.attempts_base >= @max
       OR (o.refused_attempts < o.attempts AND o.first_attempt_at <= statement_timestamp() - @horizon::interval))
RETURNING o.id, d.prev_state, o.lease_token, o.lease_owner, o.leased_at, o.last_error_code, o.last_error, o.bucket`

// sweepDue is what makes an item the sweep's: no deliverer may send it
// again.
const sweepDue = `((o.state = 'pending' AND o.attempts > 0) OR (o.state = 'leased' AND o.lease_expires_at < statement_timestamp()))
      AND (o.attempts - o.attempts_base >= @max
           OR (o.refused_attempts < o.attempts AND o.first_attempt_at <= statement_timestamp() - @horizon::interval))`

// sqlSweepProbe is, on Citus, which buckets hold an item to sweep: one
// read of every shard, without locks, so that a pass sweeps only the
// groups that have one and an outbox with nothing to sweep costs a pass
// one statement, not one transaction per group.
const sqlSweepProbe = `SELECT DISTINCT o.bucket FROM outbox_item_states o WHERE ` + sweepDue

// sweepBuckets is the sweep's bucket predicate: kept on Citus, dropped on
// one server (sweepSQL).
const sweepBuckets = `o.bucket = ANY(@buckets::smallint[]) AND `

// sweepSQL is the sweep's statement on shards: sqlSweep on Citus, without
// its bucket predicate on one server.
func sweepSQL(shards *tenantbucket.Shards) string {
	if shards.Distributed() {
		return sqlSweep
	}
	return strings.ReplaceAll(sqlSweep, sweepBuckets, "")
}

// Sweep runs the sweep transition over every item past its cap or horizon
// that no deliverer holds, and returns the ids it made uncertain: one
// statement per shard group that holds such an item (one read of every
// shard finds them first), each with the attempts of the expired leases
// it swept in the same transaction (q's, or one of its own when q can
// begin one). Safe to run on every node at once: each row moves at most
// once.
func (s *Store) Sweep(ctx context.Context, q pgdb.Querier) ([]int64, error) {
	shards, err := s.Shards(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("outbox: sweep: %w", err)
	}
	sql := sweepSQL(shards)
	groups := []int{0}
	if shards.Distributed() {
		if groups, err = sweepGroups(ctx, q, shards, s.cfg); err != nil {
			// A worker is down, or q's transaction failed: every group
			// is swept by its own statement, and the groups of the
			// workers that answer are swept.
			groups = make([]int, shards.Groups())
			for g := range groups {
				groups[g] = g
			}
		}
	}
	var swept []int64
	for _, g := range groups {
		args := pgx.NamedArgs{"max": s.cfg.MaxAttempts, "horizon": s.cfg.Horizon, "buckets": shards.Buckets(g)}
		ids, err := inTx(ctx, q, func(q pgdb.Querier) ([]int64, error) { return sweepGroup(ctx, q, sql, args) })
		if err != nil {
			return swept, fmt.Errorf("outbox: sweep: %w", err)
		}
		for range ids {
			s.metrics.moved(TransitionSweep, StateUncertain)
		}
		swept = append(swept, ids...)
	}
	return swept, nil
}

// sweepGroups is the shard groups that hold an item to sweep
// (sqlSweepProbe), in order.
func sweepGroups(ctx context.Context, q pgdb.Querier, shards *tenantbucket.Shards, cfg Config) ([]int, error) {
	args := pgx.NamedArgs{"max": cfg.MaxAttempts, "horizon": cfg.Horizon}
	var buckets []int16
	var err error
	if b, ok := q.(pgdb.Beginner); ok {
		buckets, err = tenantbucket.ReadAcross(ctx, b, sqlSweepProbe, args)
	} else {
		var rows pgx.Rows
		if rows, err = q.Query(ctx, sqlSweepProbe, args); err == nil {
			buckets, err = pgx.CollectRows(rows, pgx.RowTo[int16])
		}
	}
	if err != nil {
		return nil, err
	}
	var groups []int
	for _, b := range buckets {
		groups = append(groups, shards.GroupOf(b))
	}
	slices.Sort(groups)
	return slices.Compact(groups), nil
}

// sweepGroup runs the sweep's statement with args on q, then the abandoned
// attempts of the expired leases it swept.
func sweepGroup(ctx context.Context, q pgdb.Querier, sql string, args pgx.NamedArgs) ([]int64, error) {
	rows, err := q.Query(ctx, sql, args)
	if err != nil {
		return nil, err
	}
	var (
		ids                 []int64
		id, token           int64
		prev                State
		owner, code, reason *string
		leasedAt            *time.Time
		bucket              int16
	)
	att := newAttemptRows(0)
	_, err = pgx.ForEachRow(rows, []any{&id, &prev, &token, &owner, &leasedAt, &code, &reason, &bucket}, func() error {
		ids = append(ids, id)
		if prev == StateLeased {
			att.add(id, token, bucket, owner, leasedAt, "abandoned", StateUncertain, false, "", code, 0, deref(reason))
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return ids, att.write(ctx, q)
}

// inTx runs fn in a transaction of q's: a new one when q can begin one (a
// pool, a connection; a transaction's is a savepoint), else on q itself.
func inTx[T any](ctx context.Context, q pgdb.Querier, fn func(pgdb.Querier) (T, error)) (T, error) {
	b, ok := q.(pgdb.Beginner)
	if !ok {
		return fn(q)
	}
	var out T
	err := pgx.BeginFunc(ctx, b, func(tx pgx.Tx) error {
		var err error
		out, err = fn(tx)
		return err
	})
	return out, err
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
