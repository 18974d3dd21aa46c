package outbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// ReviewItem is an uncertain or rejected item as an operator reviews it:
// these are the items that wait for a decision (recover) or an
// explanation.
type ReviewItem struct {
	ID      int64
	State   State
	Tenant  string
	Feature string
	// Value is the payload's value as the payload holds it.
	Value           string
	Attempts        int
	RefusedAttempts int
	// LastError is "code (status): message" of the last error, each part
	// only when known; empty without one.
	LastError string
}

// sqlForReview reads the uncertain and rejected items, uncertain first.
const sqlForReview = `
	SELECT id, state, tenant_key, coalesce(payload ->> 'feature', ''), payload ->> 'value', attempts, refused_attempts,
	       coalesce(last_error_code || coalesce(' (' || last_error_status || ')', '') || coalesce(': ' || last_error, ''), '')
	FROM outbox_items WHERE state IN ('uncertain', 'rejected') ORDER BY state DESC, id LIMIT @limit`

// ForReview reads at most limit uncertain and rejected items: the uncertain
// ones first, each state by id.
func (s *Store) ForReview(ctx context.Context, q pgdb.Querier, limit int) ([]ReviewItem, error) {
	rows, err := q.Query(ctx, sqlForReview, pgx.NamedArgs{"limit": limit})
	if err != nil {
		return nil, fmt.Errorf("outbox: reading the items to review: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ReviewItem, error) {
		var it ReviewItem
		err := row.Scan(&it.ID, &it.State, &it.Tenant, &it.Feature, &it.Value, &it.Attempts, &it.RefusedAttempts, &it.LastError)
		return it, err
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: reading the items to review: %w", err)
	}
	return out, nil
}
