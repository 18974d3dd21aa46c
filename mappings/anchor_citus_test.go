package mappings

import (
	"context"
	"fmt"
	"math/big"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// unstagedCounted is a tenant's unstaged and cancelled-before-staging
// usage as the counters hold it, per period and feature ("period feature":
// "unstaged events/value cancelled events/value"), zero lines left out.
func unstagedCounted(t *testing.T, pool *pgxpool.Pool, tenant string) map[string]string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
		SELECT period, feature, sum(unstaged_events)::bigint, sum(unstaged_value)::text, sum(cancelled_events)::bigint, sum(cancelled_value)::text
		FROM completeness_counters WHERE bucket = $2 AND tenant = $1 GROUP BY 1, 2`, tenant, tenantbucket.Of(tenant))
	require.NoError(t, err)
	return periodLines(t, rows)
}

// unstagedInLedger is the same, computed from the ledger with anchor (nil:
// calendar months): what the counters must hold.
func unstagedInLedger(t *testing.T, pool *pgxpool.Pool, tenant string, anchor *time.Time) map[string]string {
	t.Helper()
	a := time.Unix(0, 0).UTC()
	if anchor != nil {
		a = *anchor
	}
	rows, err := pool.Query(context.Background(), `
		SELECT tally_period_start(occurred_at, $3), feature,
		       count(*) FILTER (WHERE cancelled_at IS NULL), coalesce(sum(value) FILTER (WHERE cancelled_at IS NULL), 0)::text,
		       count(*) FILTER (WHERE cancelled_at IS NOT NULL), coalesce(sum(value) FILTER (WHERE cancelled_at IS NOT NULL), 0)::text
		FROM usage_events WHERE bucket = $2 AND tenant = $1 AND item_id IS NULL GROUP BY 1, 2`, tenant, tenantbucket.Of(tenant), a)
	require.NoError(t, err)
	return periodLines(t, rows)
}

// periodLines reads rows of (period, feature, unstaged events, unstaged
// value, cancelled events, cancelled value) into unstagedCounted's lines,
// leaving out lines of zeros.
func periodLines(t *testing.T, rows pgx.Rows) map[string]string {
	t.Helper()
	out := map[string]string{}
	var (
		period  time.Time
		feature string
		ue, ce  int64
		uv, cv  string
	)
	_, err := pgx.ForEachRow(rows, []any{&period, &feature, &ue, &uv, &ce, &cv}, func() error {
		if ue != 0 || ce != 0 || uv != "0" || cv != "0" {
			out[period.UTC().Format(time.RFC3339)+" "+feature] = fmt.Sprintf("%d/%s %d/%s", ue, uv, ce, cv)
		}
		return nil
	})
	require.NoError(t, err)
	return out
}

// Setting, changing and removing a tenant's period anchor moves its
// unstaged usage's counters to the periods the anchor gives it: on one
// server the mapping's trigger does it, on a distributed database (no
// trigger) the mapping writer; both end where the ledger says, and equal
// to each other.
func TestAnchorMovesUnstagedCounters(t *testing.T) {
	t.Parallel()
	engines := []struct {
		name string
		db   func(testing.TB) *pgxpool.Pool
	}{
		{"one server", testdb.New},
		{"distributed", testdb.NewDistributed},
	}
	results := make([][]map[string]string, len(engines))
	for i, e := range engines {
		t.Run(e.name, func(t *testing.T) {
			if e.name == "one server" && testdb.OnCitus() {
				t.Skip("testdb.New is distributed")
			}
			ctx, pool, s := context.Background(), e.db(t), &Store{}
			var trigger bool
			require.NoError(t, pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_trigger
				WHERE tgrelid = 'tenant_mappings'::regclass AND tgname = 'tenant_mappings_completeness')`).Scan(&trigger))
			require.Equal(t, e.name == "one server", trigger)

			// Unstaged usage of two tenants, over the days around a month's
			// start; one event withdrawn before staging.
			base := time.Now().UTC().AddDate(0, 0, -20).Truncate(time.Hour)
			for _, tenant := range []string{"acme", "other"} {
				for i := range 40 {
					_, err := pool.Exec(ctx, `INSERT INTO usage_events (tenant, bucket, event_id, feature, value, occurred_at, timestamp_given)
						VALUES ($1, $2, $3, $4, $5, $6, true)`, tenant, tenantbucket.Of(tenant), fmt.Sprintf("e%d", i),
						[]string{"calls", "seats"}[i%2], i+1, base.Add(time.Duration(i)*11*time.Hour))
					require.NoError(t, err)
				}
			}
			_, err := pool.Exec(ctx, `UPDATE usage_events SET cancelled_at = now() WHERE bucket = $1 AND tenant = 'acme' AND event_id = 'e7'`,
				tenantbucket.Of("acme"))
			require.NoError(t, err)
			other := unstagedCounted(t, pool, "other")
			require.Equal(t, unstagedInLedger(t, pool, "acme", nil), unstagedCounted(t, pool, "acme"))

			a1 := base.Add(5*24*time.Hour + 30*time.Minute)
			a2 := base.Add(12*24*time.Hour + 7*time.Hour)
			var got []map[string]string
			for _, anchor := range []*time.Time{&a1, &a2, nil, &a2} {
				_, changed, err := s.PutTenant(ctx, pool, "acme", TenantInput{StripeCustomerID: "cus_acme", PeriodAnchor: anchor}, "test")
				require.NoError(t, err)
				require.True(t, changed)
				counted := unstagedCounted(t, pool, "acme")
				require.Equal(t, unstagedInLedger(t, pool, "acme", anchor), counted, "anchor %v", anchor)
				got = append(got, counted)
			}
			// The same mapping again changes nothing; the other tenant's
			// counters never moved.
			_, changed, err := s.PutTenant(ctx, pool, "acme", TenantInput{StripeCustomerID: "cus_acme", PeriodAnchor: &a2}, "test")
			require.NoError(t, err)
			require.False(t, changed)
			require.Equal(t, got[len(got)-1], unstagedCounted(t, pool, "acme"))
			require.Equal(t, other, unstagedCounted(t, pool, "other"))
			results[i] = got
		})
	}
	if results[0] != nil && results[1] != nil {
		require.Equal(t, results[0], results[1], "one server's counters and the distributed database's")
	}
}

// The anchor's read and each counter row it moves are one task on a
// distributed database: the tenant's bucket names its shard.
func TestAnchorStatementsCitusPlans(t *testing.T) {
	t.Parallel()
	pool := testdb.NewDistributed(t)
	a := time.Date(2026, 11, 5, 0, 30, 0, 0, time.UTC)
	b := tenantbucket.Of("acme")
	for name, c := range map[string]struct {
		sql  string
		args pgx.NamedArgs
	}{
		"moves": {sqlAnchorMoves, pgx.NamedArgs{"tenant": "acme", "bucket": b, "was": calendarAnchor, "anchor": a}},
		"bump": {sqlAnchorBump, pgx.NamedArgs{"period": a, "tenant": "acme", "feature": "calls", "bucket": b,
			"ie": int64(1), "iv": pgtype.Numeric{Int: big.NewInt(5), Valid: true}, "ue": int64(1),
			"uv": pgtype.Numeric{Int: big.NewInt(5), Valid: true}, "xe": int64(0), "xv": pgtype.Numeric{Int: big.NewInt(0), Valid: true}}},
	} {
		t.Run(name, func(t *testing.T) {
			require.Equal(t, []int{1}, testdb.CitusTasks(t, pool, c.sql, c.args))
		})
	}
}
