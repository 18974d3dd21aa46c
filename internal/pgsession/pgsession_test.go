package pgsession_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/pgsession"
	"github.com/tallymeter/tally/internal/testkit/pgbouncer"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// TestSettingsHoldWithoutStartupParameters: a session that sends none of
// the settings starts with them, from the database's defaults; a URL that
// names one still wins.
func TestSettingsHoldWithoutStartupParameters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.URL(t)
	for _, tc := range []struct {
		query string
		want  map[string]string
	}{
		{"", map[string]string{"jit": "off", "max_parallel_workers_per_gather": "0"}},
		{"?jit=on", map[string]string{"jit": "on", "max_parallel_workers_per_gather": "0"}}, // the operator's word wins
	} {
		cfg, err := pgx.ParseConfig(url + strings.Replace(tc.query, "?", "&", 1))
		require.NoError(t, err)
		for _, s := range pgsession.Settings() {
			if tc.query == "" {
				require.NotContains(t, cfg.RuntimeParams, s.Name, "no startup parameter: a pooler refuses it")
			}
		}
		conn, err := pgx.ConnectConfig(ctx, cfg)
		require.NoError(t, err)
		for name, want := range tc.want {
			var got string
			require.NoError(t, conn.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&got))
			require.Equal(t, want, got, "%s with %q", name, tc.query)
		}
		require.NoError(t, conn.Close(ctx))
	}
}

// TestSettingsHoldThroughPgBouncer: behind PgBouncer in transaction mode,
// which refuses a startup parameter it does not know, every session still
// runs with the settings, whichever server connection it lands on.
func TestSettingsHoldThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.URL(t)
	pooled := pgbouncer.Start(t, url).URL(url)
	// What every connection sent before: the pooler refuses it.
	_, err := pgx.Connect(ctx, pooled+"&jit=off")
	require.ErrorContains(t, err, "unsupported startup parameter: jit")

	cfg, err := pgxpool.ParseConfig(pooled)
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				for _, s := range pgsession.Settings() {
					var got string
					if err := pool.QueryRow(ctx, "SELECT current_setting($1)", s.Name).Scan(&got); err != nil {
						t.Error(err)
						return
					}
					if got != s.Value {
						t.Errorf("%s = %s through the pooler, want %s", s.Name, got, s.Value)
					}
				}
			}
		}()
	}
	wg.Wait()
}
