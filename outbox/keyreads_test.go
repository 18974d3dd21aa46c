package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// customerItem is an eligible item of account acct_123 in test mode for customer
// cus and event name api_calls, with its own subject ref, value and
// payload timestamp.
func customerItem(ref, cus string, value, ts int64) outbox.NewItem {
	it := newItem(0)
	it.SubjectRef, it.Payload.Customer, it.Payload.Value, it.Payload.Timestamp = ref, cus, value, ts
	return it
}

// orderingKey is the ordering key of customerItem(_, cus, _, _).
func orderingKey(cus string) string { return "acct_123|" + cus + "|api_calls" }

// leaseAll claims every due item, by id.
func (b *testBundle) leaseAll(t *testing.T) map[int64]outbox.Lease {
	t.Helper()
	leases := map[int64]outbox.Lease{}
	for _, l := range b.claim(t, outbox.ClaimOptions{Policy: outbox.BestEffort}) {
		leases[l.ID] = l
	}
	return leases
}

// The keys reconciliation compares are those of the destination with items
// accepted longer ago than the settle delay or uncertain, from a timestamp
// on and after a key, in key order, with their items' first and last
// timestamps.
func TestSettledKeysListsKeysWithSettledItems(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	live := customerItem("d1", "cus_d", 1, 1000)
	live.Mode = outbox.ModeLive
	other := customerItem("e1", "cus_e", 1, 1000)
	other.DestinationAccount = "acct_other"
	ids := b.enqueue(t,
		customerItem("a1", "cus_a", 1, 1000), customerItem("a2", "cus_a", 1, 5000),
		customerItem("b1", "cus_b", 1, 2000),
		customerItem("c1", "cus_c", 1, 1000), customerItem("c2", "cus_c", 1, 1000),
		live, other)
	leases := b.leaseAll(t)
	require.Len(t, leases, len(ids))
	for _, i := range []int{0, 2, 4, 5, 6} {
		require.NoError(t, b.store.Accept(b.ctx, b.pool, leases[ids[i]], fmt.Sprint("req_", i)))
	}
	require.NoError(t, b.store.MarkUncertain(b.ctx, b.pool, leases[ids[1]], outbox.ErrorInfo{Code: "timeout"}, false))
	require.NoError(t, b.store.Reject(b.ctx, b.pool, leases[ids[3]], outbox.ErrorInfo{Code: "invalid_request", Status: 400}))
	_, _, err := b.store.Confirm(b.ctx, b.pool, []int64{ids[4]})
	require.NoError(t, err)
	b.enqueue(t, customerItem("a3", "cus_a", 1, 100)) // pending: not settled

	list := func(f outbox.KeyFilter) []outbox.SettledKey {
		t.Helper()
		f.Account, f.Mode = "acct_123", outbox.ModeTest
		keys, err := b.store.SettledKeys(b.ctx, b.pool, f)
		require.NoError(t, err)
		return keys
	}
	a := outbox.SettledKey{OrderingKey: orderingKey("cus_a"), Customer: "cus_a", EventName: "api_calls", Account: "acct_123", Earliest: 1000, Latest: 5000}
	bk := outbox.SettledKey{OrderingKey: orderingKey("cus_b"), Customer: "cus_b", EventName: "api_calls", Account: "acct_123", Earliest: 2000, Latest: 2000}
	require.Equal(t, []outbox.SettledKey{a, bk}, list(outbox.KeyFilter{}),
		"rejected, confirmed and pending items settle nothing; other modes and accounts are not listed")

	onlyUncertain := a
	onlyUncertain.Earliest = 5000
	require.Equal(t, []outbox.SettledKey{onlyUncertain}, list(outbox.KeyFilter{Settle: time.Hour}),
		"an item accepted within the settle delay is not settled; an uncertain one is")

	require.Equal(t, []outbox.SettledKey{onlyUncertain, bk}, list(outbox.KeyFilter{Since: 1500}))
	require.Equal(t, []outbox.SettledKey{bk}, list(outbox.KeyFilter{After: a.OrderingKey}))
	require.Empty(t, list(outbox.KeyFilter{After: bk.OrderingKey}))

	liveKeys, err := b.store.SettledKeys(b.ctx, b.pool, outbox.KeyFilter{Account: "acct_123", Mode: outbox.ModeLive})
	require.NoError(t, err)
	require.Equal(t, []outbox.SettledKey{{OrderingKey: orderingKey("cus_d"), Customer: "cus_d", EventName: "api_calls",
		Account: "acct_123", Earliest: 1000, Latest: 1000}}, liveKeys)

	// Several accounts (a platform's and its connected accounts) are listed
	// together, in byte order, each key with its account.
	both, err := b.store.SettledKeys(b.ctx, b.pool, outbox.KeyFilter{Accounts: []string{"acct_other", "acct_123"}, Mode: outbox.ModeTest})
	require.NoError(t, err)
	e := outbox.SettledKey{OrderingKey: "acct_other|cus_e|api_calls", Customer: "cus_e", EventName: "api_calls", Account: "acct_other",
		Earliest: 1000, Latest: 1000}
	require.Equal(t, []outbox.SettledKey{a, bk, e}, both)
}

