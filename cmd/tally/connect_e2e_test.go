package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/quarantine"
)

// TestConnectEndToEnd is issue 19's platform run: four tenants, three in
// connected accounts of their own and one in the platform's, through `tally
// serve` and both exporters. Midway the platform's access to one connected
// account is revoked: only that account's items wait (pending, without
// attempts piling up), the node stays ready, tally_export_stalled_accounts
// and tally_export_stalled{reason="account_refused"} say so; every other
// account's usage exports meanwhile. Access restored, everything drains;
// Stripe's aggregate equals the ledger per (account, customer, meter) — each
// account's meters and customers, which the others do not have — and a
// reconcile run confirms every item, reading each account's summaries.
func TestConnectEndToEnd(t *testing.T) {
	t.Parallel()
	for _, exp := range []string{"stripe_meter_events", "stripe_meter_event_stream"} {
		t.Run(exp, func(t *testing.T) {
			t.Parallel()
			runConnect(t, exp)
		})
	}
}

// connectTenants are the run's tenants and their accounts ("" for the
// platform's own); each tenant's customer exists only in its account.
var connectTenants = []struct{ tenant, account string }{
	{"plat", ""}, {"conn1", "acct_1ConnectOne"}, {"conn2", "acct_1ConnectTwo"}, {"conn3", "acct_1ConnectThree"},
}

// connectRevoked is the account whose access is revoked midway.
const connectRevoked = "acct_1ConnectTwo"

