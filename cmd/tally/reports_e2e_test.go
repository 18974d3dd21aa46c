package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// reportsConnected is the connected account of the error report runs.
const reportsConnected = "acct_1ReportsConn"

// reportsSecret signs the simulator's deliveries to the node.
const reportsSecret = "whsec_e2e_reports_0123456789"

// reportsTenants are the runs' tenants: two in the platform's account, two
// in the connected account; the gone ones' customers are deleted at
// Stripe after their tenant mappings were made.
var reportsTenants = []struct {
	tenant, account string
	gone            bool
}{{"plat", "", false}, {"platgone", "", true}, {"conn", reportsConnected, false}, {"conngone", reportsConnected, true}}

// reportsRun is a node exporting through one exporter to a simulator that
// validates every meter event asynchronously, in the platform's account
// and a connected one, and reports the failures as thin events.
type reportsRun struct {
	t        *testing.T
	ctx      context.Context
	exporter string
	sim      *stripesim.Server
	simURL   string
	clk      *stripesim.MovedClock
	n        *node
	base     string
	pool     *pgxpool.Pool
}

// accountOf is a tenant's account at Stripe.
func accountOf(tenant string) string {
	for _, rt := range reportsTenants {
		if rt.tenant == tenant && rt.account != "" {
			return rt.account
		}
	}
	return stripesim.DefaultAccount
}

// startReportsRun starts the simulator (meters api_calls and logins and a
// customer per tenant in each tenant's account) and a node listing
// Stripe's events every interval, maps the features and tenants, then
// deletes the gone tenants' customers at Stripe, and posts usage of every
// tenant.
func startReportsRun(t *testing.T, exporter string, interval time.Duration) *reportsRun {
	t.Helper()
	r := &reportsRun{t: t, ctx: context.Background(), exporter: exporter, clk: &stripesim.MovedClock{}}
	r.sim = stripesim.New(stripesim.Options{Seed: 35, Now: r.clk.Now, Limits: stripesim.Limits{AsyncValidation: true}})
	srv := httptest.NewServer(r.sim.Handler())
	t.Cleanup(func() { r.sim.Close(); srv.Close() })
	r.simURL = srv.URL
	r.sim.AddAccount(reportsConnected)
	for _, a := range []string{stripesim.DefaultAccount, reportsConnected} {
		r.sim.CreateMeter(a, stripesim.MeterSpec{DisplayName: "api_calls", EventName: "api_calls", Formula: "sum"})
		r.sim.CreateMeter(a, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
	}
	for _, rt := range reportsTenants {
		r.sim.CreateCustomer(accountOf(rt.tenant), "cus_"+rt.tenant)
	}

	url := testdb.URL(t)
	r.n = &node{t: t, addr: freeAddr(t)}
	r.n.env = []string{
		"TALLY_DATABASE_URL=" + url, "TALLY_LISTEN=" + r.n.addr, "TALLY_ADMIN_TOKEN=" + exportAdmin,
		"STRIPE_API_KEY=" + stripesim.DefaultKey, "STRIPE_API_BASE=" + srv.URL, "STRIPE_METER_EVENTS_BASE=" + srv.URL,
		"STRIPE_WEBHOOK_SECRET=" + reportsSecret, "TALLY_REPORTS_INTERVAL=" + interval.String(),
		"TALLY_EXPORTER=" + exporter, "TALLY_STAGE_INTERVAL=200ms", "TALLY_WINDOW_GRACE=1s", "TALLY_MAINTENANCE_INTERVAL=1s",
		"TALLY_OUTBOX_BACKOFF_BASE=50ms", "TALLY_OUTBOX_BACKOFF_CAP=500ms", "TALLY_STRIPE_TIMEOUT=2s", "TALLY_POLL_INTERVAL=100ms",
		"TALLY_RATE_TEST=1000", "TALLY_STREAM_RATE_TEST=1000", "TALLY_BASIC_RATE_TEST=3000", "TALLY_SHUTDOWN_TIMEOUT=5s",
		"TALLY_LOG_LEVEL=warn",
	}
	r.base, r.pool = r.n.serve(r.ctx, url)
	// River's leader lists Stripe's events when it starts: wait for that,
	// so that the reports of this run reach the node as the run means them
	// to (the connected account is listed once a mapping names it).
	r.waitFor("the listing at start", func() bool {
		var n int
		_ = r.pool.QueryRow(r.ctx, `SELECT count(*) FROM stripe_event_listings WHERE listed_at IS NOT NULL`).Scan(&n)
		return n > 0
	})

	for _, f := range []struct{ name, formula string }{{"api_calls", "sum"}, {"logins", "count"}} {
		code, body := post(t, http.MethodPut, r.base+"/v1/mappings/features/"+f.name, exportAdmin, map[string]string{"event_name": f.name, "aggregation": f.formula})
		require.Equal(t, http.StatusOK, code, body)
	}
	client := stripe.NewClient(stripesim.DefaultKey, stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL: stripe.String(srv.URL), MaxNetworkRetries: stripe.Int64(0), LeveledLogger: &stripe.LeveledLogger{Level: stripe.LevelNull},
	})))
	for _, rt := range reportsTenants {
		in := map[string]string{"stripe_customer_id": "cus_" + rt.tenant}
		if rt.account != "" {
			in["stripe_account"] = rt.account
		}
		code, body := post(t, http.MethodPut, r.base+"/v1/mappings/tenants/"+rt.tenant, exportAdmin, in)
		require.Equal(t, http.StatusOK, code, body)
	}
	// Deleted at Stripe after the mappings were made: the mapping checks
	// passed, and only Stripe's asynchronous validation finds it out.
	for _, rt := range reportsTenants {
		if rt.gone {
			p := &stripe.CustomerDeleteParams{}
			if rt.account != "" {
				p.SetStripeAccount(rt.account)
			}
			_, err := client.V1Customers.Delete(r.ctx, "cus_"+rt.tenant, p)
			require.NoError(t, err)
		}
	}

	// Each tenant: 30 api_calls events (a window or two) and 6 logins
	// (an item each), two hours ago: a stream request's report about one
	// meter names at most 20 failed events, and these stay below that.
	now := time.Now().UTC().Truncate(time.Second)
	var evs []e2eEvent
	for _, rt := range reportsTenants {
		for i := range 36 {
			f, v := "api_calls", int64(i%7)+1
			if i >= 30 {
				f, v = "logins", 1
			}
			evs = append(evs, e2eEvent{ID: fmt.Sprintf("%s-%02d", rt.tenant, i), Tenant: rt.tenant, Feature: f, Value: v,
				Timestamp: now.Add(-2*time.Hour - time.Duration(i)*time.Second).Format(time.RFC3339)})
		}
	}
	code, body := post(t, http.MethodPost, r.base+"/v1/usage", exportAdmin, map[string]any{"events": evs})
	require.Equal(t, http.StatusAccepted, code, body)
	r.waitFor("every item sent", func() bool {
		var open, unstaged int
		_ = r.pool.QueryRow(r.ctx, `SELECT count(*) FILTER (WHERE state IN ('pending', 'leased')) FROM outbox_items`).Scan(&open)
		_ = r.pool.QueryRow(r.ctx, `SELECT count(*) FROM usage_events WHERE item_id IS NULL`).Scan(&unstaged)
		return open == 0 && unstaged == 0
	})
	return r
}

