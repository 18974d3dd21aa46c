package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// keyed returns an item of subject n for customer cus_<key>.
func keyed(n, key int) outbox.NewItem {
	it := newItem(n)
	it.Payload.Customer = "cus_" + string(rune('a'+key))
	return it
}

func TestPerKeyOneLeasePerKey(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, keyed(1, 0), keyed(2, 0), keyed(3, 0), keyed(4, 1))

	first := b.claim(t, outbox.ClaimOptions{Owner: "w1", Limit: 10})
	require.Len(t, first, 2, "one item per key")
	require.NotEqual(t, first[0].OrderingKey, first[1].OrderingKey)
	require.Empty(t, b.claim(t, outbox.ClaimOptions{Owner: "w2", Limit: 10}), "both keys hold a live lease")

	// Best effort ignores keys: it takes the rest.
	rest := b.claim(t, outbox.ClaimOptions{Owner: "w3", Limit: 10, Policy: outbox.BestEffort})
	require.Len(t, rest, 2)

	var a outbox.Lease
	for _, l := range first {
		if l.Payload.Customer == "cus_a" {
			a = l
		}
	}
	require.NoError(t, b.store.Accept(b.ctx, b.pool, a, "r"))
	for _, l := range rest {
		require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "r"))
	}
	// Key a is free again, key b's lease (from w1) is still live: a new item
	// of each goes out only for key a.
	more := b.enqueue(t, keyed(5, 0), keyed(6, 1))
	got := b.claim(t, outbox.ClaimOptions{Owner: "w4", Limit: 10})
	require.Len(t, got, 1)
	require.Equal(t, more[0], got[0].ID)
}

func TestPerKeyReclaimsTheExpiredItemFirst(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, keyed(1, 0), keyed(2, 0))
	dead := b.claim(t, outbox.ClaimOptions{Owner: "dead", Limit: 10, Lease: 50 * time.Millisecond})
	require.Len(t, dead, 1)
	require.Equal(t, ids[0], dead[0].ID)
	time.Sleep(80 * time.Millisecond)
	next := b.claim(t, outbox.ClaimOptions{Owner: "alive", Limit: 10})
	require.Len(t, next, 1)
	require.Equal(t, ids[0], next[0].ID, "the abandoned item goes out before later items of its key")
	require.Equal(t, int64(2), next[0].LeaseToken)
}

func TestPerKeyStuckKeyDoesNotBlockOthers(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	// A hot key with many due items, older than everything else.
	var hot []outbox.NewItem
	for i := 0; i < 200; i++ {
		hot = append(hot, keyed(i, 0))
	}
	b.enqueue(t, hot...)
	b.enqueue(t, keyed(1000, 1), keyed(1001, 2), keyed(1002, 3))

	got := b.claim(t, outbox.ClaimOptions{Limit: 10})
	keys := map[string]bool{}
	for _, l := range got {
		require.False(t, keys[l.OrderingKey], "two items of one key in one claim")
		keys[l.OrderingKey] = true
	}
	require.Len(t, keys, 4, "every key gets one item, the hot one does not crowd out the rest")

	// The hot key's item fails and backs off; its next item waits behind the
	// live lease only, not behind the backoff: the per-key policy limits
	// concurrency, it does not stop the line.
	for _, l := range got {
		if l.Payload.Customer == "cus_a" {
			_, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "stripe_5xx", Status: 500}, false)
			require.NoError(t, err)
		} else {
			require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "r"))
		}
	}
	again := b.claim(t, outbox.ClaimOptions{Limit: 10})
	require.Len(t, again, 1)
	require.Equal(t, "cus_a", again[0].Payload.Customer)
	require.NotEqual(t, got[0].ID, again[0].ID)
}

