package reconcile

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/outbox"
)

// resolutionMatches is the condition under which resolution r covers
// discrepancy d: the same hour of the same key, the same reason, and the
// same numbers (Tally's value, and Stripe's or none).
const resolutionMatches = `r.destination_account = d.destination_account AND r.mode = d.mode
	AND r.event_name = d.event_name AND r.customer = d.customer AND r.hour = d.hour AND r.reason = d.reason
	AND r.expected = d.expected AND r.provider IS NOT DISTINCT FROM d.provider`

// sqlDiscrepancies reads discrepancies (the caller adds the WHERE clause on
// d), each with the tenants and features of its items and the resolution
// that covers it, if any.
const sqlDiscrepancies = `
SELECT d.id, d.run_id, d.destination_account, d.mode, d.event_name, d.meter, d.customer, d.reason,
       coalesce(d.error_code, ''), coalesce(d.error_status, 0), d.hour, d.formula,
       d.expected::text, d.provider::text, d.difference::text, d.expected_items, d.uncertain_items, d.explained_by,
       d.explanation, d.reported_items, coalesce(w.tenants, '{}'), coalesce(w.features, '{}'),
       r.id, r.discrepancy_id, r.resolution, r.note, r.resolved_by, r.resolved_at, r.settled_items
FROM reconcile_discrepancies d
LEFT JOIN LATERAL (
    SELECT array_agg(DISTINCT o.tenant_key ORDER BY o.tenant_key) AS tenants,
           array_agg(DISTINCT o.payload ->> 'feature' ORDER BY o.payload ->> 'feature')
               FILTER (WHERE o.payload ->> 'feature' IS NOT NULL) AS features
    FROM outbox_items o WHERE o.id = ANY(d.expected_items || d.uncertain_items)
) w ON true
LEFT JOIN reconcile_resolutions r ON ` + resolutionMatches + `
/*where*/
ORDER BY d.event_name, d.customer, d.hour, d.run_id`

// readDiscrepancies runs sqlDiscrepancies with the WHERE clause where.
func readDiscrepancies(ctx context.Context, q outbox.Querier, where string, args pgx.NamedArgs) ([]Discrepancy, error) {
	rows, err := q.Query(ctx, strings.Replace(sqlDiscrepancies, "/*where*/", where, 1), args)
	if err != nil {
		return nil, fmt.Errorf("reconcile: reading discrepancies: %w", err)
	}
	out, err := pgx.CollectRows(rows, scanDiscrepancy)
	if err != nil {
		return nil, fmt.Errorf("reconcile: reading discrepancies: %w", err)
	}
	if out == nil {
		out = []Discrepancy{}
	}
	return out, nil
}

func scanDiscrepancy(row pgx.CollectableRow) (Discrepancy, error) {
	var (
		d      Discrepancy
		resID  *int64
		of     *int64
		reason *string
		note   *string
		by     *string
		at     *time.Time
		items  []int64
	)
	err := row.Scan(&d.ID, &d.RunID, &d.Account, &d.Mode, &d.EventName, &d.Meter, &d.Customer, &d.Reason, &d.ErrorCode,
		&d.ErrorStatus, &d.Hour, &d.Formula, &d.Expected, &d.Provider, &d.Difference, &d.ExpectedItems, &d.UncertainItems,
		&d.ExplainedBy, &d.Explanation, &d.ReportedItems, &d.Tenants, &d.Features,
		&resID, &of, &reason, &note, &by, &at, &items)
	d.Hour = d.Hour.UTC()
	if resID != nil {
		d.Resolution = &Resolution{ID: *resID, Discrepancy: *of, Reason: ResolutionReason(*reason), Note: *note, By: *by,
			At: at.UTC(), SettledItems: nonNil(items)}
	}
	return d, err
}

// ErrDiscrepancyNotFound is a discrepancy id that does not exist.
var ErrDiscrepancyNotFound = errors.New("reconcile: no such discrepancy")

// GetDiscrepancy reads one discrepancy with its tenants, features and
// resolution.
func GetDiscrepancy(ctx context.Context, q outbox.Querier, id int64) (Discrepancy, error) {
	ds, err := readDiscrepancies(ctx, q, `WHERE d.id = @id`, pgx.NamedArgs{"id": id})
	if err != nil {
		return Discrepancy{}, err
	}
	if len(ds) == 0 {
		return Discrepancy{}, fmt.Errorf("%w: %d", ErrDiscrepancyNotFound, id)
	}
	return ds[0], nil
}

// DiscrepancyStatus selects discrepancies by whether they are resolved.
type DiscrepancyStatus string

// The statuses a list selects.
const (
	StatusOpen     DiscrepancyStatus = "open"
	StatusResolved DiscrepancyStatus = "resolved"
	StatusAll      DiscrepancyStatus = "all"
)

// DefaultStatus is what a list of discrepancies selects unless told:
// the open ones, finance's work.
const DefaultStatus = StatusOpen

// ParseStatus validates a status name; "" is DefaultStatus.
func ParseStatus(s string) (DiscrepancyStatus, error) {
	switch st := DiscrepancyStatus(s); st {
	case "":
		return DefaultStatus, nil
	case StatusOpen, StatusResolved, StatusAll:
		return st, nil
	}
	return "", fmt.Errorf("reconcile: status must be open, resolved or all, not %q", s)
}

// ListDiscrepancies reads the discrepancies of run (0: the latest run that
// succeeded, whose findings are the current ones; none before the first)
// with the given status, by meter, customer and hour. It returns the run
// it read.
func ListDiscrepancies(ctx context.Context, q outbox.Querier, run int64, status DiscrepancyStatus) (int64, []Discrepancy, error) {
	if run == 0 {
		latest, ok, err := LatestSucceeded(ctx, q)
		if err != nil || !ok {
			return 0, []Discrepancy{}, err
		}
		run = latest
	} else if _, err := Get(ctx, q, run); err != nil {
		return 0, nil, err
	}
	where := `WHERE d.run_id = @run`
	switch status {
	case StatusOpen:
		where += ` AND r.id IS NULL`
	case StatusResolved:
		where += ` AND r.id IS NOT NULL`
	}
	ds, err := readDiscrepancies(ctx, q, where, pgx.NamedArgs{"run": run})
	return run, ds, err
}
