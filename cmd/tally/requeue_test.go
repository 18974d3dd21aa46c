package main

import (
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// Issue 16's acceptance through the CLI: 1,000 quarantined items requeued
// by one tally requeue, after a dry run that changed nothing; the one-item
// form still works as before; tally items list reads with the API's
// filters.
func TestRequeueMatchingCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("requeues a thousand items: a load test")
	}
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	env := stagetest.New(t, outbox.Config{})
	env.Target.Account = stripesim.DefaultAccount
	url := testdb.URLOf(t, env.Pool)
	stripe := []string{"--stripe-api-key", stripesim.DefaultKey, "--stripe-api-base", srv.URL}
	requeue := func(args ...string) (int, string, string) {
		return tally(t, url, append(append([]string{"requeue"}, args...), stripe...)...)
	}
	quarantineCounts(t, env, 1000)
	state := func() string {
		var s string
		require.NoError(t, env.Pool.QueryRow(env.Ctx, `SELECT (SELECT string_agg(state || ' ' || updated_at, ',' ORDER BY id) FROM outbox_items)
			|| (SELECT count(*) FROM audit_log)`).Scan(&s))
		return s
	}
	before := state()

	for _, args := range [][]string{
		{},                               // neither an item id nor filters
		{"1", "2"},                       // two ids
		{"7", "--reason", "no_customer"}, // an id and a filter
		{"--all", "--mapping-version", "3"},
		{"--all", "--format", "xml"},
		{"--all", "--limit", fmt.Sprint(quarantine.MaxBulkLimit + 1)},
		{"--period", "2026-13"},
	} {
		code, _, errs := requeue(args...)
		require.Equal(t, 2, code, "%v: %s", args, errs)
	}
	require.Equal(t, before, state())

	code, out, errs := requeue("--tenant", "acme", "--dry-run")
	require.Equal(t, 0, code, errs)
	require.Equal(t, "requeued 0, readdressed 0, refused 1000 (still_ineligible 1000) — dry run: nothing changed\n", out,
		"a dry run counts; its items only with --list")
	code, out, errs = requeue("--tenant", "acme", "--dry-run", "--list", "--limit", "3")
	require.Equal(t, 0, code, errs)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	require.Len(t, lines, 5, out) // the header, three items, the totals
	require.True(t, strings.HasPrefix(lines[0], "ITEM "), out)
	require.Contains(t, lines[1], "still_ineligible")
	require.Equal(t, "requeued 0, readdressed 0, refused 3 (still_ineligible 3) — dry run: nothing changed", lines[4])
	code, _, errs = requeue("--tenant", "acme")
	require.Equal(t, 1, code)
	require.Contains(t, errs, "1000 of 1000 items refused")
	require.Equal(t, before, state(), "refusals change nothing")

	env.Tenant(t, "acme", nil)
	before = state()
	code, out, errs = requeue("--reason", "no_customer", "--dry-run", "--format", "json")
	require.Equal(t, 0, code, errs)
	var dry quarantine.BulkResult
	require.NoError(t, json.Unmarshal([]byte(out), &dry), out)
	require.True(t, dry.DryRun)
	require.Equal(t, quarantine.BulkTotals{Readdressed: 1000, RefusedBy: map[string]int{}}, dry.Totals)
	require.Equal(t, before, state(), "the dry run changed nothing")

	code, out, errs = requeue("--reason", "no_customer", "--format", "json")
	require.Equal(t, 0, code, errs)
	var run quarantine.BulkResult
	require.NoError(t, json.Unmarshal([]byte(out), &run), out)
	require.Equal(t, dry.Totals, run.Totals)
	require.Contains(t, errs, fmt.Sprintf("more items may match: run again with --after %d", *run.NextAfter))
	var quarantined, pending, audited int
	require.NoError(t, env.Pool.QueryRow(env.Ctx, `SELECT count(*) FILTER (WHERE state = 'quarantined'), count(*) FILTER (WHERE state = 'pending'),
		(SELECT count(*) FROM audit_log WHERE action = 'readdress' AND actor LIKE 'cli:%') FROM outbox_items`).Scan(&quarantined, &pending, &audited))
	require.Equal(t, []int{0, 1000, 1000}, []int{quarantined, pending, audited})

	// The one-item form, as before: an item that is no longer quarantined.
	code, _, errs = requeue(fmt.Sprint(run.Items[0].ItemID), "--mapping-version", fmt.Sprint(run.Items[0].MappingVersion))
	require.Equal(t, 1, code)
	require.Contains(t, errs, "expected it quarantined, found it superseded")

	requireItemsList(t, url)
}

// quarantineCounts stages n count events of tenant acme, which has no
// customer: n items quarantined no_customer.
func quarantineCounts(t *testing.T, env *stagetest.Env, n int) {
	t.Helper()
	env.Feature(t, "logins", mappings.Count, time.Hour)
	events := make([]meter.Event, n)
	for i := range events {
		events[i] = stagetest.Ev(fmt.Sprintf("e%d", i), "acme", "logins", 1, stagetest.Ago(3*time.Hour))
	}
	env.MustIngest(t, events...)
	env.Pass(t)
}

// requireItemsList checks tally items list on the pending and superseded
// items of acme: pages, formats, and unknown filters refused.
func requireItemsList(t *testing.T, url string) {
	t.Helper()
	code, out, errs := tally(t, url, "items", "list", "--state", "pending", "--tenant", "acme", "--limit", "5", "--format", "json")
	require.Equal(t, 0, code, errs)
	var page struct {
		Items []struct {
			ID     int64  `json:"id"`
			State  string `json:"state"`
			Tenant string `json:"tenant"`
		} `json:"items"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &page), out)
	require.Len(t, page.Items, 5)
	require.Equal(t, "pending", page.Items[0].State)
	require.Contains(t, errs, fmt.Sprintf("--after %d", page.Items[4].ID))
	code, out, errs = tally(t, url, "items", "list", "--state", "superseded", "--limit", "2")
	require.Equal(t, 0, code, errs)
	require.Len(t, strings.Split(strings.TrimSpace(out), "\n"), 3, "a header and two items: %s", out)
	for _, args := range [][]string{{"--reason", "no_customer"}, {"--state", "lost"}, {"--limit", "0"}, {"--format", "csv"}} {
		code, _, errs = tally(t, url, append([]string{"items", "list"}, args...)...)
		require.Equal(t, 2, code, "%v: %s", args, errs)
	}
}