// waitFor waits a minute at most for cond.
func (r *reportsRun) waitFor(what string, cond func() bool) {
	r.t.Helper()
	for deadline := time.Now().Add(60 * time.Second); !cond(); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			r.t.Fatalf("%s never happened:\n%s\n--- tally serve output ---\n%s", what, outboxSummary(r.ctx, r.pool), tail(r.n.out.String(), 4000))
		}
	}
}

// states counts each tenant's items by state and, for quarantined ones,
// reason.
func (r *reportsRun) states() map[string]map[string]int {
	r.t.Helper()
	rows, err := r.pool.Query(r.ctx, `SELECT tenant_key, state || coalesce(':' || quarantine_reason, ''), count(*)::int
		FROM outbox_items GROUP BY 1, 2`)
	require.NoError(r.t, err)
	out := map[string]map[string]int{}
	var (
		tenant, state string
		n             int
	)
	_, err = pgx.ForEachRow(rows, []any{&tenant, &state, &n}, func() error {
		if out[tenant] == nil {
			out[tenant] = map[string]int{}
		}
		out[tenant][state] = n
		return nil
	})
	require.NoError(r.t, err)
	return out
}

// goneSettled reports whether every item of the gone tenants is
// quarantined.
func (r *reportsRun) goneSettled() bool {
	st := r.states()
	for _, rt := range reportsTenants {
		if !rt.gone {
			continue
		}
		for s := range st[rt.tenant] {
			if s != "quarantined:customer_not_found" {
				return false
			}
		}
	}
	return true
}

