package outbox_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// distributedBundle is setup on a distributed database.
func distributedBundle(t *testing.T) *testBundle {
	t.Helper()
	reg := prometheus.NewRegistry()
	store, err := outbox.New(outbox.Config{}, reg)
	require.NoError(t, err)
	return &testBundle{ctx: context.Background(), pool: testdb.NewDistributed(t), store: store, reg: reg}
}

// Every claim statement of one shard group's buckets plans as one task of
// one shard, for every exporter's items and for one exporter's; the
// abandoned attempts, written apart, are an INSERT … SELECT from unnest the
// coordinator evaluates and sends to the shards of its rows.
func TestClaimCitusPlans(t *testing.T) {
	t.Parallel()
	b := distributedBundle(t)
	shards, err := b.store.Shards(b.ctx, b.pool)
	require.NoError(t, err)
	require.True(t, shards.Distributed())
	buckets := shards.Buckets(shards.GroupOf(tenantbucket.Of("acme")))
	args := pgx.NamedArgs{
		"owner": "w1", "limit": 10, "scan": 40, "lockmax": 20, "lease": time.Minute, "max": 10,
		"horizon": 24 * time.Hour, "accept_past": 35 * 24 * time.Hour, "accept_future": 5 * time.Minute,
		"per_key": true, "tried": []string{"acct_123|cus_1|api_calls"}, "space": int32(1),
		"ids": []int64{1, 2, 3}, "buckets": buckets,
	}
	for _, exporter := range []string{"", "stripe_meter_events"} {
		for name, sql := range outbox.ClaimStatements(exporter, true) {
			t.Run(exporter+"/"+name, func(t *testing.T) {
				require.Equal(t, []int{1}, testdb.CitusTasks(t, b.pool, sql, args), sql)
			})
		}
	}
	abandoned := pgx.NamedArgs{
		"ids": []int64{1, 2}, "tokens": []int64{1, 3}, "owners": []string{"w1", "w2"},
		"leased_ats": []time.Time{time.Now(), time.Now()}, "abandoned_buckets": []int16{buckets[0], buckets[1]},
	}
	locks := pgx.NamedArgs{"keys": []string{"k1", "k2"}, "ids": []int64{1, 2}, "space": int32(1), "lockmax": 2, "buckets": buckets}
	require.Equal(t, []int{1}, testdb.CitusTasks(t, b.pool, outbox.SQLClaimLockGroupKeys, locks))

	// A list spanning two groups, as a group's is after a split, is
	// refused by the statement every group's claim starts with, with the
	// error that makes the claim read the placement again.
	spanning := pgx.NamedArgs{}
	for k, v := range args {
		spanning[k] = v
	}
	spanning["buckets"] = slices.Concat(shards.Buckets(0), shards.Buckets(1))
	for _, name := range []string{"best_effort", "per_key_one"} {
		_, err := b.pool.Exec(b.ctx, outbox.ClaimStatements("", true)[name], spanning)
		require.True(t, outbox.SpansShards(err), "%s: %v", name, err)
	}

	var plan []map[string]any
	require.NoError(t, b.pool.QueryRow(b.ctx, "EXPLAIN (FORMAT JSON, COSTS OFF) "+outbox.SQLClaimAbandoned, abandoned).Scan(&plan))
	top := plan[0]["Plan"].(map[string]any)
	require.Equal(t, "pull to coordinator", top["INSERT/SELECT method"], "%v", plan)
	sel := top["Select Query"].([]any)[0].(map[string]any)["Plan"].(map[string]any)
	require.Equal(t, "Function Scan", sel["Node Type"], "%v", plan)
}

// tenantsInGroups returns a tenant of each of n shard groups.
func tenantsInGroups(t *testing.T, shards *tenantbucket.Shards, n int) []string {
	t.Helper()
	seen := map[int]bool{}
	var tenants []string
	for i := 0; len(tenants) < n; i++ {
		require.Less(t, i, 10000, "too few shard groups")
		tenant := fmt.Sprintf("tenant-%d", i)
		if g := shards.GroupOf(tenantbucket.Of(tenant)); !seen[g] {
			seen[g] = true
			tenants = append(tenants, tenant)
		}
	}
	return tenants
}