func runConnect(t *testing.T, exporter string) {
	ctx := context.Background()
	sim := stripesim.New(stripesim.Options{Seed: 19})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	features := []struct{ name, formula string }{{"api_calls", "sum"}, {"logins", "count"}}
	for _, ct := range connectTenants {
		account := ct.account
		if account == "" {
			account = stripesim.DefaultAccount
		} else {
			sim.AddAccount(account)
		}
		for _, f := range features {
			sim.CreateMeter(account, stripesim.MeterSpec{DisplayName: f.name, EventName: f.name, Formula: f.formula})
		}
		sim.CreateCustomer(account, "cus_"+ct.tenant)
	}

	url := testdb.URL(t)
	n := &node{t: t, addr: freeAddr(t)}
	n.env = []string{
		"TALLY_DATABASE_URL=" + url, "TALLY_LISTEN=" + n.addr, "TALLY_ADMIN_TOKEN=" + exportAdmin,
		"STRIPE_API_KEY=" + stripesim.DefaultKey, "STRIPE_API_BASE=" + srv.URL, "STRIPE_METER_EVENTS_BASE=" + srv.URL,
		"TALLY_EXPORTER=" + exporter, "TALLY_STAGE_INTERVAL=200ms", "TALLY_WINDOW_GRACE=1s", "TALLY_MAINTENANCE_INTERVAL=1s",
		"TALLY_OUTBOX_BACKOFF_BASE=50ms", "TALLY_OUTBOX_BACKOFF_CAP=500ms", "TALLY_STRIPE_TIMEOUT=1s", "TALLY_POLL_INTERVAL=100ms",
		"TALLY_RATE_TEST=1000", "TALLY_STREAM_RATE_TEST=100000", "TALLY_BASIC_RATE_TEST=3000", "TALLY_SHUTDOWN_TIMEOUT=5s",
		"TALLY_LOG_LEVEL=warn",
	}
	base, pool := n.serve(ctx, url)

	for _, f := range features {
		code, body := post(t, http.MethodPut, base+"/v1/mappings/features/"+f.name, exportAdmin, map[string]string{"event_name": f.name, "aggregation": f.formula})
		require.Equal(t, http.StatusOK, code, body)
	}
	for _, ct := range connectTenants {
		in := map[string]string{"stripe_customer_id": "cus_" + ct.tenant}
		if ct.account != "" {
			in["stripe_account"] = ct.account
		}
		code, body := post(t, http.MethodPut, base+"/v1/mappings/tenants/"+ct.tenant, exportAdmin, in)
		require.Equal(t, http.StatusOK, code, body)
	}

	now := time.Now().UTC().Truncate(time.Second)
	batch := func(from, count int) {
		t.Helper()
		var evs []e2eEvent
		for i := from; i < from+count; i++ {
			ct := connectTenants[i%len(connectTenants)]
			f := features[(i/len(connectTenants))%len(features)].name
			v := int64(1)
			if f == "api_calls" {
				v = int64(i%37) - 3
			}
			evs = append(evs, e2eEvent{ID: fmt.Sprintf("c%05d", i), Tenant: ct.tenant, Feature: f, Value: v,
				Timestamp: now.Add(-2*time.Hour - time.Duration(i)*time.Second).Format(time.RFC3339)})
		}
		code, body := post(t, http.MethodPost, base+"/v1/usage", exportAdmin, map[string]any{"events": evs})
		require.Equal(t, http.StatusAccepted, code, body)
	}
	// open counts the items not yet accepted, by destination account, and
	// the events not staged yet.
	open := func() (map[string]int, int) {
		rows, err := pool.Query(ctx, `SELECT destination_account, count(*)::int FROM outbox_items
			WHERE state NOT IN ('accepted', 'confirmed') GROUP BY 1`)
		require.NoError(t, err)
		out := map[string]int{}
		var (
			a string
			c int
		)
		_, err = pgx.ForEachRow(rows, []any{&a, &c}, func() error { out[a] = c; return nil })
		require.NoError(t, err)
		var unstaged int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM usage_events WHERE item_id IS NULL`).Scan(&unstaged))
		return out, unstaged
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(90 * time.Second); !cond(); time.Sleep(100 * time.Millisecond) {
			if time.Now().After(deadline) {
				o, u := open()
				t.Fatalf("%s never happened: open %v, unstaged %d\n%s\n--- tally serve output ---\n%s", what, o, u, outboxSummary(ctx, pool), tail(n.out.String(), 4000))
			}
		}
	}

	// Everything exports, each tenant's usage to its own account.
	batch(0, 400)
	waitFor("the first batch's export", func() bool { o, u := open(); return len(o) == 0 && u == 0 })

	// Access to one account revoked: its items wait, the others export.
	sim.RevokeAccess(connectRevoked)
	batch(400, 400)
	waitFor("the stall of the revoked account alone", func() bool {
		o, u := open()
		return u == 0 && len(o) == 1 && o[connectRevoked] > 0 && connectGauge(t, base, "tally_export_stalled_accounts", "") == 1
	})
	require.Equal(t, 1.0, connectGauge(t, base, "tally_export_stalled", "account_refused"))
	require.Equal(t, 0.0, connectGauge(t, base, "tally_export_stalled", "key_refused"), "the key is not refused")
	resp, err := http.Get(base + "/readyz")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "one connected account does not make the node unready")
	// Claims skip the stalled account: its items are not attempted again
	// and again while it is refused.
	time.Sleep(time.Second)
	var attempts, quarantined int
	require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(max(attempts), 0) FROM outbox_items WHERE destination_account = $1 AND state = 'pending'`,
		connectRevoked).Scan(&attempts))
	require.LessOrEqual(t, attempts, 2, "a stalled account's items wait without attempts")
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_items WHERE state = 'quarantined'`).Scan(&quarantined))
	require.Zero(t, quarantined, "a revoked account quarantines nothing")
	// A reconcile run meanwhile confirms the other accounts' items and
	// skips the revoked account's keys: it neither fails nor confirms them.
	r := &exportRun{t: t, ctx: ctx, base: base}
	run := r.reconcileThroughAPI()
	require.Equal(t, "succeeded", run.Status, "%+v", run)
	require.Zero(t, run.Discrepancies, "%+v", run)
	require.Positive(t, run.ItemsConfirmed)
	var waiting, otherAccepted int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE destination_account = $1),
			count(*) FILTER (WHERE destination_account <> $1) FROM outbox_items WHERE state = 'accepted'`,
		connectRevoked).Scan(&waiting, &otherAccepted))
	require.Positive(t, waiting, "the revoked account's accepted items are not confirmed while it is refused")
	require.Zero(t, otherAccepted, "every other account's items are confirmed")

	// Restored, everything drains.
	sim.RestoreAccess(connectRevoked)
	waitFor("the drain after the restore", func() bool {
		o, u := open()
		return len(o) == 0 && u == 0 && connectGauge(t, base, "tally_export_stalled_accounts", "") == 0
	})

	// Stripe's aggregate equals the ledger per (account, customer, meter).
	rows, err := pool.Query(ctx, `SELECT tenant, feature, sum(value), count(*)::int FROM usage_events GROUP BY 1, 2`)
	require.NoError(t, err)
	var (
		tenant, feature string
		sum             int64
		count, checked  int
	)
	accountOf := map[string]string{}
	for _, ct := range connectTenants {
		accountOf[ct.tenant] = ct.account
		if ct.account == "" {
			accountOf[ct.tenant] = stripesim.DefaultAccount
		}
	}
	_, err = pgx.ForEachRow(rows, []any{&tenant, &feature, &sum, &count}, func() error {
		ssum, scount, _ := sim.Aggregate(accountOf[tenant], feature, "cus_"+tenant)
		if feature == "logins" {
			require.Equal(t, count, scount, "%s %s", tenant, feature)
		} else {
			require.Equal(t, sum, ssum, "%s %s", tenant, feature)
		}
		for _, other := range connectTenants {
			if a := accountOf[other.tenant]; a != accountOf[tenant] {
				s, c, _ := sim.Aggregate(a, feature, "cus_"+tenant)
				require.Zero(t, s+int64(c), "%s's usage reached %s", tenant, a)
			}
		}
		checked++
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, len(connectTenants)*len(features), checked)
	require.Empty(t, sim.RecordedTwice(), "no identifier recorded twice")

	// A reconcile run confirms every item, each against its account.
	var accepted int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_items WHERE state = 'accepted'`).Scan(&accepted))
	run = r.reconcileThroughAPI()
	require.Equal(t, "succeeded", run.Status, "%+v", run)
	require.Zero(t, run.Discrepancies, "%+v", run)
	require.Equal(t, accepted, run.ItemsConfirmed)
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_items WHERE state <> 'confirmed'`).Scan(&waiting))
	require.Zero(t, waiting, "every item of every account is confirmed")
	rows, err = pool.Query(ctx, `SELECT DISTINCT destination_account FROM outbox_items WHERE state = 'confirmed'`)
	require.NoError(t, err)
	confirmedIn, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.ElementsMatch(t, []string{stripesim.DefaultAccount, "acct_1ConnectOne", "acct_1ConnectTwo", "acct_1ConnectThree"}, confirmedIn)
	var summaries int
	for _, rq := range sim.Requests() {
		if rq.Method == http.MethodGet && rq.Status == http.StatusOK && len(rq.Path) > len("/v1/billing/meters/") &&
			rq.StripeAccount == connectRevoked {
			summaries++
		}
	}
	require.Positive(t, summaries, "the revoked-then-restored account's summaries were read in that account")

	for _, u := range []string{now.Add(-2 * time.Hour).Format("2006-01"), now.Add(-2*time.Hour - 800*time.Second).Format("2006-01")} {
		rep, err := quarantine.CompletenessOf(ctx, pool, u, "")
		require.NoError(t, err)
		require.True(t, rep.Holds, "%+v", rep)
		for _, l := range rep.Lines {
			require.Equal(t, []string{accountOf[l.Tenant]}, l.Accounts, "the completeness report names each line's account")
		}
	}
}

// connectGauge reads a gauge from the node's /metrics: the series with the
// reason label's value (none: the unlabelled one); -1 when absent.
func connectGauge(t *testing.T, base, name, reason string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	f, ok := families[name]
	if !ok {
		return -1
	}
	for _, m := range f.GetMetric() {
		got := ""
		for _, l := range m.GetLabel() {
			if l.GetName() == "reason" {
				got = l.GetValue()
			}
		}
		if got == reason {
			return m.GetGauge().GetValue()
		}
	}
	return -1
}
