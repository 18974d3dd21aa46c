package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/tallymeter/tally/outbox"
)

// LatestSucceeded returns the id of the latest run that succeeded (the
// greatest id), and false when no run has.
func LatestSucceeded(ctx context.Context, q outbox.Querier) (int64, bool, error) {
	var id *int64
	if err := q.QueryRow(ctx, `SELECT max(id) FROM reconcile_runs WHERE status = 'succeeded'`).Scan(&id); err != nil {
		return 0, false, fmt.Errorf("reconcile: reading the latest successful run: %w", err)
	}
	if id == nil {
		return 0, false, nil
	}
	return *id, true, nil
}

// SinceLastSuccess is how long ago, by the database's clock, the run that
// succeeded last finished, on any node, and false when no run has
// succeeded.
func SinceLastSuccess(ctx context.Context, q outbox.Querier) (time.Duration, bool, error) {
	var seconds *float64
	err := q.QueryRow(ctx, `SELECT extract(epoch FROM clock_timestamp() - max(finished_at))::float8 FROM reconcile_runs
		WHERE status = 'succeeded'`).Scan(&seconds)
	if err != nil {
		return 0, false, fmt.Errorf("reconcile: reading the last successful run: %w", err)
	}
	if seconds == nil {
		return 0, false, nil
	}
	return time.Duration(*seconds * float64(time.Second)), true, nil
}

// EventRecorded reports whether Stripe's event with the id is recorded
// already, read in full (RecordReport records each once): a delivery of it
// again is a duplicate. An event recorded as foreign or unreadable
// (Events) is not.
func EventRecorded(ctx context.Context, q outbox.Querier, id string) (bool, error) {
	var seen bool
	if err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM stripe_events WHERE id = $1 AND status = 'recorded')`, id).Scan(&seen); err != nil {
		return false, fmt.Errorf("reconcile: reading Stripe event %s: %w", id, err)
	}
	return seen, nil
}

// PeriodDiscrepancies is how many discrepancy hours of one reconcile run
// involve the items of one tenant, feature and billing period.
type PeriodDiscrepancies struct {
	Tenant  string
	Feature string
	// Period is the start of the billing period the items carry.
	Period time.Time
	// Hours counts the run's open discrepancies (event name, customer and
	// hour) that name any of these items as expected or uncertain.
	Hours int64
}

// sqlDiscrepanciesByPeriod counts, per tenant, feature and period, the open
// discrepancy hours of one reconcile run that involve their items.
const sqlDiscrepanciesByPeriod = `
SELECT o.tenant_key, o.payload ->> 'feature', (o.payload ->> 'period')::timestamptz,
       count(DISTINCT (d.event_name, d.customer, d.hour))
FROM reconcile_discrepancies d
JOIN outbox_items o ON o.id = ANY(d.expected_items || d.uncertain_items)
WHERE d.run_id = @run
  AND NOT EXISTS (SELECT 1 FROM reconcile_resolutions r WHERE ` + resolutionMatches + `)
  AND (o.payload ->> 'period')::timestamptz >= @from AND (o.payload ->> 'period')::timestamptz < @to
  AND (@tenant = '' OR o.tenant_key = @tenant)
GROUP BY 1, 2, 3`

// DiscrepanciesByPeriod counts the open (unresolved) discrepancy hours of
// the reconcile run which involve the items (expected or uncertain) of each tenant, feature
// and billing period starting in [from, to), for one tenant or all (""), in
// no particular order: with the latest succeeded run (LatestSucceeded), the
// completeness report's column of what finance still has to resolve. The
// caller names the run, so that the counts and the run it shows are the
// same one even when another run finishes in between. A period whose items
// no discrepancy names is absent.
func DiscrepanciesByPeriod(ctx context.Context, q outbox.Querier, run int64, from, to time.Time, tenant string) ([]PeriodDiscrepancies, error) {
	rows, err := q.Query(ctx, sqlDiscrepanciesByPeriod, pgx.NamedArgs{"run": run, "from": from, "to": to, "tenant": tenant})
	if err != nil {
		return nil, fmt.Errorf("reconcile: counting discrepancies by period: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (PeriodDiscrepancies, error) {
		var p PeriodDiscrepancies
		err := row.Scan(&p.Tenant, &p.Feature, &p.Period, &p.Hours)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: counting discrepancies by period: %w", err)
	}
	return out, nil
}