// Concurrent claimers on a distributed database, under either policy,
// lease every item of every group once; under PerKey a key holds one lease
// in each bucket; an expired lease is taken over and its abandoned attempt
// written.
func TestClaimCitusConcurrent(t *testing.T) {
	t.Parallel()
	for _, policy := range []outbox.Policy{outbox.BestEffort, outbox.PerKey} {
		t.Run(policy.String(), func(t *testing.T) {
			t.Parallel()
			b := distributedBundle(t)
			shards, err := b.store.Shards(b.ctx, b.pool)
			require.NoError(t, err)
			tenants := tenantsInGroups(t, shards, 6)
			var items []outbox.NewItem
			for i, tenant := range tenants {
				for k := range 3 {
					for n := range 2 {
						it := keyed(100*i+10*k+n, k)
						it.TenantKey = tenant
						items = append(items, it)
					}
				}
			}
			ids := b.enqueue(t, items...)
			// Under PerKey a key's second item waits for its first: one
			// item per key and bucket is claimable.
			want := len(ids)
			if policy == outbox.PerKey {
				want = len(tenants) * 3
			}

			var (
				mu     sync.Mutex
				leases []outbox.Lease
				wg     sync.WaitGroup
			)
			for w := range 4 {
				wg.Go(func() {
					for empty := 0; empty < 3; {
						got, err := b.store.Claim(b.ctx, b.pool, outbox.ClaimOptions{
							Owner: fmt.Sprintf("w%d", w), Limit: 4, Policy: policy,
						})
						if err != nil {
							t.Error(err)
							return
						}
						if len(got) == 0 {
							empty++
						}
						mu.Lock()
						leases = append(leases, got...)
						mu.Unlock()
					}
				})
			}
			wg.Wait()

			byID := map[int64]outbox.Lease{}
			perKey := map[string]int{}
			for _, l := range leases {
				_, dup := byID[l.ID]
				require.False(t, dup, "item %d leased twice", l.ID)
				byID[l.ID] = l
				perKey[fmt.Sprintf("%s/%d", l.OrderingKey, tenantbucket.Of(l.TenantKey))]++
			}
			require.Len(t, byID, want, "every group's items claimed")
			groups := map[int]bool{}
			for _, l := range byID {
				groups[shards.GroupOf(tenantbucket.Of(l.TenantKey))] = true
			}
			require.Len(t, groups, len(tenants))
			if policy == outbox.PerKey {
				for k, n := range perKey {
					require.Equal(t, 1, n, "key %s", k)
				}
			}

			// The leases expire; the next claim takes them over and
			// writes each abandoned attempt.
			_, err = b.pool.Exec(b.ctx, `UPDATE outbox_item_states SET lease_expires_at = '2000-01-01 00:01Z'
				WHERE state = 'leased'`)
			require.NoError(t, err)
			again, err := b.store.Claim(b.ctx, b.pool, outbox.ClaimOptions{Owner: "taker", Limit: outbox.MaxClaim, Policy: policy})
			require.NoError(t, err)
			require.Len(t, again, want)
			for _, l := range again {
				prev := byID[l.ID]
				require.Equal(t, prev.LeaseToken+1, l.LeaseToken)
				attempts, err := b.store.Attempts(b.ctx, b.pool, l.ID)
				require.NoError(t, err)
				require.Len(t, attempts, 1)
				require.Equal(t, "abandoned", attempts[0].Outcome)
				require.Equal(t, prev.LeaseToken, attempts[0].LeaseToken)
				require.Equal(t, prev.LeaseOwner, attempts[0].LeaseOwner)
			}
			if policy != outbox.PerKey {
				return
			}

			// A second PerKey lease of a key in one bucket is refused by
			// the shard's unique index, with the error a claim takes as
			// losing the key to another claimer.
			l, bucket := again[0], tenantbucket.Of(again[0].TenantKey)
			_, err = b.pool.Exec(b.ctx, `UPDATE outbox_item_states SET state = 'leased', per_key_lease = true,
					lease_token = lease_token + 1, attempts = attempts + 1, first_attempt_at = statement_timestamp(),
					lease_owner = 'other', leased_at = statement_timestamp(), lease_expires_at = statement_timestamp() + interval '1 hour'
				WHERE bucket = $1 AND ordering_key = $2 AND id <> $3 AND state = 'pending'`, bucket, l.OrderingKey, l.ID)
			require.True(t, outbox.IsKeyConflict(err), "%v", err)
		})
	}
}