// A key's items as reconciliation compares them: accepted, confirmed,
// uncertain, pending and leased, of the key's mode, with timestamps in the
// range, by timestamp and id, settled when accepted longer ago than the
// settle delay.
func TestKeyItemsReadsAKeysItemsInRange(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	live := customerItem("live", "cus_k", 1, 300)
	live.Mode = outbox.ModeLive
	ids := b.enqueue(t,
		customerItem("accepted", "cus_k", 10, 300),
		customerItem("confirmed", "cus_k", 20, 200),
		customerItem("uncertain", "cus_k", 30, 200),
		customerItem("leased", "cus_k", 40, 400),
		customerItem("rejected", "cus_k", 50, 250),
		customerItem("before", "cus_k", 60, 99),
		customerItem("at-end", "cus_k", 70, 500),
		customerItem("other-key", "cus_x", 80, 300),
		live)
	leases := b.leaseAll(t)
	for _, i := range []int{0, 1, 5, 6, 7, 8} {
		require.NoError(t, b.store.Accept(b.ctx, b.pool, leases[ids[i]], fmt.Sprint("req_", i)))
	}
	_, _, err := b.store.Confirm(b.ctx, b.pool, []int64{ids[1]})
	require.NoError(t, err)
	require.NoError(t, b.store.MarkUncertain(b.ctx, b.pool, leases[ids[2]], outbox.ErrorInfo{Code: "timeout"}, false))
	require.NoError(t, b.store.Reject(b.ctx, b.pool, leases[ids[4]], outbox.ErrorInfo{Code: "invalid_request", Status: 400}))
	pending := b.enqueue(t, customerItem("pending", "cus_k", 90, 100))[0]

	r := outbox.KeyRange{OrderingKey: orderingKey("cus_k"), Mode: outbox.ModeTest, From: 100, To: 500}
	got, err := b.store.KeyItems(b.ctx, b.pool, r)
	require.NoError(t, err)
	for i := range got {
		require.Equal(t, b.get(t, got[i].ID).Identifier, got[i].Identifier)
		require.Empty(t, got[i].Cancels, "no cancellation among them")
		got[i].Identifier = ""
	}
	nov := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	require.Equal(t, []outbox.KeyItem{
		{ID: pending, State: outbox.StatePending, Value: 90, Timestamp: 100, Tenant: "acme", Period: nov},
		{ID: ids[1], State: outbox.StateConfirmed, Value: 20, Timestamp: 200, Tenant: "acme", Period: nov},
		{ID: ids[2], State: outbox.StateUncertain, Value: 30, Timestamp: 200, Tenant: "acme", Period: nov},
		{ID: ids[0], State: outbox.StateAccepted, Value: 10, Timestamp: 300, Settled: true, Tenant: "acme", Period: nov},
		{ID: ids[3], State: outbox.StateLeased, Value: 40, Timestamp: 400, Tenant: "acme", Period: nov},
	}, got, "each with its tenant and billing period")

	r.Settle = time.Hour
	got, err = b.store.KeyItems(b.ctx, b.pool, r)
	require.NoError(t, err)
	require.Len(t, got, 5)
	require.False(t, got[3].Settled, "accepted within the settle delay")

	r.Mode = outbox.ModeLive
	got, err = b.store.KeyItems(b.ctx, b.pool, r)
	require.NoError(t, err)
	require.Equal(t, []outbox.KeyItem{{ID: ids[8], State: outbox.StateAccepted, Value: 1, Timestamp: 300,
		Identifier: b.get(t, ids[8]).Identifier, Tenant: "acme", Period: nov}}, got)
}

