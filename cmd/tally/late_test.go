package main

import (
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// tally requeue refuses late usage (period_closed) under the node's default
// policy, in both forms, unless --accept-period-closed says the operator
// sends it knowingly.
func TestRequeueLateUsageOnlyKnowingly(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	env := stagetest.New(t, outbox.Config{})
	env.Target.Account, env.Target.LateUsage, env.Target.InvoiceGrace = stripesim.DefaultAccount, meter.LateQuarantine, time.Hour
	url := testdb.URLOf(t, env.Pool)
	requeue := func(args ...string) (int, string, string) {
		return tally(t, url, append(append([]string{"requeue"}, args...),
			"--stripe-api-key", stripesim.DefaultKey, "--stripe-api-base", srv.URL, "--invoice-grace", "1h")...)
	}
	f := env.Feature(t, "calls", mappings.Count, time.Hour)
	anchor := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour).Add(30 * time.Minute)
	tn := env.Tenant(t, "acme", &anchor)
	closed := anchor.Add(-20 * time.Minute)
	env.MustIngest(t, stagetest.Ev("l1", "acme", "calls", 1, &closed), stagetest.Ev("l2", "acme", "calls", 1, &closed))
	var ids []int64
	rows, err := env.Pool.Query(env.Ctx, `SELECT id FROM outbox_items WHERE quarantine_reason = 'period_closed' ORDER BY id`)
	require.NoError(t, err)
	for rows.Next() {
		var id int64
		require.NoError(t, rows.Scan(&id))
		ids = append(ids, id)
	}
	require.NoError(t, rows.Err())
	require.Len(t, ids, 2)
	state := func(id int64) outbox.State {
		it, err := env.Outbox.Get(env.Ctx, env.Pool, id)
		require.NoError(t, err)
		return it.State
	}
	version := fmt.Sprint(max(f.Version, tn.Version))

	code, _, errs := requeue(fmt.Sprint(ids[0]), "--mapping-version", version)
	require.NotEqual(t, 0, code)
	require.Contains(t, errs, "invoice has closed")
	require.Equal(t, outbox.StateQuarantined, state(ids[0]))
	code, _, errs = requeue(fmt.Sprint(ids[0]), "--mapping-version", version, "--accept-period-closed")
	require.Equal(t, 0, code, errs)
	require.Equal(t, outbox.StatePending, state(ids[0]))

	code, _, errs = requeue("--reason", "period_closed")
	require.Equal(t, 1, code)
	require.Contains(t, errs, "1 of 1 items refused")
	code, out, errs := requeue("--reason", "period_closed", "--accept-period-closed")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, "requeued 1")
	require.Equal(t, outbox.StatePending, state(ids[1]))
}
