package history_test

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/history"
	"github.com/tallymeter/tally/quarantine"
)

// TestCompletenessReadsNoHistoryOnceAnalysed runs the completeness report
// of the current month (100 items) beside 50,000 historic items, after
// ANALYZE has seen the month, as autovacuum would have, and reads the plan
// Postgres executed (auto_explain): the items' states and bodies must be
// read as the month's range of ids or by a probe per item, never by a scan
// of their tables. Joined without the range, they were hashed or merged
// whole once the statistics believed the month large (50,100 states read
// here for 100 items; 500,100 beside 2 million ledger rows, 0.6 s).
func TestCompletenessReadsNoHistoryOnceAnalysed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	now := time.Now().UTC()
	r := newRig(ctx, t, now)
	_, err := history.Load(ctx, r.pool, history.Size{Rows: 200_000, Items: 50_000}, now)
	require.NoError(t, err)
	r.prepare(ctx, t)
	_, err = r.pool.Exec(ctx, "ANALYZE")
	require.NoError(t, err)

	cfg := r.pool.Config()
	cfg.MaxConns = 1
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; SET auto_explain.log_analyze = on;
			SET auto_explain.log_format = json; SET client_min_messages = log`)
		return err
	}
	var (
		mu    sync.Mutex
		plans []string
	)
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		defer mu.Unlock()
		plans = append(plans, n.Message)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	c, err := quarantine.LedgerCompletenessOf(ctx, pool, r.fresh.Format("2006-01"), "")
	require.NoError(t, err)
	require.True(t, c.Holds, "%+v", c)
	items := freshTenants * len(history.Features)
	require.Len(t, c.Lines, items)

	mu.Lock()
	defer mu.Unlock()
	var report map[string]any
	for _, m := range plans {
		_, js, ok := strings.Cut(m, "plan:")
		if !ok || !strings.Contains(js, "grouped AS MATERIALIZED") {
			continue
		}
		require.NoError(t, json.Unmarshal([]byte(js), &report))
	}
	require.NotNil(t, report, "auto_explain gave no plan of the report: %d notices", len(plans))
	read := map[string]float64{}
	var walk func(n map[string]any)
	walk = func(n map[string]any) {
		if typ, _ := n["Node Type"].(string); strings.HasPrefix(typ, "Gather") {
			t.Errorf("a %s: the report starts parallel workers (pgsession turns them off)", typ)
		}
		if rel, _ := n["Relation Name"].(string); rel != "" {
			rows, _ := n["Actual Rows"].(float64)
			loops, _ := n["Actual Loops"].(float64)
			removed, _ := n["Rows Removed by Filter"].(float64)
			read[rel] += (rows + removed) * loops
		}
		children, _ := n["Plans"].([]any)
		for _, c := range children {
			walk(c.(map[string]any))
		}
	}
	walk(report["Plan"].(map[string]any))
	for _, rel := range []string{"outbox_item_states", "outbox_item_bodies"} {
		require.LessOrEqual(t, read[rel], float64(2*items), "%s: %v rows read for %d items: %v", rel, read[rel], items, read)
	}
}