// Two writers answer the same items with mixed outcome kinds, in opposite
// roles: one holds stale leases on all of them, the other the current ones.
// Each accepts one half and retries the other, so without a lock order over
// the whole batch each would hold the rows of its first statement while
// waiting for the other's. Record's batch lock makes them wait for each
// other instead of deadlocking.
func TestRecordMixedBatchesNeverDeadlock(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{BackoffBase: time.Hour, BackoffCap: time.Hour})
	const half = 500
	for round := 0; round < 3; round++ {
		var items []outbox.NewItem
		for i := 0; i < 2*half; i++ {
			items = append(items, keyed(round*1000+i, i%26))
		}
		b.enqueue(t, items...)
		old := b.claim(t, outbox.ClaimOptions{Owner: "old", Limit: 2 * half, Policy: outbox.BestEffort, Lease: 5 * time.Millisecond})
		require.Len(t, old, 2*half)
		time.Sleep(10 * time.Millisecond)
		cur := b.claim(t, outbox.ClaimOptions{Owner: "cur", Limit: 2 * half, Policy: outbox.BestEffort})
		require.Len(t, cur, 2*half)
		byID := map[int64]outbox.Lease{}
		for _, l := range cur {
			byID[l.ID] = l
		}
		var oldOut, curOut []outbox.Outcome
		for i, l := range old {
			first, second := outbox.Accepted, outbox.Retry
			if i >= half {
				first, second = second, first
			}
			oldOut = append(oldOut, outbox.Outcome{Lease: l, Kind: first})
			curOut = append(curOut, outbox.Outcome{Lease: byID[l.ID], Kind: second})
		}
		start := make(chan struct{})
		errs := make(chan error, 2)
		for _, out := range [][]outbox.Outcome{oldOut, curOut} {
			go func() {
				<-start
				_, err := b.store.Record(b.ctx, b.pool, out)
				errs <- err
			}()
		}
		close(start)
		require.NoError(t, <-errs)
		require.NoError(t, <-errs)
		for i, o := range curOut {
			want := outbox.StateAccepted
			if i < half {
				want = outbox.StatePending
			}
			require.Equal(t, want, b.get(t, o.Lease.ID).State, "the current holder's answers land, the stale ones do not")
		}
	}
}

// The claim decides, by the database clock, whether a payload's timestamp is
// outside what the provider accepts.
func TestClaimTimestampOutside(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	old := newItem(1)
	old.Payload.Timestamp = time.Now().Add(-40 * 24 * time.Hour).Unix()
	ahead := newItem(2)
	ahead.Payload.Timestamp = time.Now().Add(time.Hour).Unix()
	fine := newItem(3)
	fine.Payload.Timestamp = time.Now().Add(-time.Hour).Unix()
	ids := b.enqueue(t, old, ahead, fine)
	leases := b.claim(t, outbox.ClaimOptions{Limit: 10, AcceptPast: 35 * 24 * time.Hour, AcceptFuture: 5 * time.Minute})
	require.Len(t, leases, 3)
	got := map[int64]bool{}
	for _, l := range leases {
		got[l.ID] = l.TimestampOutside
	}
	require.Equal(t, map[int64]bool{ids[0]: true, ids[1]: true, ids[2]: false}, got)

	b2 := setup(t, outbox.Config{})
	b2.enqueue(t, old)
	l := b2.claim(t, outbox.ClaimOptions{Limit: 1})
	require.False(t, l[0].TimestampOutside, "no bounds given: nothing is outside")
}

// The claim decides, by the database clock, whether a cancellation's
// deadline (payload.cancel_by) falls before its lease ends: passed, or
// inside the lease, it is past; after the lease, or unknown, it is not.
// Under both policies.
func TestClaimPastDeadline(t *testing.T) {
	t.Parallel()
	for _, policy := range []outbox.Policy{outbox.BestEffort, outbox.PerKey} {
		b := setup(t, outbox.Config{})
		at := func(n int, by time.Duration) outbox.NewItem {
			it := newItem(n)
			it.Payload.CancelBy = time.Now().Add(by).Unix()
			return it
		}
		ids := b.enqueue(t, at(1, -time.Hour), at(2, 10*time.Second), at(3, time.Hour), newItem(4))
		leases := b.claim(t, outbox.ClaimOptions{Owner: "w", Limit: 10, Lease: time.Minute, Policy: policy})
		require.Len(t, leases, 4)
		got := map[int64]bool{}
		for _, l := range leases {
			got[l.ID] = l.PastDeadline
		}
		require.Equal(t, map[int64]bool{ids[0]: true, ids[1]: true, ids[2]: false, ids[3]: false}, got, "policy %v", policy)
	}
}

