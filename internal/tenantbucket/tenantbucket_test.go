package tenantbucket_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

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
