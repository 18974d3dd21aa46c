package tenantbucket_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// TestOfIsTheDatabases checks Of against tally_bucket, the function every
// table's CHECK compares the written bucket with, over ASCII, non-ASCII
// and edge-case tenants.
func TestOfIsTheDatabases(t *testing.T) {
	t.Parallel()
	pool := testdb.New(t)
	tenants := []string{"", "acme", "globex", "t1", "ten1", "Ünïcødé", "租户", "🧾 invoices", "a\tb", "x'y\"z\\", strings.Repeat("long-", 64)}
	for i := range 3000 {
		tenants = append(tenants, fmt.Sprintf("tenant-%d", i), fmt.Sprintf("租户-%d-é", i))
	}
	var want []int16
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT array_agg(tally_bucket(t) ORDER BY i) FROM unnest($1::text[]) WITH ORDINALITY u (t, i)`, tenants).Scan(&want))
	require.Len(t, want, len(tenants))
	seen := map[int16]bool{}
	for i, tenant := range tenants {
		got := tenantbucket.Of(tenant)
		require.Equal(t, want[i], got, "tenant %q", tenant)
		require.True(t, got >= 0 && got < tenantbucket.Count)
		seen[got] = true
	}
	require.Greater(t, len(seen), tenantbucket.Count*9/10, "the buckets spread over the range")
	require.Equal(t, []int16{555, 961, 651}, []int16{tenantbucket.Of("acme"), tenantbucket.Of("globex"), tenantbucket.Of("t1")})
}

func TestAll(t *testing.T) {
	t.Parallel()
	all := tenantbucket.All()
	require.Len(t, all, tenantbucket.Count)
	for i, b := range all {
		require.Equal(t, int16(i), b)
	}
}

// On PostgreSQL, and on a Citus coordinator with nothing distributed, the
// buckets are one server's: one group, naming no list.
func TestReadShardsOnOneServer(t *testing.T) {
	t.Parallel()
	for name, pool := range map[string]func(testing.TB) *pgxpool.Pool{"postgres": testdb.New, "citus, undistributed": testdb.NewCitus} {
		t.Run(name, func(t *testing.T) {
			if name == "postgres" && testdb.OnCitus() {
				t.Skip("testdb.New is distributed")
			}
			s, err := tenantbucket.ReadShards(context.Background(), pool(t))
			require.NoError(t, err)
			require.False(t, s.Distributed())
			require.Equal(t, 1, s.Groups())
			require.Nil(t, s.Buckets(0))
			require.Equal(t, 0, s.GroupOf(555))
			require.Equal(t, [][]int{{3, 1, 2}}, tenantbucket.Split(s, []int{3, 1, 2}, func(int) int16 { return 0 }))
		})
	}
}

// On a distributed database every bucket is in exactly one group, a
// group's buckets are one shard's (a statement naming them plans as one
// task), and Split keeps each group's items in order.
func TestReadShardsDistributed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewDistributed(t)
	s, err := tenantbucket.ReadShards(ctx, pool)
	require.NoError(t, err)
	require.True(t, s.Distributed())
	require.Equal(t, 32, s.Groups())
	seen := map[int16]int{}
	for g := range s.Groups() {
		for _, b := range s.Buckets(g) {
			seen[b]++
			require.Equal(t, g, s.GroupOf(b))
		}
	}
	require.Len(t, seen, tenantbucket.Count)
	for _, g := range []int{0, 31} {
		require.Equal(t, []int{1}, testdb.CitusTasks(t, pool,
			`SELECT count(*) FROM outbox_item_states WHERE bucket = ANY($1::smallint[])`, s.Buckets(g)))
	}
	b0, b1 := s.Buckets(0)[0], s.Buckets(1)[0]
	items := []int16{b1, b0, b1, b0}
	runs := tenantbucket.Split(s, items, func(b int16) int16 { return b })
	require.Equal(t, [][]int16{{b1, b1}, {b0, b0}}, runs)
	require.Contains(t, s.String(), "32 shard groups of")
}

// A Placement reads the placement once, keeps it, and reads it again after
// Forget.
func TestPlacementKeepsWhatItRead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.New(t)
	var p tenantbucket.Placement
	require.Nil(t, p.Last())
	first, err := p.Get(ctx, pool)
	require.NoError(t, err)
	require.Same(t, first, p.Last())
	again, err := p.Get(ctx, pool)
	require.NoError(t, err)
	require.Same(t, first, again, "kept, not read again")
	p.Forget()
	require.Nil(t, p.Last())
	fresh, err := p.Get(ctx, pool)
	require.NoError(t, err)
	require.NotSame(t, first, fresh)
	require.Equal(t, first.Distributed(), fresh.Distributed())
}
