package history_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/history"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

func TestSizeFromRefusesWhatIsNotEnoughRowsAndDefaultsToTheIssuesSizes(t *testing.T) {
	t.Parallel()
	for _, v := range []string{"x", "-4", "1.5e6", "3999"} {
		_, err := history.SizeFrom(func(string) string { return v })
		require.Error(t, err, v)
	}
	for v, want := range map[string]history.Size{
		"":       {Rows: 20_000_000, Items: 5_000_000},
		"200000": {Rows: 200_000, Items: 50_000},
		"4003":   {Rows: 4000, Items: 1000},
	} {
		got, err := history.SizeFrom(func(string) string { return v })
		require.NoError(t, err, v)
		require.Equal(t, want, got, v)
	}
}

func TestEndLeavesTheLastDayAndItsMonthWithoutHistory(t *testing.T) {
	t.Parallel()
	for now, want := range map[string]string{
		"2026-12-01T08:49:00Z": "2026-11-01T00:00:00Z", // the last day is November's
		"2026-12-02T08:49:00Z": "2026-11-30T08:00:00Z", // two days ago: still November
		"2026-12-20T08:49:00Z": "2026-12-01T00:00:00Z",
	} {
		n, err := time.Parse(time.RFC3339, now)
		require.NoError(t, err)
		require.Equal(t, want, history.End(n).Format(time.RFC3339), now)
	}
}

// The fixture is what staging and a reconcile run would have left: every
// item confirmed with one attempt, every ledger row carried by an item of
// its hour whose value is their sum, so that the completeness report of a
// historic month holds on every line.
func TestLoadedHistoryIsConfirmedAndHoldsInTheCompletenessReport(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.New(t)
	require.NoError(t, history.Map(ctx, pool))
	now := time.Date(2026, 12, 20, 9, 0, 0, 0, time.UTC)
	l, err := history.Load(ctx, pool, history.Size{Rows: 8000, Items: 2000}, now)
	require.NoError(t, err)
	require.Equal(t, time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC), l.To)
	require.Equal(t, l.To.Add(-2*time.Hour), l.From)

	store, err := outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)
	g, err := store.ReadGauge(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, int64(2000), g.Counts[outbox.StateConfirmed])
	require.Equal(t, int64(2000), g.Counts[outbox.StateConfirmed]+g.Counts[outbox.StatePending]) // nothing else
	var attempts int64
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM outbox_attempts WHERE outcome = 'accepted'").Scan(&attempts))
	require.Equal(t, int64(2000), attempts)

	c, err := quarantine.CompletenessOf(ctx, pool, "2026-11", "")
	require.NoError(t, err)
	require.True(t, c.Holds)
	require.Len(t, c.Lines, len(history.Tenants)*len(history.Features))
	var events int64
	for _, line := range c.Lines {
		require.Equal(t, line.Ingested, line.Confirmed, "%s/%s", line.Tenant, line.Feature)
		events += line.Confirmed.Events
	}
	require.Equal(t, int64(8000), events)
}
