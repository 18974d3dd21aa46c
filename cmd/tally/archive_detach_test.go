package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// A reconciled month leaves the ledger while a node runs: archived and
// verified with the month before it, a corrupted file fails verify and
// holds the detach back, a new generation verifies and the month is
// detached. Throughout, the current month's usage flows; afterwards the
// month's completeness report is unchanged and a re-post of one of its
// events, with its timestamp or without, is refused and stored nowhere.
func TestArchiveVerifyDetachOnARunningNode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := stagetest.New(t, outbox.Config{})
	e.Target.AcceptPast = 150 * 24 * time.Hour
	now := time.Now().UTC()
	month := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC).AddDate(0, -2, 0) // the month after it is over
	period, prev := month.Format("2006-01"), month.AddDate(0, -1, 0).Format("2006-01")
	at := func(h int) *time.Time { x := month.Add(time.Duration(h) * time.Hour); return &x }

	e.Feature(t, "calls", mappings.Sum, time.Hour)
	e.Tenant(t, "acme", nil)
	e.MustIngest(t, stagetest.Ev("old-1", "acme", "calls", 5, at(1)), stagetest.Ev("old-2", "acme", "calls", 7, at(1)),
		stagetest.Ev("old-3", "acme", "calls", 11, at(200)))
	e.Pass(t)
	var accepted []int64
	for {
		leases, err := e.Outbox.Claim(ctx, e.Pool, outbox.ClaimOptions{Owner: "test", Limit: 100})
		require.NoError(t, err)
		if len(leases) == 0 {
			break
		}
		for _, l := range leases {
			require.NoError(t, e.Outbox.Accept(ctx, e.Pool, l, "req_"+l.SubjectRef))
			accepted = append(accepted, l.ID)
		}
	}
	require.Len(t, accepted, 2)
	_, refused, err := e.Outbox.Confirm(ctx, e.Pool, accepted)
	require.NoError(t, err)
	require.Empty(t, refused)

	url := testdb.URLOf(t, e.Pool)
	token := func(role string) string {
		code, out, errs := tally(t, url, "tokens", "create", "--role", role, "--name", "archive-"+role)
		require.Equal(t, 0, code, errs)
		return strings.TrimSpace(out)
	}
	ingest, finance := token("ingest"), token("finance")
	n := &node{t: t, addr: freeAddr(t)}
	n.env = []string{"TALLY_DATABASE_URL=" + url, "TALLY_LISTEN=" + n.addr, "TALLY_LOG_LEVEL=error", "TALLY_REPORT_MAX_AGE=0s"}
	base, pool := n.serve(ctx, url)
	asOf := regexp.MustCompile(`"as_of":"[^"]*"`)
	report := func() string {
		code, body := post(t, http.MethodGet, base+"/v1/reports/completeness?period="+period, finance, nil)
		require.Equal(t, http.StatusOK, code, body)
		return asOf.ReplaceAllString(body, "")
	}
	before := report()
	require.Contains(t, before, `"holds":true`)

	// The current month's usage flows while the month leaves.
	var (
		stop  atomic.Bool
		wg    sync.WaitGroup
		flows atomic.Int64
	)
	wg.Go(func() {
		for i := 0; !stop.Load(); i++ {
			code, body := post(t, http.MethodPost, base+"/v1/usage", ingest, map[string]any{"events": []map[string]any{
				{"id": fmt.Sprintf("now-%d", i), "tenant": "acme", "feature": "calls", "value": 1}}})
			if code != http.StatusAccepted {
				t.Errorf("current usage refused while the month left: %d %s", code, body)
				return
			}
			flows.Add(1)
			time.Sleep(5 * time.Millisecond)
		}
	})

	dir := t.TempDir()
	env := []string{"TALLY_DATABASE_URL=" + url, "TALLY_ARCHIVE_URL=" + dir, "TALLY_INVOICE_GRACE=0s"}
	run := func(want int, args ...string) string {
		t.Helper()
		code, out, errs := tallyEnv(t, env, args...)
		require.Equal(t, want, code, "tally %s:\n%s%s", strings.Join(args, " "), out, errs)
		return out + errs
	}
	run(0, "archive", prev)
	run(0, "archive", "verify", prev)
	require.Contains(t, run(1, "archive", "detach", period), "no verified archive of "+period)
	run(0, "archive", period)

	// A corrupted file fails verify and holds the detach back.
	file := filepath.Join(dir, period, "g0001", "usage_events.parquet")
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	b[len(b)/2] ^= 0xff
	require.NoError(t, os.WriteFile(file, b, 0o600))
	require.Contains(t, run(1, "archive", "verify", period), "usage_events.parquet: sha256")
	require.Contains(t, run(1, "archive", "detach", period), "run tally archive verify "+period)

	run(0, "archive", period)
	run(0, "archive", "verify", period)
	out := run(0, "archive", "detach", period)
	require.Contains(t, out, fmt.Sprintf("detached and dropped usage_events_y%04dm%02d (3 events)", month.Year(), int(month.Month())))
	require.Contains(t, run(0, "archive", "detach", period), "had left already")

	stop.Store(true)
	wg.Wait()
	require.Positive(t, flows.Load())
	var now1 int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM usage_events WHERE tenant = 'acme' AND event_id LIKE 'now-%'`).Scan(&now1))
	require.Equal(t, flows.Load(), now1, "every current event accepted is stored once")

	require.Equal(t, before, report(), "the month's report is unchanged by its detach")

	// A re-post of the month's event is refused, with its timestamp or
	// without, and stored nowhere.
	for _, ev := range []map[string]any{
		{"id": "old-1", "tenant": "acme", "feature": "calls", "value": 5, "timestamp": at(1).Format(time.RFC3339)},
		{"id": "old-1", "tenant": "acme", "feature": "calls", "value": 5},
		{"id": "old-4", "tenant": "acme", "feature": "calls", "value": 5, "timestamp": at(2).Format(time.RFC3339)},
	} {
		code, body := post(t, http.MethodPost, base+"/v1/usage", ingest, map[string]any{"events": []map[string]any{ev}})
		require.Equal(t, http.StatusUnprocessableEntity, code, body)
		require.Contains(t, body, "period_closed")
	}
	var rows int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM usage_events WHERE event_id LIKE 'old-%'`).Scan(&rows))
	require.Zero(t, rows, "the month's rows left with it")
	var old1 int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM usage_event_keys WHERE tenant = 'acme' AND event_key = md5('old-1')::uuid`).Scan(&old1))
	require.EqualValues(t, 1, old1, "the event's key stays, once")
}