// A claim is one transaction: under BestEffort sent in one round trip
// (BEGIN, the statement, COMMIT), where a failed statement makes the
// server skip the rest, COMMIT included; under PerKey statement by
// statement. When a statement of it fails, nothing may stay leased, no key
// lock may outlive the claim, and the connection must come back out of the
// transaction, whether the claim ran on a connection of its own or on a
// pool.
func TestClaimThatFailsLeasesNothingAndLeavesNoTransactionOpen(t *testing.T) {
	t.Parallel()
	for _, policy := range []outbox.Policy{outbox.PerKey, outbox.BestEffort} {
		t.Run(policy.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t, outbox.Config{})
			ids := b.enqueue(t, keyed(1, 0), keyed(2, 1), keyed(3, 2))
			// Every lease fails, as a full disk or a killed statement would.
			_, err := b.pool.Exec(b.ctx, `
				CREATE FUNCTION test_refuse_lease() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN RAISE EXCEPTION 'injected lease failure'; END $$;
				CREATE TRIGGER test_refuse_lease BEFORE UPDATE ON outbox_item_states
				    FOR EACH ROW WHEN (NEW.state = 'leased') EXECUTE FUNCTION test_refuse_lease();`)
			require.NoError(t, err)

			conn, err := pgx.Connect(b.ctx, testdb.URLOf(t, b.pool))
			require.NoError(t, err)
			t.Cleanup(func() { _ = conn.Close(context.Background()) })
			opts := outbox.ClaimOptions{Owner: "w", Limit: 10, Policy: policy}

			for name, db := range map[string]pgdb.DB{"connection": conn, "pool": b.pool} {
				leases, err := b.store.Claim(b.ctx, db, opts)
				require.ErrorContains(t, err, "injected lease failure", name)
				require.Empty(t, leases, name)
			}
			require.Equal(t, byte('I'), conn.PgConn().TxStatus(), "the failed claim's transaction was rolled back")
			var locks int
			require.NoError(t, conn.QueryRow(b.ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()`).Scan(&locks))
			require.Zero(t, locks, "no key lock outlives the claim")
			for _, id := range ids {
				it := b.get(t, id)
				require.Equal(t, outbox.StatePending, it.State)
				require.Zero(t, it.Attempts, "a failed claim consumes no attempt")
			}

			// Once the cause is gone, both claim as before.
			_, err = b.pool.Exec(b.ctx, `DROP TRIGGER test_refuse_lease ON outbox_item_states`)
			require.NoError(t, err)
			leases, err := b.store.Claim(b.ctx, conn, outbox.ClaimOptions{Owner: "w", Limit: 2, Policy: policy})
			require.NoError(t, err)
			require.Len(t, leases, 2)
			leases, err = b.store.Claim(b.ctx, b.pool, opts)
			require.NoError(t, err)
			require.Len(t, leases, 1)
			require.Equal(t, ids[2], leases[0].ID)
		})
	}
}

// A PerKey claim whose snapshot missed another claimer's lease of the key
// picks another item of that key; migration 24's unique index refuses the
// second lease, and the claim is retried with a fresh snapshot, which sees
// the key held: it leases nothing of that key, returns no error and counts
// a claim stale write. The other claimer's lease is written here by hand, in
// an open transaction, as a PerKey claim writes it: committed only once
// the claim under test waits on it.
func TestPerKeyClaimThatLosesAKeyToAConcurrentClaimerRetries(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	// Item "later" is due now; "first" is due in a minute, so the claim
	// under test takes "later" as the key's next item — while the other
	// claimer (its clock a minute ahead, say) leases "first".
	ids := b.enqueue(t, keyed(1, 0), keyed(2, 0), keyed(3, 1))
	first, later, other := ids[0], ids[1], ids[2]
	_, err := b.pool.Exec(b.ctx, `UPDATE outbox_item_states SET next_attempt_at = clock_timestamp() + interval '1 minute' WHERE id = $1`, first)
	require.NoError(t, err)

	rival, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = rival.Rollback(b.ctx) }()
	tag, err := rival.Exec(b.ctx, `
UPDATE outbox_item_states SET state = 'leased', lease_token = lease_token + 1, attempts = attempts + 1,
    first_attempt_at = clock_timestamp(), lease_owner = 'rival', per_key_lease = true,
    leased_at = clock_timestamp(), lease_expires_at = clock_timestamp() + interval '1 minute',
    updated_at = clock_timestamp()
WHERE id = $1`, first)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())

	type result struct {
		leases []outbox.Lease
		err    error
	}
	done := make(chan result, 1)
	go func() {
		leases, err := b.store.Claim(b.ctx, b.pool, outbox.ClaimOptions{Owner: "late", Limit: 10})
		done <- result{leases, err}
	}()
	// The claim waits on the rival's index entry for the key.
	require.Eventually(t, func() bool {
		var waiting bool
		err := b.pool.QueryRow(b.ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted)`).Scan(&waiting)
		return err == nil && waiting
	}, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, rival.Commit(b.ctx))

	var r result
	select {
	case r = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the claim did not return")
	}
	require.NoError(t, r.err)
	require.Len(t, r.leases, 1, "the other key's item, and nothing of the held key")
	require.Equal(t, other, r.leases[0].ID)
	require.Equal(t, outbox.StatePending, b.get(t, later).State)
	require.Equal(t, 0, b.get(t, later).Attempts, "the refused lease consumed no attempt")
	require.Equal(t, float64(1), b.stale(outbox.TransitionClaim), "the lost key counts as the claim's stale write")
}

