package quarantine_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// TestCountersFastPathOnlyForFreshItems: the ledger's update trigger
// counts staging's usual case — unstaged events marked with an item that
// has no aggregate yet — in one statement, and sends everything else the
// general way (completeness_events). Each step checks which way its
// writes went (counted through pg_stat_xact_user_functions, when the
// test's role may turn track_functions on) and compares the counters with
// the full computation and the items' aggregates with a recount: fresh
// windows, per-event items staged in their ingest, a late event that makes
// a supplement item, a late event a last window's item absorbs, one
// statement mixing a fresh item, an item with an aggregate and a
// cancellation, two transactions racing to give a committed item its
// first events, and then the transitions that read the aggregates.
func TestCountersFastPathOnlyForFreshItems(t *testing.T) {
	t.Parallel()
	b := setup(t)
	months := monthsAround()
	b.Feature(t, "calls", mappings.Sum, time.Hour)
	b.Feature(t, "seats", mappings.Last, time.Hour)
	b.Feature(t, "logins", mappings.Count, time.Hour) // per-event items
	anchor := time.Now().UTC().AddDate(0, -1, 0).Truncate(time.Hour).Add(30 * time.Minute)
	b.Tenant(t, "acme", nil)
	b.Tenant(t, "beta", &anchor)
	var counting bool
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT current_setting('is_superuser') = 'on'`).Scan(&counting))
	if !counting {
		t.Log("track_functions needs a superuser: the ways the writes took are not checked")
	}

	// step runs write in one transaction and checks that it went the
	// general way or not, then that the counters are right.
	step := func(name string, general bool, write func(pgx.Tx)) {
		t.Helper()
		tx := begin(t, b, counting)
		write(tx)
		if counting {
			require.Equal(t, general, generalCalls(t, b, tx) > 0, "%s: the general way taken", name)
		}
		require.NoError(t, tx.Commit(b.Ctx))
		requireCounted(t, b, name, months...)
		requireAggregatesRecounted(t, b, name)
	}
	pass := func(tx pgx.Tx) {
		_, err := b.Stager.Pass(b.Ctx, nested{tx})
		require.NoError(t, err)
	}
	at := ago(3 * time.Hour).Truncate(time.Hour).Add(10 * time.Minute)
	in := func(d time.Duration) *time.Time { v := at.Add(d); return &v }

	b.MustIngest(t, ev("c1", "acme", "calls", 4, in(0)), ev("c2", "acme", "calls", 5, in(time.Minute)),
		ev("c3", "beta", "calls", 6, in(0)), ev("s1", "acme", "seats", 7, in(20*time.Minute)),
		ev("s2", "acme", "seats", 3, in(30*time.Minute)), ev("u1", "acme", "unmapped", 2, in(0)))
	step("fresh windows", false, pass)

	step("per-event items staged in their ingest", false, func(tx pgx.Tx) {
		_, err := b.Ingester.Ingest(b.Ctx, tx, []meter.Event{ev("l1", "acme", "logins", 1, in(0)), ev("l2", "beta", "logins", 1, in(0)),
			ev("l3", "acme", "logins", 1, in(time.Minute))})
		require.NoError(t, err)
	})

	b.MustIngest(t, ev("c4", "acme", "calls", 8, in(2*time.Minute)))
	step("a late event: a supplement item of its window", false, pass)

	b.MustIngest(t, ev("s3", "acme", "seats", 9, in(5*time.Minute)))
	step("a late event older than its last window's latest: absorbed by the item", true, pass)

	// One statement: an unstaged event onto a fresh item, another onto an
	// item with an aggregate, and a staged event withdrawn.
	b.MustIngest(t, ev("m1", "acme", "calls", 11, in(-2*time.Hour)), ev("m2", "acme", "calls", 12, in(-2*time.Hour)))
	existing := b.itemOf(t, "acme", "c1")
	step("one statement: a fresh item, an item with an aggregate, a cancellation", true, func(tx pgx.Tx) {
		fresh := enqueueLike(t, b, tx, existing, "mixed", 11)
		_, err := tx.Exec(b.Ctx, `
			UPDATE usage_events SET item_id = CASE WHEN event_id = 'm1' THEN $1 WHEN event_id = 'm2' THEN $2 ELSE item_id END,
			       staged_at = CASE WHEN event_id IN ('m1', 'm2') THEN clock_timestamp() ELSE staged_at END,
			       cancelled_at = CASE WHEN event_id = 'c3' THEN clock_timestamp() ELSE cancelled_at END
			WHERE tenant IN ('acme', 'beta') AND event_id IN ('m1', 'm2', 'c3')`, fresh, existing.ID)
		require.NoError(t, err)
	})

	// Two transactions give a committed item without events its first
	// events at once: the second finds the first's aggregate when its
	// insert waits, and adds to it the general way.
	b.MustIngest(t, ev("r1", "acme", "calls", 13, in(-3*time.Hour)), ev("r2", "acme", "calls", 14, in(-3*time.Hour)))
	tx, err := b.Pool.Begin(b.Ctx)
	require.NoError(t, err)
	empty := enqueueLike(t, b, tx, existing, "race", 27)
	require.NoError(t, tx.Commit(b.Ctx))
	mark := func(tx countedTx, event string) error {
		_, err := tx.Exec(b.Ctx, `UPDATE usage_events SET item_id = $1, staged_at = clock_timestamp()
			WHERE tenant = 'acme' AND event_id = $2 AND item_id IS NULL`, empty, event)
		return err
	}
	first, second := begin(t, b, counting), begin(t, b, counting)
	require.NoError(t, mark(first, "r1"))
	done := make(chan error, 1)
	go func() { done <- mark(second, "r2") }()
	require.Eventually(t, func() bool { // the second's insert waits for the first's aggregate
		var waiting bool
		require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE 'UPDATE usage_events%')`).Scan(&waiting))
		return waiting
	}, 10*time.Second, 10*time.Millisecond)
	if counting {
		require.Zero(t, generalCalls(t, b, first), "the first transaction went the general way")
	}
	require.NoError(t, first.Commit(b.Ctx))
	require.NoError(t, <-done)
	if counting {
		require.Positive(t, generalCalls(t, b, second), "the second transaction did not go the general way")
	}
	require.NoError(t, second.Commit(b.Ctx))
	requireCounted(t, b, "two racing transactions", months...)
	requireAggregatesRecounted(t, b, "two racing transactions")

	// The transitions that read the aggregates the fast path wrote.
	checked := func(name string, write func()) {
		t.Helper()
		write()
		requireCounted(t, b, name, months...)
		requireAggregatesRecounted(t, b, name)
	}
	rng := rand.New(rand.NewPCG(36, 40))
	for i := range 3 {
		checked(fmt.Sprintf("claims and outcomes %d", i), func() { settle(t, b, rng) })
	}
	checked("confirmations", func() {
		_, _, err := b.Outbox.Confirm(b.Ctx, b.Pool, idsIn(t, b, outbox.StateAccepted))
		require.NoError(t, err)
	})
	checked("requeues", func() {
		for _, id := range append(idsIn(t, b, outbox.StateQuarantined), idsIn(t, b, outbox.StateUncertain)...) {
			it, err := b.Outbox.Get(b.Ctx, b.Pool, id)
			require.NoError(t, err)
			_, _ = b.requeuer.RequeueWith(b.Ctx, b.Pool, id, currentVersion(t, b, it), "test",
				quarantine.RequeueOptions{AcceptPeriodClosed: true})
		}
	})
	checked("cancellations", func() {
		cancel(t, b, []meter.Cancellation{{Tenant: "acme", ID: "l1"}, {Tenant: "acme", ID: "c2"}, {Tenant: "beta", ID: "l2"}})
	})
	for _, m := range months {
		_, err := quarantine.RepairCompleteness(b.Ctx, b.Pool, m, "test", 0)
		require.NoError(t, err)
	}
	requireCounted(t, b, "after a repair", months...)
}

