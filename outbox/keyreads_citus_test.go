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

// tenantsInGroups returns n tenants whose buckets are in n different shard
// groups of shards.
func tenantsInGroups(t *testing.T, shards *tenantbucket.Shards, n int) []string {
	t.Helper()
	var out []string
	seen := map[int]bool{}
	for i := 0; len(out) < n && i < 10000; i++ {
		tenant := fmt.Sprintf("ten%d", i)
		if g := shards.GroupOf(tenantbucket.Of(tenant)); !seen[g] {
			seen[g] = true
			out = append(out, tenant)
		}
	}
	require.Len(t, out, n)
	return out
}

func distributedStore(t *testing.T) (context.Context, *pgxpool.Pool, *Store, *tenantbucket.Shards) {
	t.Helper()
	ctx := context.Background()
	pool := testdb.NewDistributed(t)
	store, err := New(Config{}, nil)
	require.NoError(t, err)
	shards, err := store.Shards(ctx, pool)
	require.NoError(t, err)
	require.True(t, shards.Distributed())
	return ctx, pool, store, shards
}

// The reads by key of one tenant, and each group's lock of a provider's
// report, are one task on a distributed database; the settled keys of a
// destination and the identifier lookup read every shard, by design.
func TestKeyReadsCitusPlans(t *testing.T) {
	t.Parallel()
	_, pool, _, shards := distributedStore(t)
	tenants := tenantsInGroups(t, shards, 2)
	b := tenantbucket.Of(tenants[0])
	// Two tenants of one group: a window batch's buckets.
	var sameGroup []string
	for i := 0; len(sameGroup) < 2; i++ {
		tenant := fmt.Sprintf("w%d", i)
		if shards.GroupOf(tenantbucket.Of(tenant)) == shards.GroupOf(b) {
			sameGroup = append(sameGroup, tenant)
		}
	}
	buckets, distinct := windowBuckets(sameGroup)
	for _, c := range []struct {
		name string
		sql  string
		args []any
		want []int
	}{
		{"key items", sqlKeyItemsInBuckets, []any{pgx.NamedArgs{"key": "acct_1|cus_1|calls", "mode": "test", "settle": time.Hour,
			"from": int64(0), "to": int64(2000000000), "buckets": []int16{b}}}, []int{1}},
		{"lock identified", sqlLockIdentified, []any{[]string{"tly_x", "tly_y"}, []int16{b}}, []int{1}},
		{"window item count", sqlWindowItemCount, []any{tenants[0], SubjectUsageWindow, "window:calls:1", b}, []int{1}},
		{"window item counts", sqlWindowItemCounts, []any{sameGroup, SubjectUsageWindow, []string{"window:a", "window:b"},
			buckets, distinct}, []int{1}},
		{"settled keys (every shard)", sqlSettledKeys, []any{pgx.NamedArgs{"accounts": []string{"acct_1"}, "mode": "test",
			"settle": time.Hour, "since": int64(0), "cursor": ""}}, []int{shards.Groups()}},
		{"find identified (every shard)", sqlFindIdentified, []any{[]string{"tly_x"}}, []int{shards.Groups()}},
	} {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.want, testdb.CitusTasks(t, pool, c.sql, c.args...))
		})
	}
}

// A provider's report naming items of tenants in two shard groups locks
// both, one group at a time, and finds each by its identifier; an
// identifier no item has is absent.
func TestLockIdentifiedAcrossGroupsOnCitus(t *testing.T) {
	t.Parallel()
	ctx, pool, store, shards := distributedStore(t)
	tenants := tenantsInGroups(t, shards, 2)
	want := map[string]int64{}
	for i, tenant := range tenants {
		it := NewItem{
			Identity: Identity{TenantKey: tenant, SubjectKind: SubjectUsageEvent, SubjectRef: fmt.Sprintf("event:calls:%d", i),
				Exporter: "stripe_meter_events", DestinationAccount: "acct_1", Mode: ModeTest, MappingVersion: 1},
			Payload: Payload{Customer: "cus_" + tenant, EventName: "calls", Value: 1, Timestamp: 1796000000, Feature: "calls",
				Period: "2026-11-01T00:00:00Z"},
		}
		etx, err := pool.Begin(ctx)
		require.NoError(t, err)
		res, err := store.Enqueue(ctx, etx, it)
		require.NoError(t, err)
		require.NoError(t, etx.Commit(ctx))
		var identifier string
		require.NoError(t, pool.QueryRow(ctx, `SELECT identifier FROM outbox_item_bodies WHERE id = $1`, res.ID).Scan(&identifier))
		want[identifier] = res.ID
	}
	var names []string
	for n := range want {
		names = append(names, n)
	}
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	got, err := store.LockIdentified(ctx, tx, append(names, "tly_unknown"))
	require.NoError(t, err)
	require.Equal(t, want, got)
	// Each item is locked: another transaction cannot lock it.
	for _, id := range want {
		other, err := pool.Begin(ctx)
		require.NoError(t, err)
		var bucket int16
		require.NoError(t, pool.QueryRow(ctx, `SELECT bucket FROM outbox_item_states WHERE id = $1`, id).Scan(&bucket))
		_, err = other.Exec(ctx, `SELECT id FROM outbox_item_states WHERE id = $1 AND bucket = $2 FOR NO KEY UPDATE NOWAIT`, id, bucket)
		require.Error(t, err, "item %d is locked", id)
		_ = other.Rollback(ctx)
	}
}