// check checks the end of a run: the gone tenants' usage is quarantined
// customer_not_found, never accepted or confirmed — a reconcile run too
// leaves it so —; every other tenant's usage is accepted and billed
// exactly, each in its account (Stripe's aggregates equal the ledger's),
// and the run confirms it without a discrepancy. Every report is recorded
// once, as arrival says it arrived, with its account.
func (r *reportsRun) check(arrival string) {
	r.t.Helper()
	st := r.states()
	for _, rt := range reportsTenants {
		if rt.gone {
			require.Len(r.t, st[rt.tenant], 1, "%s: %v", rt.tenant, st[rt.tenant])
			require.Positive(r.t, st[rt.tenant]["quarantined:customer_not_found"], "%s: %v", rt.tenant, st[rt.tenant])
		} else {
			require.Equal(r.t, []string{"accepted"}, keysOf(st[rt.tenant]), "%s: %v", rt.tenant, st[rt.tenant])
		}
	}
	rows, err := r.pool.Query(r.ctx, `SELECT tenant, feature, sum(value), count(*)::int FROM usage_events GROUP BY 1, 2`)
	require.NoError(r.t, err)
	var (
		tenant, feature string
		sum             int64
		count, checked  int
	)
	_, err = pgx.ForEachRow(rows, []any{&tenant, &feature, &sum, &count}, func() error {
		ssum, scount, _ := r.sim.Aggregate(accountOf(tenant), feature, "cus_"+tenant)
		gone := tenant == "platgone" || tenant == "conngone"
		switch {
		case gone:
			require.Zero(r.t, ssum+int64(scount), "%s's usage counted for a deleted customer", tenant)
		case feature == "logins":
			require.Equal(r.t, count, scount, "%s %s", tenant, feature)
		default:
			require.Equal(r.t, sum, ssum, "%s %s", tenant, feature)
		}
		checked++
		return nil
	})
	require.NoError(r.t, err)
	require.Equal(r.t, 2*len(reportsTenants), checked)
	require.Empty(r.t, r.sim.RecordedTwice())

	reports := len(r.sim.ErrorReports(stripesim.DefaultAccount)) + len(r.sim.ErrorReports(reportsConnected))
	require.Positive(r.t, reports)
	var recorded, platform, connected int
	require.NoError(r.t, r.pool.QueryRow(r.ctx, `SELECT count(*) FILTER (WHERE status = 'recorded' AND arrival = $1),
		    count(*) FILTER (WHERE account = $2), count(*) FILTER (WHERE account = $3)
		FROM stripe_events`, arrival, stripesim.DefaultAccount, reportsConnected).Scan(&recorded, &platform, &connected))
	require.Equal(r.t, reports, recorded, "every report recorded once, by %s", arrival)
	require.Equal(r.t, len(r.sim.ErrorReports(stripesim.DefaultAccount)), platform)
	require.Equal(r.t, len(r.sim.ErrorReports(reportsConnected)), connected)

	er := &exportRun{t: r.t, ctx: r.ctx, base: r.base}
	run := er.reconcileThroughAPI()
	require.Equal(r.t, "succeeded", run.Status, "%+v", run)
	require.Zero(r.t, run.Discrepancies, "%+v", run)
	require.Positive(r.t, run.ItemsConfirmed)
	st = r.states()
	for _, rt := range reportsTenants {
		want := "confirmed"
		if rt.gone {
			want = "quarantined:customer_not_found"
		}
		require.Equal(r.t, []string{want}, keysOf(st[rt.tenant]), "%s: %v", rt.tenant, st[rt.tenant])
	}
}