// KeyItems runs on its generic plan from the first call, and asks for it
// only for itself: on a connection, in a transaction and after a failed
// read, plan_cache_mode is what it was.
func TestKeyItemsLeavesThePlanCacheModeAsItWas(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, customerItem("one", "cus_p", 5, 300))
	r := outbox.KeyRange{OrderingKey: orderingKey("cus_p"), Mode: outbox.ModeTest, From: 100, To: 500}
	conn, err := pgx.Connect(b.ctx, testdb.URLOf(t, b.pool))
	require.NoError(t, err)
	defer conn.Close(b.ctx)
	mode := func(q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	}) string {
		var m string
		require.NoError(t, q.QueryRow(b.ctx, "SHOW plan_cache_mode").Scan(&m))
		return m
	}

	for range 7 {
		got, err := b.store.KeyItems(b.ctx, conn, r)
		require.NoError(t, err)
		require.Len(t, got, 1)
		require.Equal(t, "auto", mode(conn))
	}
	var generic, custom int64
	require.NoError(t, conn.QueryRow(b.ctx, `SELECT generic_plans, custom_plans FROM pg_prepared_statements
		WHERE statement LIKE '%FROM outbox_item_bodies b JOIN outbox_item_states s ON s.id = b.id%'
		  AND statement NOT LIKE '%pg_prepared_statements%'`).Scan(&generic, &custom))
	require.Equal(t, [2]int64{7, 0}, [2]int64{generic, custom}, "planned once, generic, and reused")

	_, err = conn.Exec(b.ctx, "SET plan_cache_mode = force_custom_plan")
	require.NoError(t, err)
	tx, err := conn.Begin(b.ctx)
	require.NoError(t, err)
	got, err := b.store.KeyItems(b.ctx, tx, r)
	require.NoError(t, err)
	require.Len(t, got, 1)
	require.Equal(t, "force_custom_plan", mode(tx), "the session's own setting comes back, inside a transaction too")
	require.NoError(t, tx.Commit(b.ctx))
	require.Equal(t, "force_custom_plan", mode(conn))

	// A read that fails (a statement timeout while it runs) leaves nothing set.
	_, err = conn.Exec(b.ctx, "RESET plan_cache_mode")
	require.NoError(t, err)
	_, err = conn.Exec(b.ctx, "SET statement_timeout = '50ms'")
	require.NoError(t, err)
	blocker, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	_, err = blocker.Exec(b.ctx, "LOCK TABLE outbox_item_states IN ACCESS EXCLUSIVE MODE")
	require.NoError(t, err)
	_, err = b.store.KeyItems(b.ctx, conn, r)
	require.Error(t, err)
	require.NoError(t, blocker.Rollback(b.ctx))
	_, err = conn.Exec(b.ctx, "RESET statement_timeout")
	require.NoError(t, err)
	require.Equal(t, "auto", mode(conn))
}

// The items an error report names are locked for the report's transaction
// and named by identifier; an identifier no item has is absent.
func TestLockIdentifiedLocksTheNamedItems(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, newItem(1), newItem(2), newItem(3))
	first, second := b.get(t, ids[0]).Identifier, b.get(t, ids[1]).Identifier

	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	got, err := b.store.LockIdentified(b.ctx, tx, []string{second, "tly_nobody", first})
	require.NoError(t, err)
	require.Equal(t, map[string]int64{first: ids[0], second: ids[1]}, got)

	lock := func(id int64) error {
		_, err := b.pool.Exec(b.ctx, `SELECT id FROM outbox_item_states WHERE id = $1 FOR NO KEY UPDATE NOWAIT`, id)
		return err
	}
	var pgErr *pgconn.PgError
	for _, id := range ids[:2] {
		err := lock(id)
		require.True(t, errors.As(err, &pgErr) && pgErr.Code == "55P03", "item %d is locked: %v", id, err)
	}
	require.NoError(t, lock(ids[2]), "an item not named is not locked")
	require.NoError(t, tx.Rollback(b.ctx))
	require.NoError(t, lock(ids[0]), "the lock ends with the transaction")

	none, err := b.store.LockIdentified(b.ctx, b.pool, nil)
	require.NoError(t, err)
	require.Empty(t, none)
}

