package quarantine

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Item is one quarantined item as an operator requeues it.
type Item struct {
	ID      int64
	Reason  string
	Tenant  string
	Feature string
	// Period is the start of the item's billing period (RFC 3339), empty
	// when the payload has none.
	Period string
	// Value is the payload's value as the payload holds it.
	Value string
	// ItemVersion is the mapping version the item carries; CurrentVersion
	// the greater of its feature's and its tenant's current versions (0
	// when neither is mapped): the version a requeue names.
	ItemVersion    int
	CurrentVersion int
}

// sqlItems reads the quarantined items a filter matches, with the current
// mapping version of each, by id.
const sqlItems = `
SELECT o.id, o.quarantine_reason, o.tenant_key, coalesce(o.payload ->> 'feature', ''), coalesce(o.payload ->> 'period', ''),
       o.payload ->> 'value', o.mapping_version,
       greatest(coalesce(fm.version, 0), coalesce(tm.version, 0))
FROM outbox_items o
LEFT JOIN feature_mappings fm ON fm.feature = o.payload ->> 'feature'
LEFT JOIN tenant_mappings tm ON tm.tenant = o.tenant_key
WHERE o.state = 'quarantined'
  AND (@reason = '' OR o.quarantine_reason = @reason) AND (@tenant = '' OR o.tenant_key = @tenant)
  AND (@feature = '' OR o.payload ->> 'feature' = @feature)
  AND (@period = '' OR ((o.payload ->> 'period')::timestamptz >= @from AND (o.payload ->> 'period')::timestamptz < @to))
ORDER BY o.id LIMIT @limit`

// Items reads at most limit quarantined items the filter matches, by id,
// each with the mapping version a requeue would name. A malformed period is
// an error, as it is for Quarantined.
func Items(ctx context.Context, q Querier, f Filter, limit int) ([]Item, error) {
	var from, to time.Time
	if f.Period != "" {
		var err error
		if from, to, err = ParsePeriod(f.Period); err != nil {
			return nil, err
		}
	}
	rows, err := q.Query(ctx, sqlItems, pgx.NamedArgs{"reason": f.Reason, "tenant": f.Tenant, "feature": f.Feature,
		"period": f.Period, "from": from, "to": to, "limit": limit})
	if err != nil {
		return nil, fmt.Errorf("quarantine: reading the items: %w", err)
	}
	items, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Item, error) {
		var it Item
		err := row.Scan(&it.ID, &it.Reason, &it.Tenant, &it.Feature, &it.Period, &it.Value, &it.ItemVersion, &it.CurrentVersion)
		return it, err
	})
	if err != nil {
		return nil, fmt.Errorf("quarantine: reading the items: %w", err)
	}
	return items, nil
}
