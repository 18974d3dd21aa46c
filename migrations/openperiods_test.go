package migrations_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/migrations"
	"github.com/tallymeter/tally/outbox"
)

// Migration 33 on a database in use: the keys of the confirmed items of a
// billing period that may still be open get their period noted (not those
// of a period long closed, nor accepted ones, which runs list anyway); of
// the discrepancies, those of the latest succeeded run stay current, as
// they were, every older one is cleared by it, and of a later run's only
// the latest of each hour stays; each gets its kind.
func TestMigration33KeepsTheCurrentDiscrepanciesAndNotesOpenPeriods(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.New(t)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = db.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS("."), goose.WithDisableGlobalRegistry(true),
		goose.WithGoMigrations(migrations.SessionSettings()))
	require.NoError(t, err)

	// The items are made by today's outbox on today's schema; the schema
	// then goes back to 32, keeping them, for 33 to run over them.
	store, err := outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)
	month := time.Now().UTC().Truncate(time.Hour)
	month = time.Date(month.Year(), month.Month(), 1, 0, 0, 0, 0, time.UTC)
	var items []outbox.NewItem
	for i, c := range []struct {
		cust   string
		period time.Time
	}{{"cus_open", month}, {"cus_old", month.AddDate(0, -3, 0)}, {"cus_accepted", month}} {
		items = append(items, outbox.NewItem{
			Identity: outbox.Identity{TenantKey: "acme", SubjectKind: outbox.SubjectUsageEvent, SubjectRef: fmt.Sprintf("event:api:%d", i),
				Exporter: "stripe_meter_events", DestinationAccount: "acct_1", Mode: outbox.ModeTest, MappingVersion: 1},
			Payload: outbox.Payload{Customer: c.cust, EventName: "api", Value: 1, Timestamp: c.period.Unix(), Feature: "api",
				Period: c.period.Format(time.RFC3339)},
		})
	}
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := store.EnqueueBatch(ctx, tx, items)
		return err
	}))
	leases, err := store.Claim(ctx, pool, outbox.ClaimOptions{Owner: "test", Limit: 10, Policy: outbox.BestEffort})
	require.NoError(t, err)
	require.Len(t, leases, 3)
	var confirm []int64
	for _, l := range leases {
		require.NoError(t, store.Accept(ctx, pool, l, "req"))
		if l.Payload.Customer != "cus_accepted" {
			confirm = append(confirm, l.ID)
		}
	}
	_, _, err = store.Confirm(ctx, pool, confirm)
	require.NoError(t, err)
	_, err = p.DownTo(ctx, 32)
	require.NoError(t, err)

	// Runs 1 and 2 succeeded, run 3 failed after them.
	_, err = pool.Exec(ctx, `INSERT INTO reconcile_runs (status, trigger, requested_by, settle)
		VALUES ('succeeded', 'command', 't', '0'), ('succeeded', 'command', 't', '0'), ('failed', 'command', 't', '0')`)
	require.NoError(t, err)
	discrepancy := func(run, hour, provider int) int64 {
		var id int64
		require.NoError(t, pool.QueryRow(ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name,
				meter, customer, hour, formula, expected, provider, expected_items, uncertain_items, explained_by, explanation)
			VALUES ($1, 'acct_1', 'test', 'api', 'mtr_1', 'cus_open', to_timestamp($2::bigint * 3600), 'sum', 5, $3, '{}', '{}', '{}',
				'unexplained') RETURNING id`, run, hour, provider).Scan(&id))
		return id
	}
	a1, a2 := discrepancy(1, 1, 9), discrepancy(2, 1, 9)
	b2, b3 := discrepancy(2, 2, 3), discrepancy(3, 2, 2)
	c1, c3 := discrepancy(1, 3, 5), discrepancy(3, 3, 7)

	_, err = p.UpTo(ctx, 33)
	require.NoError(t, err)

	cleared := func(id int64) (kind string, by *int64) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT kind, cleared_by_run FROM reconcile_discrepancies WHERE id = $1`, id).Scan(&kind, &by))
		return kind, by
	}
	for _, c := range []struct {
		id   int64
		kind string
		by   int64 // 0: current
	}{
		{a1, "stripe_has_more", 2}, {a2, "stripe_has_more", 0},
		{b2, "stripe_has_less", 3}, {b3, "stripe_has_less", 0},
		{c1, "stripe_has_more", 2}, // older than the latest succeeded run, whatever its hour
		{c3, "stripe_has_more", 0},
	} {
		kind, by := cleared(c.id)
		require.Equal(t, c.kind, kind, "discrepancy %d", c.id)
		if c.by == 0 {
			require.Nil(t, by, "discrepancy %d is current", c.id)
		} else {
			require.NotNil(t, by, "discrepancy %d", c.id)
			require.Equal(t, c.by, *by, "discrepancy %d", c.id)
		}
	}

	rows, err := pool.Query(ctx, `SELECT customer, period_start FROM reconcile_key_periods`)
	require.NoError(t, err)
	type noted struct {
		customer string
		start    time.Time
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (noted, error) {
		var n noted
		err := r.Scan(&n.customer, &n.start)
		return n, err
	})
	require.NoError(t, err)
	require.Len(t, got, 1, "%+v", got)
	require.Equal(t, "cus_open", got[0].customer)
	require.True(t, month.Equal(got[0].start))
}
