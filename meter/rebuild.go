package meter

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// ErrStalled says export is stalled (no Stripe key): nothing can be
// addressed to a destination.
var ErrStalled = errcode.New(errcode.Conflict, "export_stalled", "meter: export is stalled: no destination (STRIPE_API_KEY unset)")

// ErrAggregationChanged refuses to rebuild a window's item for a feature
// that is now exported per event: one window cannot become many items.
var ErrAggregationChanged = errcode.New(errcode.Conflict, "aggregation_changed", "meter: the feature is now exported per event; a window's item cannot be rebuilt as one item")

// sqlRebuildRows reads the values of the rows not cancelled of the item at
// the root of item $1's chain of predecessors (the item the ledger rows
// name), in order: tally_root_item with the bucket $2, which a successor
// shares with its predecessor, so that it is one shard's statement.
const sqlRebuildRows = `WITH RECURSIVE chain (id, depth) AS (
    SELECT $1::bigint, 0
    UNION ALL
    SELECT o.id, c.depth + 1 FROM outbox_item_states o JOIN chain c ON o.superseded_by = c.id
    WHERE o.bucket = $2 AND c.depth < 1000
)
SELECT value, occurred_at FROM usage_events
WHERE bucket = $2 AND item_id = (SELECT id FROM chain ORDER BY depth DESC LIMIT 1) AND cancelled_at IS NULL
ORDER BY occurred_at, id`

// Rebuild builds the item that would carry its usage under the mappings
// pair (the current ones, as the caller read them in tx) and this node's
// target: the same tenant and subject, the value
// reduced again from the ledger rows it was staged from (less any
// cancelled since), the current
// customer, event name, mapping version, exporter (the feature mapping's,
// else the node's) and destination, and the
// quarantine reason it would be staged with, if any. Package quarantine uses
// it to requeue or re-address a quarantined item.
func (s *Stager) Rebuild(ctx context.Context, tx pgx.Tx, it outbox.Item, pair mappings.Pair) (outbox.NewItem, error) {
	target, ok := s.Target(ctx)
	if !ok {
		return outbox.NewItem{}, ErrStalled
	}
	if err := target.validate(); err != nil {
		return outbox.NewItem{}, err
	}
	feature := it.Payload.Feature
	// A cancelled event left its window (meter.Cancel): it is in no item
	// built again.
	rows, err := tx.Query(ctx, sqlRebuildRows, it.ID, tenantbucket.Of(it.TenantKey))
	if err != nil {
		return outbox.NewItem{}, fmt.Errorf("meter: reading the rows of item %d: %w", it.ID, err)
	}
	var (
		values []int64
		last   time.Time
		v      int64
		at     time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&v, &at}, func() error {
		values, last = append(values, v), at
		return nil
	}); err != nil {
		return outbox.NewItem{}, fmt.Errorf("meter: reading the rows of item %d: %w", it.ID, err)
	}
	if len(values) == 0 {
		return outbox.NewItem{}, fmt.Errorf("meter: item %d has no ledger rows", it.ID)
	}
	var value int64
	switch {
	case it.SubjectKind == outbox.SubjectUsageEvent:
		value = values[0]
	case pair.Feature != nil && pair.Feature.Aggregation.PerEvent():
		return outbox.NewItem{}, ErrAggregationChanged
	case pair.Feature != nil && pair.Feature.Aggregation == mappings.Last:
		value = values[len(values)-1]
	default:
		for _, x := range values {
			if (x > 0 && value > (1<<63-1)-x) || (x < 0 && value < -(1<<63)-x) {
				return outbox.NewItem{}, fmt.Errorf("meter: item %d: the sum does not fit a signed 64-bit integer", it.ID)
			}
			value += x
		}
	}
	period, err := time.Parse(time.RFC3339, it.Payload.Period)
	if err != nil {
		return outbox.NewItem{}, fmt.Errorf("meter: item %d has no period: %w", it.ID, err)
	}
	ni := s.item(pair, target, it.TenantKey, feature, it.SubjectKind, it.SubjectRef, value, last, period)
	verdicts, err := checkStamps(ctx, tx, target, []stampCheck{target.stampCheckOf(pair, last, period)})
	if err != nil {
		return outbox.NewItem{}, err
	}
	verdicts[0].apply(target, &ni)
	return ni, nil
}
