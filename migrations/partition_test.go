package migrations_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/migrations"
	"github.com/tallymeter/tally/outbox"
)

type ledgerRow struct {
	ID                       int64
	Tenant, EventID, Feature string
	Value                    int64
	OccurredAt, ReceivedAt   time.Time
	TimestampGiven           bool
	ItemID                   *int64
	StagedAt, CancelledAt    *time.Time
}

const sqlLedgerRows = `SELECT id, tenant, event_id, feature, value, occurred_at, received_at, timestamp_given, item_id, staged_at, cancelled_at
	FROM usage_events ORDER BY id`

// Migration 36 on a populated ledger of the previous schema: every row
// keeps its id and content in the partition of its month, every event has
// its key, the cancellation refers to it, the triggers hold on the ledger
// and its partitions, the identity continues, and ingest works after.
func TestMigration36PartitionsAPopulatedLedgerInPlace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.New(t)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = db.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS("."), goose.WithDisableGlobalRegistry(true),
		goose.WithGoMigrations(migrations.SessionSettings()))
	require.NoError(t, err)
	_, err = p.DownTo(ctx, 35)
	require.NoError(t, err)

	// An item as the outbox wrote one under migration 35's schema.
	id := outbox.Identity{TenantKey: "acme", SubjectKind: outbox.SubjectUsageEvent, SubjectRef: "event:api:e0",
		Exporter: "stripe_meter_events", DestinationAccount: "acct_1", Mode: outbox.ModeTest, MappingVersion: 1}
	payload := outbox.Payload{Customer: "cus_1", EventName: "api", Value: 1, Timestamp: time.Now().Unix(), Feature: "api",
		Period: time.Now().UTC().Format(time.RFC3339), Identifier: id.Identifier()}
	var item int64
	require.NoError(t, pool.QueryRow(ctx, `WITH body AS (
		INSERT INTO outbox_item_bodies
			(tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, payload)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
		RETURNING id, exporter, mode, ordering_key, created_at)
		INSERT INTO outbox_item_states (id, exporter, mode, ordering_key, created_at, state)
		SELECT id, exporter, mode, ordering_key, created_at, 'pending' FROM body RETURNING id`,
		id.TenantKey, id.SubjectKind, id.SubjectRef, id.Exporter, id.DestinationAccount, string(id.Mode), id.MappingVersion,
		payload).Scan(&item))
	now := time.Now().UTC()
	// Four years back (before the months kept as partitions), last year,
	// two months back, now and next month; one staged, one cancelled.
	_, err = pool.Exec(ctx, `INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given)
		SELECT 'acme', 'e' || g, 'api', g, $1::timestamptz - make_interval(days => (g % 5) * 300 + (g % 3) * 20) + interval '2 days', g % 2 = 0
		FROM generate_series(0, 499) g`, now)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE usage_events SET item_id = $1, staged_at = clock_timestamp() WHERE event_id = 'e0'`, item)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE usage_events SET cancelled_at = clock_timestamp() WHERE event_id = 'e7'`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO usage_cancellations (tenant, event_id, event_row, outcome, requested_by)
		SELECT tenant, event_id, id, 'withdrawn', 't' FROM usage_events WHERE event_id = 'e7'`)
	require.NoError(t, err)
	rows, err := pool.Query(ctx, sqlLedgerRows)
	require.NoError(t, err)
	before, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ledgerRow])
	require.NoError(t, err)
	require.Len(t, before, 500)

	_, err = p.UpTo(ctx, 36)
	require.NoError(t, err)

	rows, err = pool.Query(ctx, sqlLedgerRows)
	require.NoError(t, err)
	after, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ledgerRow])
	require.NoError(t, err)
	require.Equal(t, before, after, "every row, with its id and content")
	var misplaced, keys, keyless, cancellations int
	require.NoError(t, pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM usage_events e WHERE e.tableoid::regclass::text NOT IN
				(usage_events_month_name(date_trunc('month', e.occurred_at, 'UTC')::date), 'usage_events_before')),
			(SELECT count(*) FROM usage_event_keys),
			(SELECT count(*) FROM usage_events e WHERE NOT EXISTS (SELECT FROM usage_event_keys k
				WHERE k.tenant = e.tenant AND k.event_key = md5(e.event_id)::uuid AND k.event_row = e.id AND k.occurred_at = e.occurred_at)),
			(SELECT count(*) FROM usage_cancellations c JOIN usage_event_keys k USING (tenant, event_key) WHERE k.event_row = c.event_row)`).
		Scan(&misplaced, &keys, &keyless, &cancellations))
	require.Zero(t, misplaced, "each row in its month's partition")
	require.Equal(t, 500, keys)
	require.Zero(t, keyless)
	require.Equal(t, 1, cancellations, "the cancellation refers to its event's key")
	var before0 int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM usage_events_before`).Scan(&before0))
	require.NotZero(t, before0, "events older than the months kept as partitions are in usage_events_before")

	// The guards, on the ledger and on a partition.
	part := meter.MonthPartition(time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC))
	for _, stmt := range []string{
		`UPDATE usage_events SET value = value + 1 WHERE event_id = 'e1'`,
		`UPDATE usage_events SET item_id = NULL, staged_at = NULL WHERE event_id = 'e0'`,
		`UPDATE usage_events SET cancelled_at = NULL WHERE event_id = 'e7'`,
		`DELETE FROM usage_events WHERE event_id = 'e1'`,
		`TRUNCATE usage_events`,
		`DELETE FROM ` + part,
		`TRUNCATE ` + part,
		`TRUNCATE usage_events_before`,
		`DELETE FROM usage_event_keys`,
		`UPDATE usage_event_keys SET occurred_at = occurred_at + interval '1 day'`,
		`TRUNCATE usage_event_keys`,
		`INSERT INTO usage_cancellations (tenant, event_id, event_row, outcome, requested_by) VALUES ('acme', 'nope', 1, 'withdrawn', 't')`,
	} {
		_, err := pool.Exec(ctx, stmt)
		require.Error(t, err, stmt)
	}

	// The identity goes on; ingest (today's, after the later migrations)
	// works and finds the old events.
	_, err = p.Up(ctx)
	require.NoError(t, err)
	var maxID int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT max(id) FROM usage_events`).Scan(&maxID))
	var in meter.Ingester
	var res meter.Result
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		res, err = in.Ingest(ctx, tx, []meter.Event{
			{ID: "e2", Tenant: "acme", Feature: "api", Value: 2, Timestamp: &before[2].OccurredAt},
			{ID: "new2", Tenant: "acme", Feature: "api", Value: 1},
		})
		return err
	}))
	require.Equal(t, meter.Result{Accepted: 1, Duplicates: 1, Unmapped: 1}, res)
	var newID int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT id FROM usage_events WHERE event_id = 'new2'`).Scan(&newID))
	require.Greater(t, newID, maxID)

	// And back, for development.
	_, err = p.DownTo(ctx, 35)
	require.NoError(t, err)
	_, err = p.UpTo(ctx, 36)
	require.NoError(t, err)
}

// The runtime role reads and writes the ledger and the outbox but cannot
// delete, truncate, detach or drop them: it owns nothing.
func TestRuntimeRoleCannotDeleteTruncateOrDetach(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.New(t)
	var suffix [4]byte
	_, _ = rand.Read(suffix[:])
	role := "tally_test_runtime_" + hex.EncodeToString(suffix[:])
	_, err := pool.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN PASSWORD 'pw' IN ROLE tally_runtime", role))
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })

	u, err := url.Parse(testdb.URLOf(t, pool))
	require.NoError(t, err)
	u.User = url.UserPassword(role, "pw")
	conn, err := pgx.Connect(ctx, u.String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "REASSIGN OWNED BY "+role+" TO current_user; DROP OWNED BY "+role)
	})

	var in meter.Ingester
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	res, err := in.Ingest(ctx, tx, []meter.Event{{ID: "e1", Tenant: "acme", Feature: "api", Value: 1}})
	require.NoError(t, err)
	require.Equal(t, 1, res.Accepted)
	require.NoError(t, tx.Commit(ctx))
	made, err := meter.EnsureMonths(ctx, conn, 4)
	require.NoError(t, err, "the runtime role keeps the months ahead through the owner's function")
	require.Equal(t, 1, made)

	for range 2 { // an insert, then an update
		_, err = conn.Exec(ctx, `INSERT INTO stripe_customer_names (account, customer, name) VALUES ('', 'cus_1', 'Acme')
			ON CONFLICT (account, customer) DO UPDATE SET name = EXCLUDED.name, read_at = clock_timestamp()`)
		require.NoError(t, err, "the runtime role keeps the customers' names")
	}

	part := meter.MonthPartition(time.Now().UTC())
	for _, stmt := range []string{
		`DELETE FROM usage_events`,
		`TRUNCATE usage_events`,
		`DELETE FROM ` + part,
		`TRUNCATE ` + part,
		`ALTER TABLE usage_events DETACH PARTITION ` + part,
		`ALTER TABLE usage_events DETACH PARTITION ` + part + ` CONCURRENTLY`,
		`DROP TABLE ` + part,
		`DELETE FROM usage_event_keys`,
		`DELETE FROM outbox_item_states`,
		`DELETE FROM outbox_item_bodies`,
		`DELETE FROM outbox_attempts`,
		`DELETE FROM audit_log`,
		`DELETE FROM stripe_customer_names`,
		`TRUNCATE outbox_item_bodies`,
		`INSERT INTO usage_closed_months (month, events, closed_by) VALUES ('2000-01-01', 0, 'x')`,
		`DELETE FROM goose_db_version`,
	} {
		_, err := conn.Exec(ctx, stmt)
		require.Error(t, err, stmt)
		require.Regexp(t, "permission denied|must be owner", err.Error(), stmt)
	}
}
