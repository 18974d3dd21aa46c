package pgsession_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/pgsession"
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
		for _, s := range pgsession.Settings {
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
