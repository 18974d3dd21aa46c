package quarantine

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

// One tenant's completeness report and quarantined items, and one bucket's
// quarantine report, are one task on a distributed database; every
// tenant's report reads every shard, by design.
func TestCountersCitusPlans(t *testing.T) {
	t.Parallel()
	pool := testdb.NewDistributed(t)
	shards, err := tenantbucket.ReadShards(context.Background(), pool)
	require.NoError(t, err)
	from, to := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC), time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		name string
		sql  string
		args pgx.NamedArgs
		want []int
	}{
		{"one tenant's counters", sqlTenantCounters, pgx.NamedArgs{"from": from, "to": to, "tenant": "acme",
			"bucket": tenantbucket.Of("acme")}, []int{1}},
		{"one tenant's quarantined items", sqlTenantItems, pgx.NamedArgs{"reason": "", "tenant": "acme", "feature": "",
			"period": "", "from": from, "to": to, "after": int64(0), "limit": 100, "bucket": tenantbucket.Of("acme")}, []int{1}},
		{"one bucket's quarantine report", sqlReport, pgx.NamedArgs{"reason": "", "tenant": "", "feature": "",
			"from": nil, "to": nil, "bucket": tenantbucket.Of("acme")}, []int{1}},
		{"every tenant's counters", sqlCounters, pgx.NamedArgs{"from": from, "to": to}, []int{shards.Groups()}},
	} {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.want, testdb.CitusTasks(t, pool, c.sql, c.args))
		})
	}
}

// counterSums is every counter line's sums (slots added) and how many slot
// rows hold it, by tenant, feature and period.
func counterSums(t *testing.T, pool *pgxpool.Pool) (sums map[string]string, rows map[string]int) {
	t.Helper()
	r, err := pool.Query(context.Background(), `SELECT tenant, feature, period, count(*), sum(ingested_events)::bigint,
		sum(ingested_value)::text, sum(pending_events)::bigint, sum(items)::bigint
		FROM completeness_counters GROUP BY 1, 2, 3`)
	require.NoError(t, err)
	sums, rows = map[string]string{}, map[string]int{}
	var (
		tenant, feature, iv string
		period              time.Time
		n                   int
		ie, pe, it          int64
	)
	_, err = pgx.ForEachRow(r, []any{&tenant, &feature, &period, &n, &ie, &iv, &pe, &it}, func() error {
		k := tenant + " " + feature + " " + period.UTC().Format("2006-01-02")
		sums[k], rows[k] = fmt.Sprintf("%d %s %d %d", ie, iv, pe, it), n
		return nil
	})
	require.NoError(t, err)
	return sums, rows
}

// The fold runs once per shard group on a distributed database (once on
// one server): every past month's line ends in one row, its sums
// unchanged, and the current month's slots stay.
func TestFoldCountersPerGroup(t *testing.T) {
	t.Parallel()
	for _, e := range []struct {
		name string
		db   func(testing.TB) *pgxpool.Pool
	}{{"one server", testdb.New}, {"distributed", testdb.NewDistributed}} {
		t.Run(e.name, func(t *testing.T) {
			t.Parallel()
			if e.name == "one server" && testdb.OnCitus() {
				t.Skip("testdb.New is distributed")
			}
			ctx, pool := context.Background(), e.db(t)
			shards, err := tenantbucket.ReadShards(ctx, pool)
			require.NoError(t, err)
			require.Equal(t, e.name == "distributed", shards.Distributed())
			// Tenants in different groups (on one server, any).
			var tenants []string
			seen := map[int]bool{}
			for i := 0; len(tenants) < 3; i++ {
				tenant := fmt.Sprintf("ten%d", i)
				if g := shards.GroupOf(tenantbucket.Of(tenant)); !seen[g] || !shards.Distributed() {
					seen[g] = true
					tenants = append(tenants, tenant)
				}
			}
			now := time.Now().UTC()
			current := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC)
			past := current.AddDate(0, -2, 0)
			for i, tenant := range tenants {
				for _, slot := range []int{0, 3, 7, 11} {
					for _, period := range []time.Time{past, current} {
						_, err := pool.Exec(ctx, `INSERT INTO completeness_counters (period, tenant, feature, account, slot, bucket,
							ingested_events, ingested_value, pending_events, items) VALUES ($1, $2, 'calls', '', $3, $4, $5, $6, $7, 1)`,
							period, tenant, slot, tenantbucket.Of(tenant), i+slot, (i+1)*(slot+2), slot)
						require.NoError(t, err)
					}
				}
			}
			before, rows := counterSums(t, pool)
			folded, err := FoldCounters(ctx, pool)
			require.NoError(t, err)
			require.Equal(t, int64(3*len(tenants)), folded, "every past slot row but slot 0")
			after, rowsAfter := counterSums(t, pool)
			require.Equal(t, before, after, "sums unchanged")
			for k, n := range rows {
				want := n
				if k[len(k)-10:] == past.Format("2006-01-02") {
					want = 1
				}
				require.Equal(t, want, rowsAfter[k], k)
			}
			// One tenant's report reads its own counters.
			c, err := CompletenessOf(ctx, pool, past.Format("2006-01"), tenants[1])
			require.NoError(t, err)
			require.Len(t, c.Lines, 1)
			require.Equal(t, tenants[1], c.Lines[0].Tenant)
		})
	}
}