// countedTx is a transaction that counts its function calls when it may.
type countedTx struct {
	pgx.Tx
	before int64 // the session's calls not yet reported when it began
}

func begin(t *testing.T, b *bundle, counting bool) countedTx {
	t.Helper()
	tx, err := b.Pool.Begin(b.Ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(b.Ctx) })
	c := countedTx{Tx: tx}
	if counting {
		_, err = tx.Exec(b.Ctx, `SET LOCAL track_functions = 'all'`)
		require.NoError(t, err)
		c.before = sessionGeneralCalls(t, b, tx)
	}
	return c
}

// generalCalls is how many times the transaction called the general way
// of the counters' triggers.
func generalCalls(t *testing.T, b *bundle, tx countedTx) int64 {
	t.Helper()
	return sessionGeneralCalls(t, b, tx) - tx.before
}

// sessionGeneralCalls is the session's calls of the general way not yet
// reported to the statistics: pg_stat_xact_user_functions holds them until
// they are, which may be after several transactions.
func sessionGeneralCalls(t *testing.T, b *bundle, tx pgx.Tx) int64 {
	t.Helper()
	var n int64
	require.NoError(t, tx.QueryRow(b.Ctx, `SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_xact_user_functions
		WHERE funcname = 'completeness_events'`).Scan(&n))
	return n
}

