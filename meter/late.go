package meter

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/outbox"
)

// absorbLate marks the late rows ids of a last window with the window item
// of the window's latest row staged in one (its own ref base or a
// supplement of it), when every one of them is older than that row (by
// occurred_at, then id); absorbed says it did. Rows staged in any other item
// — a per-event item quarantined before the feature was mapped as last,
// say — are not the window's: joining one would make its value, when it is
// rebuilt, the older row's.
//
// routed (a distributed database) names the tenant's bucket on every table.
func absorbLate(ctx context.Context, tx pgx.Tx, routed bool, tenant, feature string, w Window, base string, ids []int64) (absorbed bool, err error) {
	var item *int64
	bucket := tenantbucket.Of(tenant)
	sql, args := sqlAbsorbLate, []any{tenant, feature, w.From, w.To, ids, outbox.SubjectUsageWindow, base}
	if routed {
		sql, args = sqlAbsorbLateOnShard, append(args, bucket)
	}
	err = tx.QueryRow(ctx, sql, args...).Scan(&item)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && item == nil) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("comparing late rows: %w", err)
	}
	return true, markEventRows(ctx, tx, bucket, ids, sameItem(*item, len(ids)))
}

// sqlAbsorbLate reads the item of the window's latest staged row when every
// late row ($5) is older. On one server it names no bucket: the planner,
// told of one, may read the outbox by the bucket rather than the ledger's
// few rows.
const sqlAbsorbLate = `
WITH latest AS (
    SELECT u.item_id, u.occurred_at, u.id FROM usage_events u JOIN outbox_items o ON o.id = u.item_id
    WHERE u.tenant = $1 AND u.feature = $2 AND u.item_id IS NOT NULL AND u.occurred_at >= $3 AND u.occurred_at < $4
      AND o.subject_kind = $6 AND (o.subject_ref = $7 OR starts_with(o.subject_ref, $7 || '#'))
    ORDER BY u.occurred_at DESC, u.id DESC LIMIT 1
)
SELECT l.item_id FROM latest l
WHERE NOT EXISTS (SELECT 1 FROM usage_events u WHERE u.id = ANY($5::bigint[])
                  AND (u.occurred_at, u.id) > (l.occurred_at, l.id))`

// sqlAbsorbLateOnShard is sqlAbsorbLate on a distributed database: the
// tenant's bucket on every table and in the join, one shard's statement.
var sqlAbsorbLateOnShard = onShard(sqlAbsorbLate,
	"JOIN outbox_items o ON o.id = u.item_id", "JOIN outbox_items o ON o.id = u.item_id AND o.bucket = u.bucket",
	"WHERE u.tenant = $1", "WHERE u.bucket = $8 AND o.bucket = $8 AND u.tenant = $1",
	"WHERE u.id = ANY($5::bigint[])", "WHERE u.bucket = $8 AND u.id = ANY($5::bigint[])")
