package reconcile_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// The latest successful run is the greatest id among the succeeded ones;
// its age is since the latest finish among them, by the database's clock.
func TestLatestSucceededAndSinceLastSuccess(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	_, ok, err := reconcile.LatestSucceeded(ctx, pool)
	require.NoError(t, err)
	require.False(t, ok, "no run yet")
	_, ok, err = reconcile.SinceLastSuccess(ctx, pool)
	require.NoError(t, err)
	require.False(t, ok, "no run yet")

	var ids []int64
	for i := 0; i < 3; i++ {
		id, err := reconcile.Queue(ctx, pool, reconcile.TriggerAPI, "test", reconcile.Options{})
		require.NoError(t, err)
		ids = append(ids, id)
	}
	// The first finished an hour ago, the second two hours ago; the third
	// failed a minute ago.
	_, err = pool.Exec(ctx, `UPDATE reconcile_runs SET status = CASE WHEN id = $3 THEN 'failed' ELSE 'succeeded' END,
		finished_at = clock_timestamp() - CASE id WHEN $1 THEN interval '1 hour' WHEN $2 THEN interval '2 hours' ELSE interval '1 minute' END`,
		ids[0], ids[1], ids[2])
	require.NoError(t, err)

	id, ok, err := reconcile.LatestSucceeded(ctx, pool)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, ids[1], id)
	age, ok, err := reconcile.SinceLastSuccess(ctx, pool)
	require.NoError(t, err)
	require.True(t, ok)
	require.InDelta(t, time.Hour.Seconds(), age.Seconds(), 30)
}

// A Stripe event is recorded once RecordReport has recorded it.
func TestEventRecorded(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	store, err := outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)
	seen, err := reconcile.EventRecorded(ctx, pool, "evt_1")
	require.NoError(t, err)
	require.False(t, seen)

	res, err := reconcile.RecordReport(ctx, pool, store, stripeapi.MeterErrorReport{ID: "evt_1",
		Type: stripeapi.EventNoMeterFound, Created: time.Now(), ErrorCount: 1})
	require.NoError(t, err)
	require.True(t, res.Recorded)
	seen, err = reconcile.EventRecorded(ctx, pool, "evt_1")
	require.NoError(t, err)
	require.True(t, seen)
	seen, err = reconcile.EventRecorded(ctx, pool, "evt_2")
	require.NoError(t, err)
	require.False(t, seen)
}

// The completeness report's discrepancies: per tenant, feature and billing
// period, the open discrepancy hours of any run that name any of their
// items, expected or uncertain — or, naming none (an hour Stripe has and
// Tally has nothing of), whose customer the tenant's mapping names and
// whose event name the feature's — with those where Stripe has more apart.
// A discrepancy a later run cleared is not counted.
func TestDiscrepanciesByPeriod(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	store, err := outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)
	maps := &mappings.Store{}
	_, _, err = maps.PutFeature(ctx, pool, "api_calls", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum,
		Window: mappings.Duration(time.Hour)}, "test")
	require.NoError(t, err)
	_, _, err = maps.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_acme"}, "test")
	require.NoError(t, err)
	item := func(tenant, ref, period string) int64 {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		res, err := store.Enqueue(ctx, tx, outbox.NewItem{
			Identity: outbox.Identity{TenantKey: tenant, SubjectKind: outbox.SubjectUsageEvent, SubjectRef: ref,
				Exporter: "stripe_meter_events", DestinationAccount: "acct_123", Mode: outbox.ModeTest, MappingVersion: 1},
			Payload: outbox.Payload{Customer: "cus_" + tenant, EventName: "api_calls", Value: 1, Timestamp: 1796000000,
				Feature: "api_calls", Period: period},
		})
		require.NoError(t, err)
		require.NoError(t, tx.Commit(ctx))
		return res.ID
	}
	nov, dec := "2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z"
	a1, a2, g1, late := item("acme", "a1", nov), item("acme", "a2", nov), item("globex", "g1", nov), item("acme", "a3", dec)

	var runs []int64
	for i := 0; i < 3; i++ {
		id, err := reconcile.Queue(ctx, pool, reconcile.TriggerAPI, "test", reconcile.Options{})
		require.NoError(t, err)
		runs = append(runs, id)
	}
	discrepancy := func(run int64, customer string, hour int, expected, uncertain []int64, provider *int) int64 {
		var id int64
		require.NoError(t, pool.QueryRow(ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name,
			meter, customer, hour, formula, expected, provider, expected_items, uncertain_items, explained_by, explanation)
			VALUES ($1, 'acct_123', 'test', 'api_calls', 'mtr_1', $2, $3, 'sum', 1, $4, $5, $6, '{}', 'unexplained') RETURNING id`,
			run, customer, time.Date(2026, 11, 30, hour, 0, 0, 0, time.UTC), provider, expected, uncertain).Scan(&id))
		return id
	}
	five := 5
	old := discrepancy(runs[0], "cus_acme", 1, []int64{a1, a2}, []int64{}, nil)
	_, err = pool.Exec(ctx, `UPDATE reconcile_discrepancies SET cleared_by_run = $1 WHERE id = $2`, runs[1], old)
	require.NoError(t, err)
	discrepancy(runs[1], "cus_acme", 1, []int64{a1, a2}, []int64{}, nil)
	second := discrepancy(runs[1], "cus_acme", 2, []int64{}, []int64{a1}, nil)
	discrepancy(runs[1], "cus_globex", 1, []int64{g1, late}, []int64{}, nil)
	discrepancy(runs[2], "cus_acme", 3, []int64{}, []int64{}, &five) // Stripe has it, Tally nothing

	from, to := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC), time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	byTenant := func(tenant string) []reconcile.PeriodDiscrepancies {
		got, err := reconcile.DiscrepanciesByPeriod(ctx, pool, from, to, tenant)
		require.NoError(t, err)
		slices.SortFunc(got, func(a, b reconcile.PeriodDiscrepancies) int { return strings.Compare(a.Tenant, b.Tenant) })
		for i := range got {
			got[i].Period = got[i].Period.UTC()
		}
		return got
	}
	require.Equal(t, []reconcile.PeriodDiscrepancies{
		{Tenant: "acme", Feature: "api_calls", Period: from, Hours: 3, StripeHasMore: 1},
		{Tenant: "globex", Feature: "api_calls", Period: from, Hours: 1},
	}, byTenant(""), "an hour counts once however many of a line's items it names, and once across runs; December's item is out of range")
	require.Equal(t, []reconcile.PeriodDiscrepancies{{Tenant: "globex", Feature: "api_calls", Period: from, Hours: 1}}, byTenant("globex"))

	// Cleared by a later run, the second hour is no longer counted.
	_, err = pool.Exec(ctx, `UPDATE reconcile_discrepancies SET cleared_by_run = $1 WHERE id = $2`, runs[2], second)
	require.NoError(t, err)
	require.Equal(t, int64(2), byTenant("acme")[0].Hours)
}
