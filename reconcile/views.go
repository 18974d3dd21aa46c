package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/tallymeter/tally/internal/pgdb"
)

// LatestSucceeded returns the id of the latest run that succeeded (the
// greatest id), and false when no run has.
func LatestSucceeded(ctx context.Context, q pgdb.Querier) (int64, bool, error) {
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
func SinceLastSuccess(ctx context.Context, q pgdb.Querier) (time.Duration, bool, error) {
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
func EventRecorded(ctx context.Context, q pgdb.Querier, id string) (bool, error) {
	var seen bool
	if err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM stripe_events WHERE id = $1 AND status = 'recorded')`, id).Scan(&seen); err != nil {
		return false, fmt.Errorf("reconcile: reading Stripe event %s: %w", id, err)
	}
	return seen, nil
}

// PeriodDiscrepancies is how many open discrepancy hours involve the
// usage of one tenant, feature and billing period.
type PeriodDiscrepancies struct {
	Tenant  string
	Feature string
	// Period is the start of the billing period the items carry.
	Period time.Time
	// Hours counts the open discrepancies (event name, customer and hour),
	// of any run, that name any of these items as expected or uncertain —
	// or, naming no item (an hour Stripe has and Tally has nothing of),
	// whose customer the tenant's mapping names and whose event name the
	// feature's, in a period of the tenant.
	Hours int64
	// StripeHasMore counts those of KindStripeHasMore: a customer may be
	// billed too much.
	StripeHasMore int64
}

// sqlDiscrepanciesByPeriod counts, per tenant, feature and period, the open
// discrepancy hours that involve their usage. It reads the open
// discrepancies alone (the index of the current ones), each item they name
// by its key, and the mappings of those that name none.
const sqlDiscrepanciesByPeriod = `
WITH open AS (
    SELECT d.event_name, d.customer, d.hour, d.kind, d.destination_account, d.expected_items || d.uncertain_items AS items
    FROM reconcile_discrepancies d WHERE ` + isOpen + `
),
involved AS (
    SELECT o.tenant_key AS tenant, o.payload ->> 'feature' AS feature, (o.payload ->> 'period')::timestamptz AS period,
           d.event_name, d.customer, d.hour, d.kind
    FROM open d JOIN outbox_items o ON o.id = ANY(d.items)
    UNION ALL
    SELECT t.tenant, f.feature, tally_period_start(d.hour, coalesce(t.period_anchor, '1970-01-01T00:00:00Z')),
           d.event_name, d.customer, d.hour, d.kind
    FROM open d
    JOIN tenant_mappings t ON t.stripe_customer_id = d.customer
        AND (t.stripe_account IS NULL OR t.stripe_account = d.destination_account)
    JOIN feature_mappings f ON f.event_name = d.event_name
    WHERE cardinality(d.items) = 0
)
SELECT tenant, feature, period, count(DISTINCT (event_name, customer, hour)),
       count(DISTINCT (event_name, customer, hour)) FILTER (WHERE kind = 'stripe_has_more')
FROM involved
WHERE period >= @from AND period < @to AND (@tenant = '' OR tenant = @tenant) AND feature IS NOT NULL
GROUP BY 1, 2, 3`

// DiscrepanciesByPeriod counts the open discrepancy hours, of any run,
// which involve the usage of each tenant, feature and billing period
// starting in [from, to), for one tenant or all (""), in no particular
// order: the completeness report's column of what finance still has to
// resolve. A period no open discrepancy involves is absent.
func DiscrepanciesByPeriod(ctx context.Context, q pgdb.Querier, from, to time.Time, tenant string) ([]PeriodDiscrepancies, error) {
	rows, err := q.Query(ctx, sqlDiscrepanciesByPeriod, pgx.NamedArgs{"from": from, "to": to, "tenant": tenant})
	if err != nil {
		return nil, fmt.Errorf("reconcile: counting discrepancies by period: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (PeriodDiscrepancies, error) {
		var p PeriodDiscrepancies
		err := row.Scan(&p.Tenant, &p.Feature, &p.Period, &p.Hours, &p.StripeHasMore)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: counting discrepancies by period: %w", err)
	}
	return out, nil
}
