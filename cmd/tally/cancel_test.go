package main

import (
	"context"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// tally cancel cancels earlier events as POST /v1/usage/cancellations
// does: staged, never sent, they are withdrawn; asked again, the first
// outcome answers; an unknown event, or no tenant, stores nothing.
func TestCancelCommand(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_acme")
	url := testdb.URL(t)
	env := []string{"TALLY_DATABASE_URL=" + url, "STRIPE_API_KEY=" + stripesim.DefaultKey, "STRIPE_API_BASE=" + srv.URL}
	run := func(args ...string) (int, string, string) {
		t.Helper()
		return tallyEnv(t, env, args...)
	}
	code, _, errs := run("mappings", "features", "set", "logins", "--event-name", "logins", "--aggregation", "count")
	require.Equal(t, 0, code, errs)
	code, _, errs = run("mappings", "tenants", "set", "acme", "--customer", "cus_acme")
	require.Equal(t, 0, code, errs)
	ts := time.Now().UTC().Add(-2 * time.Hour).Format(time.RFC3339)
	file := importWriteFile(t, t.TempDir(), "usage.csv", fmt.Sprintf("id,tenant,feature,value,timestamp\ne1,acme,logins,1,%s\ne2,acme,logins,1,%s\n", ts, ts))
	code, _, errs = run("import", file)
	require.Equal(t, 0, code, errs)

	code, out, errs := run("cancel", "--tenant", "acme", "e1")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, `"outcome": "withdrawn"`)
	require.Contains(t, out, `"duplicate": false`)
	code, out, errs = run("cancel", "--tenant", "acme", "e1")
	require.Equal(t, 0, code, errs)
	require.Contains(t, out, `"duplicate": true`)

	code, _, errs = run("cancel", "--tenant", "acme", "e2", "nope")
	require.Equal(t, 1, code)
	require.Contains(t, errs, "no event with this id")
	code, _, _ = run("cancel", "e2")
	require.Equal(t, 2, code, "--tenant is required")
	code, _, _ = run("cancel", "--tenant", "acme")
	require.Equal(t, 2, code, "ids are required")

	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	defer pool.Close()
	var state string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT o.state FROM outbox_items o JOIN usage_events u ON u.item_id = o.id
		WHERE u.event_id = 'e2'`).Scan(&state))
	require.Equal(t, "pending", state, "the refused request cancelled nothing")
}