// An expired PerKey lease holds its key until it is taken over or, past
// the budget, settled by the sweep: a key is never leased twice, even
// after a lease expired. Past the attempt cap the expired item is not
// claimable, so the key's next item waits for the sweep.
func TestPerKeyExpiredLeasePastTheCapHoldsItsKeyUntilTheSweep(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{MaxAttempts: 1})
	ids := b.enqueue(t, keyed(1, 0), keyed(2, 0))
	dead := b.claim(t, outbox.ClaimOptions{Owner: "dead", Limit: 10, Lease: 50 * time.Millisecond})
	require.Len(t, dead, 1)
	require.Equal(t, ids[0], dead[0].ID)
	time.Sleep(80 * time.Millisecond)

	require.Empty(t, b.claim(t, outbox.ClaimOptions{Owner: "w", Limit: 10}),
		"the expired lease is past the cap, and still holds the key")
	swept, err := b.store.Sweep(b.ctx, b.pool)
	require.NoError(t, err)
	require.Equal(t, []int64{ids[0]}, swept)
	require.Equal(t, outbox.StateUncertain, b.get(t, ids[0]).State)

	next := b.claim(t, outbox.ClaimOptions{Owner: "w", Limit: 10})
	require.Len(t, next, 1)
	require.Equal(t, ids[1], next[0].ID)
}

// A PerKey claim that comes up short in its one-statement try looks further
// with the statements of its second try; a lease of the first that expired
// meanwhile (here a lease of a microsecond) is not taken over by the
// second, or the claim would return two leases of one item.
func TestPerKeyClaimNeverReturnsAnItemTwice(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, keyed(1, 0), keyed(2, 0), keyed(3, 1))
	got := b.claim(t, outbox.ClaimOptions{Owner: "w", Limit: 10, Lease: time.Microsecond})
	seen := map[int64]bool{}
	for _, l := range got {
		require.False(t, seen[l.ID], "item %d leased twice by one claim", l.ID)
		seen[l.ID] = true
	}
	require.Len(t, got, 2, "one item of each key")
	require.True(t, seen[ids[0]] && seen[ids[2]])
	require.Equal(t, 1, b.get(t, ids[0]).Attempts)
}