// A hot key of one group, older than everything else, crowds out neither
// its group's other keys (the loose scan finds them, its keys locked on
// the shard's node) nor another group's.
func TestClaimCitusPerKeyHotKey(t *testing.T) {
	t.Parallel()
	b := distributedBundle(t)
	shards, err := b.store.Shards(b.ctx, b.pool)
	require.NoError(t, err)
	tenants := tenantsInGroups(t, shards, 2)
	var hot []outbox.NewItem
	for i := range 200 {
		it := keyed(i, 0)
		it.TenantKey = tenants[0]
		hot = append(hot, it)
	}
	b.enqueue(t, hot...)
	var rest []outbox.NewItem
	for i, tenant := range tenants {
		for k := 1; k <= 3; k++ {
			it := keyed(1000+10*i+k, k)
			it.TenantKey = tenant
			rest = append(rest, it)
		}
	}
	b.enqueue(t, rest...)

	got := b.claim(t, outbox.ClaimOptions{Limit: 10})
	keys := map[string]bool{}
	for _, l := range got {
		k := fmt.Sprintf("%s/%s", l.OrderingKey, l.TenantKey)
		require.False(t, keys[k], "two items of one key and bucket in one claim")
		keys[k] = true
	}
	require.Len(t, keys, 7, "every key of every group gets one item: %v", keys)
}

// A claim with Quiet passes over the shard groups a claim of the same
// exporter found empty, until a notification naming a group's buckets
// stirs it (the item staged there meanwhile waits) or its quiet lapses:
// then one read of the lapsed groups' shards (the probe) finds which
// hold due items, and only those are claimed from. The notification a
// distributed stage sends names the item's bucket.
func TestClaimCitusPassesOverQuietGroups(t *testing.T) {
	t.Parallel()
	b := distributedBundle(t)
	shards, err := b.store.Shards(b.ctx, b.pool)
	require.NoError(t, err)
	tenants := tenantsInGroups(t, shards, 3)
	quiet := outbox.ClaimOptions{Limit: 10, Quiet: time.Hour, Exporter: "stripe_meter_events"}
	require.Empty(t, b.claim(t, quiet), "nothing staged")

	conn, err := b.pool.Acquire(b.ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(b.ctx, "LISTEN "+outbox.NotifyChannel)
	require.NoError(t, err)
	it := keyed(1, 0)
	it.TenantKey = tenants[0]
	b.enqueue(t, it)
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	n, err := conn.Conn().WaitForNotification(ctx)
	require.NoError(t, err)
	require.Equal(t, fmt.Sprint(tenantbucket.Of(tenants[0])), n.Payload)

	require.Empty(t, b.claim(t, quiet), "its group was found empty a moment ago")
	b.store.Stir(fmt.Sprint(tenantbucket.Of(tenants[1])))
	require.Empty(t, b.claim(t, quiet), "another group was stirred")
	b.store.Stir(n.Payload)
	got := b.claim(t, quiet)
	require.Len(t, got, 1, "the stirred group is read again")
	require.Equal(t, tenants[0], got[0].TenantKey)

	// Every group goes quiet for a moment; an item staged meanwhile,
	// unheard, is found by the probe once the quiet lapses.
	short := quiet
	short.Quiet = 2 * time.Second
	b.store.Stir("")
	require.Empty(t, b.claim(t, short))
	it = keyed(2, 0)
	it.TenantKey = tenants[2]
	b.enqueue(t, it)
	require.Empty(t, b.claim(t, short), "every group is quiet")
	time.Sleep(short.Quiet)
	got = b.claim(t, short)
	require.Len(t, got, 1, "the probe found the lapsed group's item")
	require.Equal(t, tenants[2], got[0].TenantKey)

	// The probe reads the shards of the groups it names, and only those.
	two := slices.Concat(shards.Buckets(0), shards.Buckets(1))
	require.Equal(t, []int{2}, testdb.CitusTasks(t, b.pool, outbox.ClaimProbe("stripe_meter_events"),
		pgx.NamedArgs{"buckets": two, "max": 10, "horizon": 24 * time.Hour}))
}

// A claim that finds only a leased key's next item finds nothing and
// leaves the group quiet; settling the lease ends that quiet, so that the
// key's next item is claimed at once, not after the quiet.
func TestClaimCitusSettledLeaseStirsItsGroup(t *testing.T) {
	t.Parallel()
	b := distributedBundle(t)
	perKey := outbox.ClaimOptions{Limit: 10, Quiet: time.Hour, Exporter: "stripe_meter_events", Policy: outbox.PerKey}
	b.enqueue(t, keyed(1, 0), keyed(2, 0))
	first := b.claim(t, perKey)
	require.Len(t, first, 1, "one item of the key")
	require.Empty(t, b.claim(t, perKey), "the key's next item waits for its lease")
	require.NoError(t, b.store.Accept(b.ctx, b.pool, first[0], "ref_1"))
	next := b.claim(t, perKey)
	require.Len(t, next, 1, "the key's next item, claimed at once")
	require.NotEqual(t, first[0].ID, next[0].ID)
}
