package reconcile

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// The database's tally_period_end is package meter's PeriodEnd: the end of
// the monthly period containing a time, for calendar months and for
// anchors late in a month, at a time of day, on a leap day.
func TestPeriodEndIsMeterPeriodEnd(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	anchors := []time.Time{meter.CalendarAnchor, time.Date(2025, 1, 31, 9, 30, 15, 0, time.UTC),
		time.Date(2024, 2, 29, 0, 0, 0, 0, time.UTC), time.Date(2026, 3, 30, 23, 0, 0, 0, time.UTC)}
	var ts, as, want []time.Time
	for _, a := range anchors {
		for tm := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC); tm.Year() < 2028; tm = tm.Add(97*time.Hour + 17*time.Second) {
			ts, as, want = append(ts, tm), append(as, a), append(want, meter.PeriodEnd(tm, a))
		}
	}
	rows, err := pool.Query(ctx, `SELECT tally_period_end(t, a) FROM unnest($1::timestamptz[], $2::timestamptz[])
		WITH ORDINALITY AS u(t, a, n) ORDER BY n`, ts, as)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowTo[time.Time])
	require.NoError(t, err)
	require.Len(t, got, len(want))
	for i := range got {
		require.True(t, want[i].Equal(got[i]), "t %s, anchor %s: %s, want %s", ts[i], as[i], got[i].UTC(), want[i])
	}
}

// A key's hours: its settled items' (from --since on) and its open
// periods', joined; an open period that starts before --since starts at it.
func TestRunKeyHours(t *testing.T) {
	t.Parallel()
	const h = hour
	settled := runKey{SettledKey: outbox.SettledKey{Earliest: 3*h + 10, Latest: 5*h + 59}, settled: true}
	from, to := settled.hours(0)
	require.Equal(t, [2]int64{3 * h, 6 * h}, [2]int64{from, to})
	from, _ = settled.hours(4 * h)
	require.Equal(t, 4*h, from)

	both := settled
	both.open = mergeSpans([]span{{10 * h, 12 * h}, {1 * h, 4 * h}, {4 * h, 6 * h}})
	require.Equal(t, []span{{1 * h, 6 * h}, {10 * h, 12 * h}}, both.open, "sorted, touching spans joined")
	from, to = both.hours(0)
	require.Equal(t, [2]int64{1 * h, 12 * h}, [2]int64{from, to})
	require.True(t, both.inOpen(5*h))
	require.False(t, both.inOpen(6*h))
	require.False(t, both.inOpen(8*h))

	openOnly := runKey{open: []span{{7 * h, 9 * h}}}
	from, to = openOnly.hours(0)
	require.Equal(t, [2]int64{7 * h, 9 * h}, [2]int64{from, to})
	from, to = runKey{}.hours(0)
	require.GreaterOrEqual(t, from, to, "nothing to read")
}

// The statements that make reconciliation's reading of open periods and
// open discrepancies read what is open, not history: beside 20,000 closed
// key periods and 20,000 cleared discrepancies, the open keys' listing
// reads the open periods' rows, a key's clearing that key's current
// discrepancies, and the counts of open discrepancies the current ones,
// each by its index.
func TestOpenReadsReadWhatIsOpenNotHistory(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	_, err := pool.Exec(ctx, `
INSERT INTO reconcile_key_periods (mode, ordering_key, tenant_key, period_start, destination_account, customer, event_name)
SELECT 'test', 'acct_1|cus_' || i || '|api', 't' || i, clock_timestamp() - interval '40 days' - i * interval '1 hour',
       'acct_1', 'cus_' || i, 'api'
FROM generate_series(1, 20000) i;
INSERT INTO reconcile_key_periods (mode, ordering_key, tenant_key, period_start, destination_account, customer, event_name)
SELECT 'test', 'acct_1|cus_open' || i || '|api', 'o' || i, date_trunc('month', clock_timestamp() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC',
       'acct_1', 'cus_open' || i, 'api'
FROM generate_series(1, 20) i;
INSERT INTO reconcile_runs (status, trigger, requested_by, settle) SELECT 'succeeded', 'command', 'test', '0' FROM generate_series(1, 3);
INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name, meter, customer, hour, formula, expected,
    provider, expected_items, uncertain_items, explained_by, explanation, cleared_by_run)
SELECT 1, 'acct_1', 'test', 'api', 'mtr_1', 'cus_' || (i % 100), timestamptz '2026-01-01' + i * interval '1 hour', 'sum', 1, 2,
       '{}', '{}', '{}', 'unexplained', CASE WHEN i > 5 THEN 2 END
FROM generate_series(1, 20000) i;`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, "VACUUM ANALYZE reconcile_key_periods, reconcile_discrepancies")
	require.NoError(t, err)

	read := func(sql string, args pgx.NamedArgs, relation string) int64 {
		t.Helper()
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }() // EXPLAIN ANALYZE runs an UPDATE: undone
		var plan []map[string]any
		require.NoError(t, tx.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+sql, args).Scan(&plan))
		var n int64
		for _, node := range testdb.PlanNodes(plan[0]["Plan"]) {
			if node["Relation Name"] != relation {
				continue
			}
			for _, k := range []string{"Actual Rows", "Rows Removed by Filter", "Rows Removed by Index Recheck"} {
				if v, ok := node[k].(float64); ok {
					loops, _ := node["Actual Loops"].(float64)
					n += int64(v * max(loops, 1))
				}
			}
			if node["Node Type"] == "Seq Scan" {
				b, _ := json.Marshal(node)
				t.Errorf("%s is read whole: %s", relation, b)
			}
		}
		return n
	}

	n := read(sqlOpenKeys, pgx.NamedArgs{"accounts": []string{"acct_1"}, "mode": "test", "cursor": "", "grace": time.Hour},
		"reconcile_key_periods")
	require.LessOrEqual(t, n, int64(40), "the open periods' rows, not history's")
	n = read(sqlClearOlder, pgx.NamedArgs{"run": 3, "account": "acct_1", "mode": "test", "event": "api", "customer": "cus_3",
		"hours": []time.Time{time.Date(2026, 1, 1, 3, 0, 0, 0, time.UTC)}, "read": true}, "reconcile_discrepancies")
	require.LessOrEqual(t, n, int64(5), "the key's current discrepancies")
	n = read(`SELECT d.kind, count(*) FROM reconcile_discrepancies d WHERE `+isOpen+` GROUP BY 1`, pgx.NamedArgs{},
		"reconcile_discrepancies")
	require.LessOrEqual(t, n, int64(10), "the current discrepancies")
	n = read(sqlDiscrepanciesByPeriod, pgx.NamedArgs{"from": time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC),
		"to": time.Date(2026, 2, 1, 0, 0, 0, 0, time.UTC), "tenant": ""}, "reconcile_discrepancies")
	require.LessOrEqual(t, n, int64(10), "the current discrepancies")
}