// A window's items are its own ref and its supplements, one per ref: a
// re-addressed successor is not counted again, nor are other tenants',
// kinds' or windows' items.
func TestWindowItemCountOnePerRef(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	const base = "usage:api_calls:2026-11-01T00:00:00Z:2026-11-30T00:00:00Z:2026-11-30T00:59:59Z"
	item := func(tenant, kind, ref string) outbox.NewItem {
		it := newItem(0)
		it.TenantKey, it.SubjectKind, it.SubjectRef = tenant, kind, ref
		return it
	}
	w := outbox.SubjectUsageWindow
	b.enqueue(t,
		item("acme", w, base), item("acme", w, base+"#1"), item("acme", w, base+"#2"),
		item("acme", w, outbox.ReaddressRef(base)), item("acme", w, outbox.ReaddressRef(base+"#1")),
		item("acme", w, base+"0"),
		item("globex", w, base), item("acme", outbox.SubjectUsageEvent, base+"#3"))

	n, err := b.store.WindowItemCount(b.ctx, b.pool, "acme", base)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	n, err = b.store.WindowItemCount(b.ctx, b.pool, "globex", base)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	n, err = b.store.WindowItemCount(b.ctx, b.pool, "acme", base+"#9")
	require.NoError(t, err)
	require.Zero(t, n)
}

// The reconciler confirms a key's items in the key's transaction, once per
// key: the confirmation runs on its generic plan, planned once per
// connection, and leaves the session's plan_cache_mode as it was.
func TestConfirmRunsOnItsGenericPlan(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	conn, err := pgx.Connect(b.ctx, testdb.URLOf(t, b.pool))
	require.NoError(t, err)
	defer conn.Close(b.ctx)
	_, err = conn.Exec(b.ctx, "SET plan_cache_mode = force_custom_plan")
	require.NoError(t, err)

	for n := range 7 {
		l := b.accepted(t, n+1)
		tx, err := conn.Begin(b.ctx)
		require.NoError(t, err)
		confirmed, refused, err := b.store.Confirm(b.ctx, tx, []int64{l.ID})
		require.NoError(t, err)
		require.Empty(t, refused)
		require.Equal(t, []int64{l.ID}, confirmed)
		var mode string
		require.NoError(t, tx.QueryRow(b.ctx, "SHOW plan_cache_mode").Scan(&mode))
		require.Equal(t, "force_custom_plan", mode, "the session's own setting comes back inside the transaction")
		require.NoError(t, tx.Commit(b.ctx))
		require.Equal(t, outbox.StateConfirmed, b.get(t, l.ID).State)
	}
	var generic, custom int64
	require.NoError(t, conn.QueryRow(b.ctx, `SELECT generic_plans, custom_plans FROM pg_prepared_statements
		WHERE statement LIKE '%SET state = ''confirmed''%' AND statement NOT LIKE '%pg_prepared_statements%'`).Scan(&generic, &custom))
	require.Equal(t, [2]int64{7, 0}, [2]int64{generic, custom}, "planned once, generic, and reused, though the session asks for custom plans")
}

// SettledKeys lists keys in byte order, as Go compares strings, and resumes
// after a key by that order too: reconciliation merges these keys with keys
// of its own. The statement names collation "C" because a database's own
// may be a natural-language one, which orders "cus_a|…" and "cus_A_…"
// otherwise (the test databases' is C already).
func TestSettledKeysAreInByteOrder(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	custs := []string{"cus_b", "cus_A_1", "cus_a", "cus_a_z", "cus_Z"}
	var items []outbox.NewItem
	for i, c := range custs {
		items = append(items, customerItem(fmt.Sprint("k", i), c, 1, 1000))
	}
	b.enqueue(t, items...)
	for _, l := range b.leaseAll(t) {
		require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "req"))
	}
	keys, err := b.store.SettledKeys(b.ctx, b.pool, outbox.KeyFilter{Account: "acct_123", Mode: outbox.ModeTest})
	require.NoError(t, err)
	var got []string
	for _, k := range keys {
		got = append(got, k.OrderingKey)
	}
	require.True(t, slices.IsSorted(got), "%q", got)
	require.Len(t, got, len(custs))
	after, err := b.store.SettledKeys(b.ctx, b.pool, outbox.KeyFilter{Account: "acct_123", Mode: outbox.ModeTest, After: got[1]})
	require.NoError(t, err)
	require.Len(t, after, len(custs)-2)
	require.Equal(t, got[2], after[0].OrderingKey)
}
