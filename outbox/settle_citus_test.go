package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// TestSettleStatementsAreOneTask keeps every transition that settles,
// confirms, recovers, requeues, parks or sweeps items routed on Citus: with
// the buckets of one shard group, each statement is one task on one shard.
// The attempts' INSERT from unnest() is pulled to the coordinator, which
// evaluates the rows and copies them into their one shard: no distributed
// job in its plan (docs/citus/findings.md). The by-id read of buckets
// reads every shard.
func TestSettleStatementsAreOneTask(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewDistributed(t)
	shards, err := tenantbucket.ReadShards(ctx, pool)
	require.NoError(t, err)
	require.True(t, shards.Distributed())
	group := shards.Buckets(3)
	buckets := group[:2]
	ids, tokens, texts := []int64{29, 30}, []int64{1, 2}, []string{"a", "b"}
	statuses, refused := []int32{0, 500}, []bool{false, true}
	now := time.Now()
	common := func(extra pgx.NamedArgs) pgx.NamedArgs {
		args := pgx.NamedArgs{"ids": ids, "item_buckets": buckets, "tokens": tokens, "buckets": buckets}
		for k, v := range extra {
			args[k] = v
		}
		return args
	}
	for _, tc := range []struct {
		name string
		sql  string
		args pgx.NamedArgs
		want []int
	}{
		{"accept", sqlAccept, common(pgx.NamedArgs{"refs": texts, "meters": texts}), []int{1}},
		{"retry", sqlRetry, common(pgx.NamedArgs{"delays": []int64{5e6, 6e6}, "refused": refused, "codes": texts,
			"statuses": statuses, "messages": texts, "max": 20, "horizon": 20 * time.Hour}), []int{1}},
		{"mark_uncertain/reject/quarantine", sqlSettleFailure, common(pgx.NamedArgs{"states": []string{"rejected", "quarantined"},
			"reasons": []string{"", "feature_unmapped"}, "refused": refused, "codes": texts, "statuses": statuses, "messages": texts}), []int{1}},
		{"lock a mixed batch", sqlLockBatch, common(nil), []int{1}},
		{"sweep", sqlSweep, pgx.NamedArgs{"buckets": group, "max": 20, "horizon": 20 * time.Hour}, []int{1}},
		{"confirm", sqlConfirm, common(nil), []int{1}},
		{"fail_accepted", sqlFailAccepted, common(pgx.NamedArgs{"states": []string{"rejected", "quarantined"},
			"reasons": []string{"", "feature_unmapped"}, "codes": texts, "statuses": statuses, "messages": texts}), []int{1}},
		{"error report note", sqlNoteFailures, common(pgx.NamedArgs{"states": []string{"rejected", "quarantined"},
			"reasons": []string{"", "feature_unmapped"}, "codes": texts, "messages": texts}), []int{1}},
		{"recover to accepted", sqlRecoverAccepted, pgx.NamedArgs{"id": 29, "token": 1, "ref": "req", "reason": "", "buckets": buckets[:1]}, []int{1}},
		{"recover to pending", sqlRecoverPending, pgx.NamedArgs{"id": 29, "token": 1, "ref": "", "reason": "checked",
			"not_reached": true, "horizon": 20 * time.Hour, "buckets": buckets[:1]}, []int{1}},
		{"recover to rejected", sqlRecoverRejected, pgx.NamedArgs{"id": 29, "token": 1, "ref": "", "reason": "gone", "buckets": buckets[:1]}, []int{1}},
		{"requeue", sqlRequeue, pgx.NamedArgs{"id": 29, "version": 1, "buckets": buckets[:1]}, []int{1}},
		{"supersede", sqlSupersede, pgx.NamedArgs{"id": 29, "version": 1, "successor": 31, "buckets": buckets[:1]}, []int{1}},
		{"park", sqlPark, pgx.NamedArgs{"keys": []string{"acct_1", "acct_2|calls"}, "exporter": "stripe_meter_events",
			"for": time.Minute, "limit": ParkLimit, "buckets": group}, []int{1}},
		{"unpark", sqlUnpark, pgx.NamedArgs{"keys": []string{"acct_1"}, "exporter": "stripe_meter_events",
			"for": time.Minute, "buckets": group}, []int{1}},
		{"buckets of ids (every shard)", sqlBucketsOf, pgx.NamedArgs{"ids": ids}, []int{32}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, testdb.CitusTasks(t, pool, tc.sql, tc.args))
		})
	}
	t.Run("attempts", func(t *testing.T) {
		// No distributed job: the coordinator evaluates unnest() and
		// copies the rows to the shard of their buckets (one, for a group
		// of one shard).
		var plan []map[string]map[string]any
		require.NoError(t, pool.QueryRow(ctx, "EXPLAIN (FORMAT JSON, COSTS OFF) "+sqlAttempts, common(pgx.NamedArgs{
			"owners": texts, "leased_at": []time.Time{now, now}, "outcomes": []string{"accepted", "retry"},
			"states": []string{"accepted", "pending"}, "refused": refused, "refs": texts,
			"codes": []*string{nil, &texts[0]}, "statuses": statuses, "messages": texts,
		})).Scan(&plan))
		top := plan[0]["Plan"]
		require.Equal(t, "Citus INSERT ... SELECT", top["Custom Plan Provider"])
		require.Equal(t, "pull to coordinator", top["INSERT/SELECT method"])
		sel := top["Select Query"].([]any)[0].(map[string]any)["Plan"].(map[string]any)
		require.Equal(t, "Function Scan", sel["Node Type"])
	})
}

