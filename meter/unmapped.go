package meter

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// UnmappedKind says what an Unmapped names.
type UnmappedKind string

// The kinds of Unmapped.
const (
	UnmappedFeature UnmappedKind = "feature"
	UnmappedTenant  UnmappedKind = "tenant"
)

// Unmapped is a feature or a tenant with recent usage and no mapping: its
// usage is quarantined until it is mapped.
type Unmapped struct {
	Kind UnmappedKind
	Name string
	// Events counts its usage events received within the span asked for.
	Events int64
}

// sqlUnmapped counts, per feature and per tenant without a mapping, the
// usage events received within a span before the database's clock. The
// bound is from now(), which is stable, so that the ledger's index on
// received_at reads the span alone; clock_timestamp(),
// volatile, would read the whole ledger.
const sqlUnmapped = `
SELECT 'feature', feature, count(*) FROM usage_events e
WHERE received_at > now() - @within::interval AND NOT EXISTS (SELECT 1 FROM feature_mappings m WHERE m.feature = e.feature)
GROUP BY 2
UNION ALL
SELECT 'tenant', tenant, count(*) FROM usage_events e
WHERE received_at > now() - @within::interval AND NOT EXISTS (SELECT 1 FROM tenant_mappings m WHERE m.tenant = e.tenant)
GROUP BY 2
ORDER BY 1, 2`

// UnmappedUsage reads the features and the tenants that have no mapping and
// usage received within the last span (by the database's clock), with the
// number of their events: the features first, then the tenants, each by
// name.
func UnmappedUsage(ctx context.Context, q pgdb.Querier, within time.Duration) ([]Unmapped, error) {
	rows, err := q.Query(ctx, sqlUnmapped, pgx.NamedArgs{"within": within})
	if err != nil {
		return nil, fmt.Errorf("meter: reading unmapped usage: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Unmapped, error) {
		var u Unmapped
		err := row.Scan(&u.Kind, &u.Name, &u.Events)
		return u, err
	})
	if err != nil {
		return nil, fmt.Errorf("meter: reading unmapped usage: %w", err)
	}
	return out, nil
}