func keysOf(m map[string]int) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// counter reads a counter of the node's /metrics with the given labels;
// 0 when absent.
func (r *reportsRun) counter(name string, labels map[string]string) float64 {
	r.t.Helper()
	resp, err := http.Get(r.base + "/metrics")
	require.NoError(r.t, err)
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(r.t, err)
	for _, m := range families[name].GetMetric() {
		match := true
		for _, l := range m.GetLabel() {
			if v, ok := labels[l.GetName()]; ok && v != l.GetValue() {
				match = false
			}
		}
		if match {
			if m.GetCounter() != nil && m.GetCounter().Value != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

// Stripe validates customers asynchronously (v1 with its asynchronous
// validation, the stream always): the usage of a platform customer and of
// a connected account's customer, both deleted at Stripe after their
// tenants were mapped, is accepted, then reported. Every report — the
// connected account's carrying its context, read in it — is delivered to
// /v1/stripe/events and answered 2xx, and moves its items to quarantined
// (customer_not_found), never accepted or confirmed; the other customers'
// usage is billed exactly.
func TestErrorReportsEndToEnd(t *testing.T) {
	t.Parallel()
	for _, exp := range []string{"stripe_meter_events", "stripe_meter_event_stream"} {
		t.Run(exp, func(t *testing.T) {
			t.Parallel()
			r := startReportsRun(t, exp, time.Hour)
			require.Positive(t, len(r.sim.ErrorReports(reportsConnected)))
			for _, rep := range r.sim.ErrorReports(reportsConnected) {
				require.Equal(t, reportsConnected, rep.Context)
			}
			for _, a := range []string{stripesim.DefaultAccount, reportsConnected} {
				n, err := r.sim.DeliverReports(r.ctx, a, r.base+"/v1/stripe/events", reportsSecret)
				require.NoError(t, err, "every delivery answered 2xx")
				require.Equal(t, len(r.sim.ErrorReports(a)), n)
			}
			require.True(t, r.goneSettled(), "%v", r.states())
			r.check("destination")
			require.Equal(t, float64(len(r.sim.ErrorReports(stripesim.DefaultAccount))+len(r.sim.ErrorReports(reportsConnected))),
				r.counter("tally_stripe_events_total", map[string]string{"arrival": "destination", "outcome": "recorded"}))
			var contexts int
			for _, rq := range r.sim.Requests() {
				if len(rq.Path) > len("/v2/core/events/") && rq.Path[:len("/v2/core/events/")] == "/v2/core/events/" && rq.StripeContext == reportsConnected {
					require.Empty(t, rq.StripeAccount)
					require.Equal(t, http.StatusOK, rq.Status)
					contexts++
				}
			}
			require.Equal(t, len(r.sim.ErrorReports(reportsConnected)), contexts, "each connected report read once, in its context")
		})
	}
}

// The event destination is down for the whole of Stripe's retries (three
// days, on the simulator's clock): every delivery fails and Stripe gives
// up. The listing, run when the node starts again, still finds every
// report, in both accounts, and moves every item they name.
func TestErrorReportsWhenTheDestinationIsDown(t *testing.T) {
	t.Parallel()
	for _, exp := range []string{"stripe_meter_events", "stripe_meter_event_stream"} {
		t.Run(exp, func(t *testing.T) {
			t.Parallel()
			r := startReportsRun(t, exp, time.Hour)
			down := deadURL(t)
			for _, a := range []string{stripesim.DefaultAccount, reportsConnected} {
				n, err := r.sim.DeliverReports(r.ctx, a, down, reportsSecret)
				require.Error(t, err)
				require.Zero(t, n)
			}
			r.clk.Add(73 * time.Hour)
			for _, a := range []string{stripesim.DefaultAccount, reportsConnected} {
				n, err := r.sim.DeliverReports(r.ctx, a, r.base+"/v1/stripe/events", reportsSecret)
				require.NoError(t, err)
				require.Zero(t, n, "Stripe stopped retrying")
				require.Len(t, r.sim.Abandoned(a), len(r.sim.ErrorReports(a)))
			}
			// The listing ran when the node started, before the reports.
			st := r.states()
			require.Positive(t, st["platgone"]["accepted"], "%v", st)
			require.Positive(t, st["conngone"]["accepted"], "%v", st)

			// Started again: River's leader lists Stripe's events at once.
			r.n.stop()
			r.n.start()
			r.waitFor("the listing's quarantine of every reported item", r.goneSettled)
			r.check("listing")
			require.Positive(t, r.counter("tally_stripe_events_total", map[string]string{"arrival": "listing", "outcome": "recorded"}))
			require.GreaterOrEqual(t, r.counter("tally_job_last_success_age_seconds", map[string]string{"task": "reports"}), 0.0)
			var lists, inContext int
			for _, rq := range r.sim.Requests() {
				if rq.Path == "/v2/core/events" {
					lists++
					if rq.StripeContext == reportsConnected {
						inContext++
					}
				}
			}
			require.Positive(t, inContext, "the connected account listed in its context")
			require.Greater(t, lists, inContext)
		})
	}
}

// deadURL is a URL nothing listens on: an endpoint that is down.
func deadURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return "http://" + addr + "/v1/stripe/events"
}