// citusTenants returns n tenants whose buckets lie in n different shard
// groups.
func citusTenants(t *testing.T, shards *tenantbucket.Shards, n int) []string {
	t.Helper()
	seen := map[int]bool{}
	var out []string
	for i := 0; len(out) < n; i++ {
		tenant := fmt.Sprintf("tenant-%d", i)
		if g := shards.GroupOf(tenantbucket.Of(tenant)); !seen[g] {
			seen[g] = true
			out = append(out, tenant)
		}
	}
	return out
}

// citusLease leases item id as a claim would (the claim's own statement is
// not this test's): a new token, an attempt spent, first_attempt_at kept.
func citusLease(t *testing.T, pool *pgxpool.Pool, store *Store, id int64) Lease {
	t.Helper()
	ctx := context.Background()
	it, err := store.Get(ctx, pool, id)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE outbox_item_states SET state = 'leased', lease_token = lease_token + 1, attempts = attempts + 1,
		first_attempt_at = least(first_attempt_at, statement_timestamp()), lease_owner = 'citus-test', leased_at = statement_timestamp(),
		lease_expires_at = statement_timestamp() + interval '1 hour', updated_at = statement_timestamp()
		WHERE bucket = $1 AND id = $2 AND state IN ('pending', 'leased')`, tenantbucket.Of(it.TenantKey), id)
	require.NoError(t, err)
	it, err = store.Get(ctx, pool, id)
	require.NoError(t, err)
	require.Equal(t, StateLeased, it.State)
	return Lease{Item: it}
}

// TestSettleAcrossShardGroups runs the transitions out of leased, the
// operator's and the provider's transitions and the sweep on a distributed
// database, with items of tenants in four shard groups: every outcome lands
// where it would on one server, a stale token is fenced out, and each
// outcome and abandoned lease has its attempt row.
func TestSettleAcrossShardGroups(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewDistributed(t)
	store, err := New(Config{MaxAttempts: 5}, nil)
	require.NoError(t, err)
	shards, err := store.Shards(ctx, pool)
	require.NoError(t, err)
	require.True(t, shards.Distributed())
	tenants := citusTenants(t, shards, 4)

	// Eight items per tenant, each enqueued in its own transaction.
	items := map[string][]int64{}
	for ti, tenant := range tenants {
		for n := range 8 {
			ni := NewItem{
				Identity: Identity{TenantKey: tenant, SubjectKind: SubjectUsageEvent, SubjectRef: fmt.Sprintf("event:calls:%d-%d", ti, n),
					Exporter: "stripe_meter_events", DestinationAccount: "acct_123", Mode: ModeTest, MappingVersion: 1},
				Payload: Payload{Customer: fmt.Sprintf("cus_%d", ti), EventName: "calls", Value: 1, Timestamp: 1796000000,
					Feature: "calls", Period: "2026-11-01T00:00:00Z"},
			}
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			enq, err := store.Enqueue(ctx, tx, ni)
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))
			items[tenant] = append(items[tenant], enq.ID)
		}
	}
	lease := func(tenant string, n int) Lease { return citusLease(t, pool, store, items[tenant][n]) }
	state := func(tenant string, n int) State {
		it, err := store.Get(ctx, pool, items[tenant][n])
		require.NoError(t, err)
		return it.State
	}
	a, b, c, d := tenants[0], tenants[1], tenants[2], tenants[3]

	// A stale writer first: its outcome is fenced out and writes no attempt.
	stale := lease(a, 7)
	fresh := citusLease(t, pool, store, stale.ID)
	res, err := store.Record(ctx, pool, []Outcome{{Lease: stale, Kind: Accepted, ProviderRef: "req_stale"}})
	require.NoError(t, err)
	require.ErrorIs(t, res[0].Err, ErrStaleLease)

	// One accept alone (one group, its own round trips), then a mixed batch
	// over four groups.
	res, err = store.Record(ctx, pool, []Outcome{{Lease: fresh, Kind: Accepted, ProviderRef: "req_fresh"}})
	require.NoError(t, err)
	require.NoError(t, res[0].Err)
	require.Equal(t, StateAccepted, res[0].State)

	outcomes := []Outcome{
		{Lease: lease(a, 0), Kind: Accepted, ProviderRef: "req_a0"},
		{Lease: lease(b, 0), Kind: Accepted, ProviderRef: "req_b0"},
		{Lease: lease(a, 1), Kind: Retry, Error: ErrorInfo{Code: "http_503", Status: 503, Message: "unavailable"}},
		{Lease: lease(c, 0), Kind: RateLimited, Error: ErrorInfo{Code: "http_429", Status: 429}},
		{Lease: lease(b, 1), Kind: Rejected, Error: ErrorInfo{Code: "invalid", Status: 400, Message: "no"}},
		{Lease: lease(c, 1), Kind: Quarantined, Reason: ReasonFeatureUnmapped, Error: ErrorInfo{Code: "meter", Status: 400}},
		{Lease: lease(d, 0), Kind: Uncertain, Error: ErrorInfo{Code: "timeout"}},
		{Lease: lease(d, 1), Kind: Uncertain, Error: ErrorInfo{Code: "timeout"}},
		{Lease: lease(a, 2), Kind: Uncertain, Error: ErrorInfo{Code: "timeout"}},
		{Lease: stale, Kind: Retry, Error: ErrorInfo{Code: "http_503", Status: 503}},
	}
	res, err = store.Record(ctx, pool, outcomes)
	require.NoError(t, err)
	want := []State{StateAccepted, StateAccepted, StatePending, StatePending, StateRejected, StateQuarantined,
		StateUncertain, StateUncertain, StateUncertain}
	for i, w := range want {
		require.NoError(t, res[i].Err, "outcome %d", i)
		require.Equal(t, w, res[i].State, "outcome %d", i)
	}
	require.ErrorIs(t, res[len(res)-1].Err, ErrStaleLease)
	require.Equal(t, ReasonFeatureUnmapped, res[5].Reason)

	// Every landed outcome has its attempt row; the stale writer's none.
	for i, o := range outcomes[:len(want)] {
		att, err := store.Attempts(ctx, pool, o.Lease.ID)
		require.NoError(t, err)
		require.Len(t, att, 1, "outcome %d", i)
		require.Equal(t, o.Lease.LeaseToken, att[0].LeaseToken)
		require.Equal(t, want[i], att[0].StateAfter)
	}
	att, err := store.Attempts(ctx, pool, fresh.ID)
	require.NoError(t, err)
	require.Len(t, att, 1)
	require.Equal(t, fresh.LeaseToken, att[0].LeaseToken)

	// Confirm over three groups; an item not accepted is refused.
	confirmed, refused, err := store.Confirm(ctx, pool, []int64{items[a][0], items[b][0], fresh.ID, items[b][1]})
	require.NoError(t, err)
	require.ElementsMatch(t, []int64{items[a][0], items[b][0], fresh.ID}, confirmed)
	var se *StateError
	require.ErrorAs(t, refused[items[b][1]], &se)
	require.Equal(t, StateRejected, se.Current)

	// Recover each target; a stale token is refused with the current state.
	d0, err := store.Get(ctx, pool, items[d][0])
	require.NoError(t, err)
	require.Equal(t, StateUncertain, d0.State)
	d1, err := store.Get(ctx, pool, items[d][1])
	require.NoError(t, err)
	a2, err := store.Get(ctx, pool, items[a][2])
	require.NoError(t, err)
	require.ErrorAs(t, store.Recover(ctx, pool, d0.ID, Recovery{To: StatePending, ExpectLeaseToken: d0.LeaseToken - 1}), &se)
	require.NoError(t, store.Recover(ctx, pool, d0.ID, Recovery{To: StatePending, ExpectLeaseToken: d0.LeaseToken}))
	require.NoError(t, store.Recover(ctx, pool, d1.ID, Recovery{To: StateAccepted, ExpectLeaseToken: d1.LeaseToken, ProviderRef: "req_d1"}))
	require.NoError(t, store.Recover(ctx, pool, a2.ID, Recovery{To: StateRejected, ExpectLeaseToken: a2.LeaseToken, Reason: "abandoned"}))
	require.Equal(t, StatePending, state(d, 0))
	require.Equal(t, StateAccepted, state(d, 1))
	require.Equal(t, StateRejected, state(a, 2))

	// Requeue the quarantined item; a second requeue finds it pending.
	require.NoError(t, store.Requeue(ctx, pool, items[c][1], 1))
	require.Equal(t, StatePending, state(c, 1))
	require.ErrorAs(t, store.Requeue(ctx, pool, items[c][1], 1), &se)

	// The provider's error report: fail an accepted item, note one in
	// flight whose accept then lands rejected.
	inFlight := lease(b, 2)
	failed, refusedF, err := store.FailAccepted(ctx, pool, []ProviderFailure{
		{ID: items[d][1], To: StateQuarantined, Reason: ReasonFeatureUnmapped, Error: ErrorInfo{Code: "meter"}},
		{ID: items[a][2], To: StateRejected, Error: ErrorInfo{Code: "x"}},
	})
	require.NoError(t, err)
	require.Equal(t, []int64{items[d][1]}, failed)
	require.ErrorAs(t, refusedF[items[a][2]], &se)
	noted, err := store.NoteFailures(ctx, pool, []ProviderFailure{{ID: inFlight.ID, To: StateRejected, Error: ErrorInfo{Code: "x"}}})
	require.NoError(t, err)
	require.Equal(t, []int64{inFlight.ID}, noted)
	res, err = store.Record(ctx, pool, []Outcome{{Lease: inFlight, Kind: Accepted, ProviderRef: "req_late"}})
	require.NoError(t, err)
	require.NoError(t, res[0].Err)
	require.Equal(t, StateRejected, res[0].State)

	// The sweep, with a cap of one attempt: expired leases in two groups,
	// pending items retried in three; the expired leases' attempts are
	// abandoned, a lease not expired stays.
	sweepA, sweepC := lease(a, 3), lease(c, 2)
	lease(b, 3)
	pend := lease(d, 2)
	res, err = store.Record(ctx, pool, []Outcome{{Lease: pend, Kind: Retry, Error: ErrorInfo{Code: "http_503", Status: 503}}})
	require.NoError(t, err)
	require.Equal(t, StatePending, res[0].State)
	for _, l := range []Lease{sweepA, sweepC} {
		_, err = pool.Exec(ctx, `UPDATE outbox_item_states SET lease_expires_at = statement_timestamp() - interval '1 second'
			WHERE bucket = $1 AND id = $2`, tenantbucket.Of(l.TenantKey), l.ID)
		require.NoError(t, err)
	}
	sweeper, err := New(Config{MaxAttempts: 1}, nil)
	require.NoError(t, err)
	swept, err := sweeper.Sweep(ctx, pool)
	require.NoError(t, err)
	require.ElementsMatch(t, []int64{sweepA.ID, sweepC.ID, pend.ID, items[a][1], items[c][0]}, swept)
	require.Equal(t, StateLeased, state(b, 3))
	for _, l := range []Lease{sweepA, sweepC} {
		require.Equal(t, StateUncertain, state(l.TenantKey, indexOf(items[l.TenantKey], l.ID)))
		att, err := store.Attempts(ctx, pool, l.ID)
		require.NoError(t, err)
		require.Len(t, att, 1)
		require.Equal(t, "abandoned", att[0].Outcome)
		require.Equal(t, l.LeaseToken, att[0].LeaseToken)
	}
	// The stale writer of the swept lease is fenced out.
	res, err = store.Record(ctx, pool, []Outcome{{Lease: sweepA, Kind: Accepted}})
	require.NoError(t, err)
	require.ErrorIs(t, res[0].Err, ErrStaleLease)

	// Park and unpark the pending items of one account, in every group.
	parked, err := store.Park(ctx, pool, "stripe_meter_events", []string{"acct_123"}, time.Hour)
	require.NoError(t, err)
	require.Positive(t, parked)
	unparked, err := store.Unpark(ctx, pool, "stripe_meter_events", []string{"acct_123"}, time.Hour)
	require.NoError(t, err)
	require.GreaterOrEqual(t, unparked, parked)
}

func indexOf(ids []int64, id int64) int {
	for i, v := range ids {
		if v == id {
			return i
		}
	}
	return -1
}
