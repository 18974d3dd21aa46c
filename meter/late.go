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
func absorbLate(ctx context.Context, tx pgx.Tx, tenant, feature string, w Window, base string, ids []int64) (absorbed bool, err error) {
	var item *int64
	bucket := tenantbucket.Of(tenant)
	err = tx.QueryRow(ctx, sqlAbsorbLate, tenant, feature, w.From, w.To, ids, outbox.SubjectUsageWindow, base, bucket).Scan(&item)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && item == nil) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("comparing late rows: %w", err)
	}
	return true, markEventRows(ctx, tx, bucket, ids, sameItem(*item, len(ids)))
}

// sqlAbsorbLate reads the item of the window's latest staged row when every
// late row ($5) is older, with the tenant's bucket ($8) on every table, and
// no correlated subquery, so that it is one shard's statement.
const sqlAbsorbLate = `
WITH latest AS (
    SELECT u.item_id, u.occurred_at, u.id FROM usage_events u JOIN outbox_items o ON o.id = u.item_id AND o.bucket = u.bucket
    WHERE u.bucket = $8 AND o.bucket = $8 AND u.tenant = $1 AND u.feature = $2 AND u.item_id IS NOT NULL
      AND u.occurred_at >= $3 AND u.occurred_at < $4
      AND o.subject_kind = $6 AND (o.subject_ref = $7 OR starts_with(o.subject_ref, $7 || '#'))
    ORDER BY u.occurred_at DESC, u.id DESC LIMIT 1
),
newest AS (
    SELECT u.occurred_at, u.id FROM usage_events u WHERE u.bucket = $8 AND u.id = ANY($5::bigint[])
    ORDER BY u.occurred_at DESC, u.id DESC LIMIT 1
)
SELECT l.item_id FROM latest l LEFT JOIN newest n ON true
WHERE n.id IS NULL OR (n.occurred_at, n.id) < (l.occurred_at, l.id)`
