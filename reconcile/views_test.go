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
// period, the hours of the latest succeeded run's discrepancies that name
// any of their items, expected or uncertain; none before a run succeeds.
func TestDiscrepanciesByPeriod(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	store, err := outbox.New(outbox.Config{}, nil)
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
	discrepancy := func(run int64, customer string, hour int, expected, uncertain []int64) {
		_, err := pool.Exec(ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name, meter,
			customer, hour, formula, expected, expected_items, uncertain_items, explained_by, explanation)
			VALUES ($1, 'acct_123', 'test', 'api_calls', 'mtr_1', $2, $3, 'sum', 1, $4, $5, '{}', 'unexplained')`,
			run, customer, time.Date(2026, 11, 30, hour, 0, 0, 0, time.UTC), expected, uncertain)
		require.NoError(t, err)
	}
	for _, run := range runs { // every run found the first hour
		discrepancy(run, "cus_acme", 1, []int64{a1, a2}, []int64{})
	}
	discrepancy(runs[1], "cus_acme", 2, []int64{}, []int64{a1})
	discrepancy(runs[1], "cus_globex", 1, []int64{g1, late}, []int64{})

	from, to := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC), time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	_, ok, err := reconcile.LatestSucceeded(ctx, pool)
	require.NoError(t, err)
	require.False(t, ok, "no run succeeded yet")

	// The first two succeeded, the third failed: the second is the one the
	// completeness report shows.
	_, err = pool.Exec(ctx, `UPDATE reconcile_runs SET status = CASE WHEN id = $1 THEN 'failed' ELSE 'succeeded' END,
		finished_at = clock_timestamp()`, runs[2])
	require.NoError(t, err)
	latest, ok, err := reconcile.LatestSucceeded(ctx, pool)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, runs[1], latest)
	got, err := reconcile.DiscrepanciesByPeriod(ctx, pool, latest, from, to, "")
	require.NoError(t, err)
	slices.SortFunc(got, func(a, b reconcile.PeriodDiscrepancies) int { return strings.Compare(a.Tenant, b.Tenant) })
	for i := range got {
		got[i].Period = got[i].Period.UTC()
	}
	require.Equal(t, []reconcile.PeriodDiscrepancies{
		{Tenant: "acme", Feature: "api_calls", Period: from, Hours: 2},
		{Tenant: "globex", Feature: "api_calls", Period: from, Hours: 1},
	}, got, "an hour counts once however many of a line's items it names; December's item is out of range")

	got, err = reconcile.DiscrepanciesByPeriod(ctx, pool, runs[0], from, to, "")
	require.NoError(t, err)
	require.Len(t, got, 1, "only the named run's discrepancies count")
	require.Equal(t, int64(1), got[0].Hours)

	got, err = reconcile.DiscrepanciesByPeriod(ctx, pool, latest, from, to, "globex")
	require.NoError(t, err)
	require.Len(t, got, 1)
	require.Equal(t, "globex", got[0].Tenant)
}