// nested runs a staging pass's transactions inside tx, as savepoints.
type nested struct{ pgx.Tx }

func (n nested) BeginTx(ctx context.Context, _ pgx.TxOptions) (pgx.Tx, error) { return n.Begin(ctx) }

// enqueueLike enqueues, in tx, an item like it under another subject
// reference, with value: an item without events yet.
func enqueueLike(t *testing.T, b *bundle, tx pgx.Tx, it outbox.Item, ref string, value int64) int64 {
	t.Helper()
	id := it.Identity
	id.SubjectRef = ref
	p := it.Payload
	p.Value, p.Identifier = value, ""
	enq, err := b.Outbox.Enqueue(b.Ctx, tx, outbox.NewItem{Identity: id, Payload: p})
	require.NoError(t, err)
	require.True(t, enq.Inserted)
	return enq.ID
}

// requireAggregatesRecounted checks that the items' aggregates the
// triggers keep (those carrying events) are what a recount from the
// ledger writes, in a transaction rolled back.
func requireAggregatesRecounted(t *testing.T, b *bundle, step string) {
	t.Helper()
	tx, err := b.Pool.Begin(b.Ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.Ctx) }()
	_, err = tx.Exec(b.Ctx, `CREATE TEMP TABLE kept ON COMMIT DROP AS SELECT * FROM completeness_items WHERE events <> 0`)
	require.NoError(t, err)
	_, err = tx.Exec(b.Ctx, `SELECT completeness_recount('-infinity', 'infinity')`)
	require.NoError(t, err)
	var diff []string
	rows, err := tx.Query(b.Ctx, `
		(SELECT 'kept', k::text FROM (TABLE kept EXCEPT SELECT * FROM completeness_items) k)
		UNION ALL
		(SELECT 'recounted', r::text FROM (SELECT * FROM completeness_items WHERE events <> 0 EXCEPT TABLE kept) r)`)
	require.NoError(t, err)
	for rows.Next() {
		var side, row string
		require.NoError(t, rows.Scan(&side, &row))
		diff = append(diff, side+" "+row)
	}
	require.NoError(t, rows.Err())
	require.Empty(t, diff, "%s: the items' aggregates differ from a recount", step)
}

// TestMigration43KeepsTheCountsOfAnExistingDatabase: a database counted by
// the triggers before migration 43 (the random mix's, written with 40
// taken down) keeps its counters and aggregates through the migration —
// their meaning is unchanged — and the new triggers go on from them, equal
// to the full computation.
func TestMigration43KeepsTheCountsOfAnExistingDatabase(t *testing.T) {
	// The counters' functions since migration 48 carry the bucket, and
	// its keys hold it: this migration's Down no longer applies on top of
	// them, nor today's writers under it.
	t.Skip("migration 48's keys: the counters' migration can no longer be taken down alone")
	t.Parallel()
	b := setup(t)
	db := stdlib.OpenDBFromPool(b.Pool)
	t.Cleanup(func() { _ = db.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS("../migrations"), goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	_, err = p.ApplyVersion(b.Ctx, 43, false)
	require.NoError(t, err)
	b.Pool.Reset() // the sessions' plans of the replaced functions
	runMix(t, b, 40, 25)
	_, err = p.ApplyVersion(b.Ctx, 43, true)
	require.NoError(t, err)
	b.Pool.Reset()
	requireCounted(t, b, "after migration 43", monthsAround()...)
	requireAggregatesRecounted(t, b, "after migration 43")
	months, rng := monthsAround(), rand.New(rand.NewPCG(40, 41))
	for i := range 3 {
		var batch []meter.Event
		for j := range 10 {
			f := []string{"calls", "seats", "logins"}[j%3]
			batch = append(batch, ev(fmt.Sprintf("after-%d-%d", i, j), []string{"acme", "beta"}[j%2], f, 1, ago(time.Duration(3+j)*time.Hour)))
		}
		b.MustIngest(t, batch...)
		b.Pass(t)
		requireCounted(t, b, fmt.Sprintf("staged on migration 43, %d", i), months...)
		settle(t, b, rng)
		_, _, err := b.Outbox.Confirm(b.Ctx, b.Pool, idsIn(t, b, outbox.StateAccepted))
		require.NoError(t, err)
		cancel(t, b, []meter.Cancellation{{Tenant: "acme", ID: fmt.Sprintf("after-%d-0", i)}, {Tenant: "beta", ID: fmt.Sprintf("e%d", i+1)}})
		requireCounted(t, b, fmt.Sprintf("transitions on migration 43, %d", i), months...)
		requireAggregatesRecounted(t, b, fmt.Sprintf("transitions on migration 43, %d", i))
	}
}
