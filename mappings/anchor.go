package mappings

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/tallymeter/tally/internal/tenantbucket"
)

// A tenant's period anchor says which billing period each of its events
// counts in. Its unstaged events (no item yet) are counted in the
// completeness counters by the period the anchor gives them, so a new or
// changed anchor moves them: out of the old anchor's periods, into the
// new one's. On one server the mapping's trigger (completeness_anchor)
// does it. On a distributed database the trigger is gone (a reference
// table's trigger fires on every node's copy, and may not write a
// distributed table from there), and PutTenant does the same work in its
// transaction: moveAnchor.

// anchorTrigger is the trigger that moves the counters on one server.
const anchorTrigger = "tenant_mappings_completeness"

// sqlAnchorTriggerGone reports whether tenant_mappings lacks the anchor
// trigger: the database was distributed, and the writer moves the counters.
const sqlAnchorTriggerGone = `SELECT NOT EXISTS (SELECT 1 FROM pg_trigger
	WHERE tgrelid = 'tenant_mappings'::regclass AND tgname = $1 AND NOT tgisinternal)`

// sqlAnchorMoves reads what a tenant's anchor move changes, one tenant's
// rows of one shard (every table carries the tenant's bucket): its
// unstaged events, each counted once out of its period under the old
// anchor (@was) and once into its period under the new one (@anchor),
// summed per period and feature as the counters hold them — ingested,
// unstaged, and cancelled when withdrawn before staging (a cancelled event
// with no cancellation row is withdrawn, as completeness_cancel says).
// Sums that come to zero are left out, as completeness_bump leaves them.
const sqlAnchorMoves = `
SELECT tally_period_start(e.occurred_at, m.anchor), e.feature,
       sum(m.sign)::bigint, sum(m.sign * e.value::numeric),
       coalesce(sum(m.sign) FILTER (WHERE NOT x.withdrawn), 0)::bigint,
       coalesce(sum(m.sign * e.value::numeric) FILTER (WHERE NOT x.withdrawn), 0),
       coalesce(sum(m.sign) FILTER (WHERE x.withdrawn), 0)::bigint,
       coalesce(sum(m.sign * e.value::numeric) FILTER (WHERE x.withdrawn), 0)
FROM usage_events e
LEFT JOIN usage_cancellations c ON c.event_row = e.id AND c.bucket = e.bucket AND c.bucket = @bucket
CROSS JOIN LATERAL (SELECT e.cancelled_at IS NOT NULL AND coalesce(c.outcome, 'withdrawn') = 'withdrawn' AS withdrawn) x
CROSS JOIN (VALUES (-1, @was::timestamptz), (1, @anchor::timestamptz)) AS m (sign, anchor)
WHERE e.bucket = @bucket AND e.tenant = @tenant AND e.item_id IS NULL
GROUP BY 1, 2
HAVING (sum(m.sign), sum(m.sign * e.value::numeric),
        coalesce(sum(m.sign) FILTER (WHERE x.withdrawn), 0), coalesce(sum(m.sign * e.value::numeric) FILTER (WHERE x.withdrawn), 0))
       IS DISTINCT FROM (0, 0, 0, 0)
ORDER BY 1, 2`

// sqlAnchorBump adds one period and feature's move to the tenant's
// counters, in the folded slot (0): one row of the tenant's shard.
const sqlAnchorBump = `
INSERT INTO completeness_counters AS c (period, tenant, feature, account, slot, bucket, ingested_events, ingested_value,
                                        unstaged_events, unstaged_value, cancelled_events, cancelled_value)
VALUES (@period, @tenant, @feature, '', 0, @bucket, @ie, @iv, @ue, @uv, @xe, @xv)
ON CONFLICT (period, tenant, feature, account, slot, bucket) DO UPDATE SET
    ingested_events = c.ingested_events + excluded.ingested_events, ingested_value = c.ingested_value + excluded.ingested_value,
    unstaged_events = c.unstaged_events + excluded.unstaged_events, unstaged_value = c.unstaged_value + excluded.unstaged_value,
    cancelled_events = c.cancelled_events + excluded.cancelled_events, cancelled_value = c.cancelled_value + excluded.cancelled_value`

// calendarAnchor is the anchor of calendar months, which a tenant with no
// anchor bills by.
var calendarAnchor = time.Unix(0, 0).UTC()

// moveAnchor moves tenant's unstaged usage in the completeness counters
// from the periods of anchor was to those of anchor now (nil: calendar
// months), in tx, when the anchor trigger is not there to do it.
func moveAnchor(ctx context.Context, tx pgx.Tx, tenant string, was, now *time.Time) error {
	from, to := calendarAnchor, calendarAnchor
	if was != nil {
		from = *was
	}
	if now != nil {
		to = *now
	}
	if from.Equal(to) {
		return nil
	}
	var gone bool
	if err := tx.QueryRow(ctx, sqlAnchorTriggerGone, anchorTrigger).Scan(&gone); err != nil {
		return fmt.Errorf("reading the anchor trigger: %w", err)
	}
	if !gone {
		return nil
	}
	bucket := tenantbucket.Of(tenant)
	rows, err := tx.Query(ctx, sqlAnchorMoves, pgx.NamedArgs{"tenant": tenant, "bucket": bucket, "was": from, "anchor": to})
	if err != nil {
		return fmt.Errorf("reading the unstaged usage the anchor moves: %w", err)
	}
	moves, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (pgx.NamedArgs, error) {
		var (
			period     time.Time
			feature    string
			ie, ue, xe int64
			iv, uv, xv pgtype.Numeric
		)
		err := row.Scan(&period, &feature, &ie, &iv, &ue, &uv, &xe, &xv)
		return pgx.NamedArgs{"period": period, "tenant": tenant, "feature": feature, "bucket": bucket,
			"ie": ie, "iv": iv, "ue": ue, "uv": uv, "xe": xe, "xv": xv}, err
	})
	if err != nil {
		return fmt.Errorf("reading the unstaged usage the anchor moves: %w", err)
	}
	// In the order of the counters' key, as every writer of the counters
	// takes their rows.
	for _, m := range moves {
		if _, err := tx.Exec(ctx, sqlAnchorBump, m); err != nil {
			return fmt.Errorf("moving the unstaged usage to the new anchor's periods: %w", err)
		}
	}
	return nil
}