// The accept runs with its generic plan in a pipeline of its own (BEGIN, SET
// LOCAL plan_cache_mode, the accept, COMMIT), or, in a batch of mixed
// outcomes, between a save and a restore of the setting in the batch's
// transaction. A failed accept leaves no transaction open on a connection,
// lands nothing, and the session's own plan_cache_mode is as it was after a
// failed and a successful Record, on either path.
func TestAcceptInItsOwnPipelineLeavesTheSessionAsItWas(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, keyed(1, 0), keyed(2, 1), keyed(3, 2), keyed(4, 3))
	conn, err := pgx.Connect(b.ctx, testdb.URLOf(t, b.pool))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(b.ctx, `SET plan_cache_mode = force_custom_plan`)
	require.NoError(t, err)
	mode := func() string {
		var m string
		require.NoError(t, conn.QueryRow(b.ctx, `SHOW plan_cache_mode`).Scan(&m))
		return m
	}
	leases := b.claim(t, outbox.ClaimOptions{Owner: "w", Limit: 4})
	require.Len(t, leases, 4)
	accepts := func(ls ...outbox.Lease) []outbox.Outcome {
		var out []outbox.Outcome
		for _, l := range ls {
			out = append(out, outbox.Outcome{Lease: l, Kind: outbox.Accepted, ProviderRef: "r"})
		}
		return out
	}
	mixed := append(accepts(leases[2]), outbox.Outcome{Lease: leases[3], Kind: outbox.Retry,
		Error: outbox.ErrorInfo{Code: "stripe_5xx", Status: 500}})

	_, err = b.pool.Exec(b.ctx, `
		CREATE FUNCTION test_refuse_accept() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'injected accept failure'; END $$;
		CREATE TRIGGER test_refuse_accept BEFORE UPDATE ON outbox_item_states
		    FOR EACH ROW WHEN (NEW.state = 'accepted') EXECUTE FUNCTION test_refuse_accept();`)
	require.NoError(t, err)
	for name, db := range map[string]pgdb.DB{"connection": conn, "pool": b.pool} {
		_, err := b.store.Record(b.ctx, db, accepts(leases[0]))
		require.ErrorContains(t, err, "injected accept failure", name)
		_, err = b.store.Record(b.ctx, db, mixed)
		require.ErrorContains(t, err, "injected accept failure", name)
	}
	require.Equal(t, byte('I'), conn.PgConn().TxStatus(), "the failed accept's transaction was rolled back")
	require.Equal(t, "force_custom_plan", mode())
	for _, l := range leases {
		it := b.get(t, l.ID)
		require.Equal(t, outbox.StateLeased, it.State)
		require.Equal(t, l.LeaseToken, it.LeaseToken)
	}

	_, err = b.pool.Exec(b.ctx, `DROP TRIGGER test_refuse_accept ON outbox_item_states`)
	require.NoError(t, err)
	res, err := b.store.Record(b.ctx, conn, accepts(leases[0], leases[1]))
	require.NoError(t, err)
	for _, r := range res {
		require.NoError(t, r.Err)
		require.Equal(t, outbox.StateAccepted, r.State)
	}
	require.Equal(t, "force_custom_plan", mode(), "SET LOCAL ended with its transaction")
	res, err = b.store.Record(b.ctx, conn, mixed)
	require.NoError(t, err)
	require.Equal(t, outbox.StateAccepted, res[0].State)
	require.Equal(t, outbox.StatePending, res[1].State)
	// Set with set_config(..., true), the setting would end with the
	// batch's transaction even unrestored; the restore is for the steps
	// after the accept in that transaction, which keep their own plans.
	require.Equal(t, "force_custom_plan", mode())
}

// Claim and Record run transactions of their own. On a connection inside
// a caller's transaction, their BEGIN would only draw a warning and their
// COMMIT commit the caller's work; they refuse instead, and change nothing.
func TestClaimAndRecordRefuseAConnectionInsideATransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, keyed(1, 0), keyed(2, 1))
	leases := b.claim(t, outbox.ClaimOptions{Owner: "w", Limit: 1})
	require.Len(t, leases, 1)
	conn, err := pgx.Connect(b.ctx, testdb.URLOf(t, b.pool))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })

	tx, err := conn.Begin(b.ctx)
	require.NoError(t, err)
	_, err = tx.Exec(b.ctx, `CREATE TEMP TABLE callers_work (x int)`)
	require.NoError(t, err)
	for _, policy := range []outbox.Policy{outbox.PerKey, outbox.BestEffort} {
		got, err := b.store.Claim(b.ctx, conn, outbox.ClaimOptions{Owner: "w", Limit: 10, Policy: policy})
		require.ErrorContains(t, err, "inside a transaction", policy.String())
		require.Empty(t, got)
	}
	_, err = b.store.Record(b.ctx, conn, []outbox.Outcome{{Lease: leases[0], Kind: outbox.Accepted, ProviderRef: "r"}})
	require.ErrorContains(t, err, "inside a transaction")
	require.Equal(t, byte('T'), conn.PgConn().TxStatus(), "the caller's transaction is still open")
	require.NoError(t, tx.Rollback(b.ctx))

	var tables int
	require.NoError(t, conn.QueryRow(b.ctx, `SELECT count(*) FROM pg_tables WHERE tablename = 'callers_work'`).Scan(&tables))
	require.Zero(t, tables, "the caller's work was rolled back, not committed")
	require.Equal(t, outbox.StateLeased, b.get(t, ids[0]).State)
	require.Equal(t, outbox.StatePending, b.get(t, ids[1]).State)
	_, err = b.store.Record(b.ctx, conn, []outbox.Outcome{{Lease: leases[0], Kind: outbox.Accepted, ProviderRef: "r"}})
	require.NoError(t, err, "an idle connection is fine")
}
