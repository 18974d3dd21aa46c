package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
)

// invoiceRun is TestInvoicesEndToEnd's state: a node, the simulator
// (whose clock the test moves) and the two customers' anchors.
type invoiceRun struct {
	t      *testing.T
	ctx    context.Context
	sim    *stripesim.Server
	clock  *stripesim.MovedClock
	base   string
	pool   *pgxpool.Pool
	anchor map[string]time.Time // by tenant
	seq    int
}

const invoiceSecret = "whsec_e2e_invoices_0123456789abcdef"

// deliver posts Stripe's billing events due by its clock to the node.
func (r *invoiceRun) deliver() {
	r.t.Helper()
	_, err := r.sim.DeliverBillingEvents(r.ctx, stripesim.DefaultAccount, r.base+"/v1/stripe/events", invoiceSecret)
	require.NoError(r.t, err)
}

// use posts usage of a tenant's feature at a time.
func (r *invoiceRun) use(tenant, feature string, value int64, at time.Time) {
	r.t.Helper()
	r.seq++
	code, body := post(r.t, http.MethodPost, r.base+"/v1/usage", exportAdmin, map[string]any{"events": []e2eEvent{{
		ID: fmt.Sprintf("i%04d", r.seq), Tenant: tenant, Feature: feature, Value: value, Timestamp: at.UTC().Format(time.RFC3339)}}})
	require.Equal(r.t, http.StatusAccepted, code, body)
}

// settled waits until every event is staged and no item is pending or
// leased.
func (r *invoiceRun) settled() {
	r.t.Helper()
	require.Eventually(r.t, func() bool {
		unstaged, open, err := openWork(r.ctx, r.pool)
		return err == nil && unstaged == 0 && open == 0
	}, 2*time.Minute, 100*time.Millisecond)
}

// moveTo moves Stripe's clock to t.
func (r *invoiceRun) moveTo(t time.Time) {
	if d := t.Sub(r.clock.Now()); d > 0 {
		r.clock.Add(d)
	}
}

// checks reads the open (or all) invoice checks of a month from the API.
func (r *invoiceRun) checks(period, status string) []invoices.Check {
	r.t.Helper()
	code, body := post(r.t, http.MethodGet, r.base+"/v1/invoices/checks?period="+period+"&status="+status, exportAdmin, nil)
	require.Equal(r.t, http.StatusOK, code, body)
	var out struct {
		Checks []invoices.Check `json:"checks"`
	}
	require.NoError(r.t, json.Unmarshal([]byte(body), &out))
	return out.Checks
}

// gates reads every gate, by invoice's customer.
func (r *invoiceRun) gates() map[string]invoices.GateView {
	r.t.Helper()
	code, body := post(r.t, http.MethodGet, r.base+"/v1/invoices/gates?status=all", exportAdmin, nil)
	require.Equal(r.t, http.StatusOK, code, body)
	var out struct {
		Gates []invoices.GateView `json:"gates"`
	}
	require.NoError(r.t, json.Unmarshal([]byte(body), &out))
	by := map[string]invoices.GateView{}
	for _, g := range out.Gates {
		if _, ok := by[g.Customer]; !ok { // newest first
			by[g.Customer] = g
		}
	}
	return by
}

// invoiced reads the completeness report's invoiced quantity and open
// invoice discrepancies of each tenant and feature of a month.
func (r *invoiceRun) invoiced(period string) map[string]string {
	r.t.Helper()
	code, body := post(r.t, http.MethodGet, r.base+"/v1/reports/completeness?period="+period, exportAdmin, nil)
	require.Equal(r.t, http.StatusOK, code, body)
	var rep struct {
		Lines []struct {
			Tenant, Feature string
			Ingested        struct{ Value int64 }
			Cancelled       struct{ Value int64 }
			Invoiced        *int64
			Kinds           []string `json:"invoice_discrepancies"`
		}
	}
	require.NoError(r.t, json.Unmarshal([]byte(body), &rep))
	out := map[string]string{}
	for _, l := range rep.Lines {
		inv := "none"
		if l.Invoiced != nil {
			inv = fmt.Sprint(*l.Invoiced)
		}
		out[l.Tenant+"/"+l.Feature] = fmt.Sprintf("used %d invoiced %s %s", l.Ingested.Value-l.Cancelled.Value, inv, strings.Join(l.Kinds, ","))
	}
	return out
}

// billed checks that the completeness report prices each customer's usage
// of a month as Stripe's invoices of it bill it: per customer, the sum of
// the report's amounts equals the sum of the metered lines of the periods
// that start in the month.
func (r *invoiceRun) billed(period string) {
	r.t.Helper()
	code, body := post(r.t, http.MethodGet, r.base+"/v1/reports/completeness?period="+period+"&refresh=true", exportAdmin, nil)
	require.Equal(r.t, http.StatusOK, code, body)
	var rep struct {
		Lines []struct {
			Tenant, Feature, Customer, Currency string
			Amount                              *int64
			Note                                string `json:"amount_note"`
		}
		Customers []struct {
			Customer, Currency string
			Amount             int64
		}
		Unpriced int `json:"unpriced_lines"`
	}
	require.NoError(r.t, json.Unmarshal([]byte(body), &rep))
	for _, l := range rep.Lines {
		require.NotNil(r.t, l.Amount, "%s/%s: %s", l.Tenant, l.Feature, l.Note)
		require.Equal(r.t, "usd", l.Currency)
	}
	require.Zero(r.t, rep.Unpriced)
	report := map[string]int64{}
	for _, c := range rep.Customers {
		report[c.Customer] += c.Amount
	}
	stripe := map[string]int64{}
	for _, inv := range r.sim.Invoices(stripesim.DefaultAccount) {
		for _, l := range inv.Lines {
			if l.Meter != "" && l.PeriodStart.UTC().Format("2006-01") == period {
				stripe[inv.Customer] += l.Amount
			}
		}
	}
	require.Len(r.t, stripe, 2)
	require.Equal(r.t, stripe, report, "what the report says the usage should bill is what Stripe's invoices bill")
}

// TestInvoicesEndToEnd runs `tally serve` against the simulator over two
// billing cycles of two customers whose periods are anchored on the time
// the test runs (mid-month, unless it runs on a 1st), Stripe's clock moved
// as the cycles need. Cycle one: the periods come from the subscriptions;
// usage posted after the period ended in Stripe but within its grace is on
// the invoice; every line equals the ledger, the report's invoiced column
// shows it, no discrepancy. Usage posted after the invoice finalized is
// quarantined period_closed and counted as used but on no invoice. Cycle
// two, with TALLY_INVOICE_HOLD on: a period with a quarantined item holds
// its draft, tally_invoices_incomplete says so, fixing the mapping and
// requeueing the item releases it, and the invoice then matches the ledger.
func TestInvoicesEndToEnd(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	start := time.Now().UTC()
	a := start.Add(150 * time.Second).Truncate(time.Second)
	r := &invoiceRun{t: t, ctx: ctx, clock: &stripesim.MovedClock{},
		anchor: map[string]time.Time{"ta": a, "tb": a.Add(20 * time.Second)}}
	r.clock.Add(-29 * 24 * time.Hour)
	r.sim = stripesim.New(stripesim.Options{Seed: 40, Now: r.clock.Now})
	srv := httptest.NewServer(r.sim.Handler())
	t.Cleanup(func() { r.sim.Close(); srv.Close() })

	prices := map[string]string{}
	for _, f := range []struct{ name, formula, unit string }{{"api_calls", "sum", "2"}, {"logins", "count", "10"}, {"exports", "sum", "5"}} {
		m := r.sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: f.name, Formula: f.formula})
		prices[f.name] = r.sim.CreatePrice(stripesim.DefaultAccount, stripesim.PriceSpec{UnitAmountDecimal: f.unit, Meter: m.ID})
	}
	for _, tn := range []string{"ta", "tb"} {
		cus := r.sim.CreateCustomer(stripesim.DefaultAccount, "cus_"+tn)
		r.sim.CreateSubscription(stripesim.DefaultAccount, stripesim.SubscriptionSpec{Customer: cus,
			Prices:             []string{prices["api_calls"], prices["logins"], prices["exports"]},
			BillingCycleAnchor: r.anchor[tn], BackdateStartDate: stagetest.AddMonths(r.anchor[tn], -1)})
	}

	url := testdb.URL(t)
	n := &node{t: t, addr: freeAddr(t)}
	n.env = []string{
		"TALLY_DATABASE_URL=" + url, "TALLY_LISTEN=" + n.addr, "TALLY_ADMIN_TOKEN=" + exportAdmin,
		"STRIPE_API_KEY=" + stripesim.DefaultKey, "STRIPE_API_BASE=" + srv.URL, "STRIPE_METER_EVENTS_BASE=" + srv.URL,
		"STRIPE_WEBHOOK_SECRET=" + invoiceSecret, "TALLY_INVOICE_HOLD=true",
		"TALLY_STAGE_INTERVAL=200ms", "TALLY_WINDOW_GRACE=1s", "TALLY_MAINTENANCE_INTERVAL=1s",
		"TALLY_OUTBOX_BACKOFF_BASE=50ms", "TALLY_OUTBOX_BACKOFF_CAP=500ms", "TALLY_STRIPE_TIMEOUT=2s", "TALLY_POLL_INTERVAL=100ms",
		"TALLY_RATE_TEST=1000", "TALLY_BASIC_RATE_TEST=3000", "TALLY_SHUTDOWN_TIMEOUT=5s", "TALLY_LOG_LEVEL=warn",
	}
	r.base, r.pool = n.serve(ctx, url)
	r.clock.Add(time.Since(r.clock.Now())) // Stripe's now is the node's while usage is sent

	for _, f := range []struct{ name, formula string }{{"api_calls", "sum"}, {"logins", "count"}} {
		code, body := post(t, http.MethodPut, r.base+"/v1/mappings/features/"+f.name, exportAdmin,
			map[string]any{"event_name": f.name, "aggregation": f.formula, "window": "1m"})
		require.Equal(t, http.StatusOK, code, body)
	}
	// The periods come from subscriptions on meters the node's directory
	// knows: it lists the account's meters at start.
	require.Eventually(t, func() bool {
		var n int
		_ = r.pool.QueryRow(ctx, `SELECT count(*) FROM stripe_meters`).Scan(&n)
		return n == 3
	}, 30*time.Second, 100*time.Millisecond)
	for _, tn := range []string{"ta", "tb"} {
		code, body := post(t, http.MethodPut, r.base+"/v1/mappings/tenants/"+tn, exportAdmin, map[string]any{"stripe_customer_id": "cus_" + tn})
		require.Equal(t, http.StatusOK, code, body)
		var m mappings.Tenant
		require.NoError(t, json.Unmarshal([]byte(body), &m))
		require.NotNil(t, m.PeriodAnchor, body)
		require.True(t, r.anchor[tn].Equal(*m.PeriodAnchor), "the period comes from the subscription: %s", body)
	}

	// Cycle one: usage across the period, sent to Stripe as it comes.
	now := time.Now().UTC()
	for i, ago := range []time.Duration{20 * 24 * time.Hour, 5 * 24 * time.Hour, time.Hour, 3 * time.Minute} {
		for _, tn := range []string{"ta", "tb"} {
			r.use(tn, "api_calls", int64(7*i+3), now.Add(-ago))
			r.use(tn, "logins", 1, now.Add(-ago))
		}
	}
	r.settled()

	// The periods end in Stripe: drafts, and their events reach the node.
	r.moveTo(r.anchor["tb"].Add(time.Minute))
	r.deliver()
	require.Eventually(t, func() bool {
		g := r.gates()
		return g["cus_ta"].State == invoices.GateComplete && g["cus_tb"].State == invoices.GateComplete
	}, time.Minute, 200*time.Millisecond, "every unit of the period is in Stripe")

	// Usage of the period posted within Stripe's grace is on the invoice.
	r.use("ta", "api_calls", 40, a.Add(-10*time.Minute))
	r.settled()
	r.moveTo(r.anchor["tb"].Add(time.Hour + time.Minute))
	r.deliver()
	cycle1 := stagetest.AddMonths(a, -1).Format("2006-01")
	require.Eventually(t, func() bool { return len(r.checks(cycle1, "all")) == 6 }, time.Minute, 200*time.Millisecond)
	for _, c := range r.checks(cycle1, "all") {
		require.Equal(t, invoices.Matches, c.Status, "%+v", c)
	}
	require.Empty(t, r.checks(cycle1, "open"))
	require.Equal(t, map[string]string{
		"ta/api_calls": "used 94 invoiced 94 ", "ta/logins": "used 4 invoiced 4 ",
		"tb/api_calls": "used 54 invoiced 54 ", "tb/logins": "used 4 invoiced 4 ",
	}, r.invoiced(cycle1))

	// Usage posted once the invoice is final is late: quarantined, and used
	// but on no invoice, never confirmed.
	code, body := post(t, http.MethodPut, r.base+"/v1/mappings/tenants/ta", exportAdmin, map[string]any{"stripe_customer_id": "cus_ta", "invoice_grace": "0s"})
	require.Equal(t, http.StatusOK, code, body)
	time.Sleep(time.Until(r.anchor["tb"].Add(2 * time.Second))) // both periods have ended on the node's clock
	r.use("ta", "api_calls", 9, a.Add(-5*time.Minute))
	r.settled()
	var reason string
	require.NoError(t, r.pool.QueryRow(ctx, `SELECT quarantine_reason FROM outbox_items WHERE state = 'quarantined'`).Scan(&reason))
	require.Contains(t, reason, "period_closed")
	_, err := invoices.Recompare(ctx, r.pool, &mappings.Store{}, invoices.DefaultRecompareWithin, 0, 100)
	require.NoError(t, err)
	open := r.checks(cycle1, "open")
	require.Len(t, open, 1)
	require.Equal(t, []string{invoices.KindUsedNotInvoiced}, open[0].Kinds)
	require.Equal(t, "9", open[0].Unbilled.String())
	require.Equal(t, "used 103 invoiced 94 used_not_invoiced", r.invoiced(cycle1)["ta/api_calls"])

	// Cycle two, held: tb's exports have no mapping yet.
	now = time.Now().UTC()
	for _, tn := range []string{"ta", "tb"} {
		r.use(tn, "api_calls", 11, now.Add(-time.Second))
		r.use(tn, "logins", 1, now.Add(-time.Second))
	}
	r.use("tb", "exports", 6, now.Add(-time.Second))
	// Not waited for: the draft's gate stages the running windows at once.
	r.moveTo(stagetest.AddMonths(r.anchor["tb"], 1).Add(time.Minute))
	r.deliver()
	require.Eventually(t, func() bool {
		g := r.gates()
		return g["cus_ta"].State == invoices.GateComplete && g["cus_tb"].State == invoices.GateHeld
	}, 90*time.Second, 200*time.Millisecond, "the gate job finds ta's period complete within a minute")
	require.Contains(t, r.gates()["cus_tb"].Missing, "tb/exports: 1 events quarantined")
	require.Eventually(t, func() bool {
		_, metrics := get(r.base + "/metrics")
		return strings.Contains(metrics, "\ntally_invoices_incomplete 1\n")
	}, 10*time.Second, 100*time.Millisecond, "TallyInvoiceIncomplete's gauge")
	var held []stripesim.Invoice
	for _, inv := range r.sim.Invoices(stripesim.DefaultAccount) {
		if inv.Customer == "cus_tb" && inv.Status == "draft" {
			held = append(held, inv)
		}
	}
	require.Len(t, held, 1)
	require.False(t, held[0].AutoAdvance, "held")

	// The mapping is fixed and the item requeued: the gate releases the
	// draft, which then bills every unit.
	code, body = post(t, http.MethodPut, r.base+"/v1/mappings/features/exports", exportAdmin,
		map[string]any{"event_name": "exports", "aggregation": "sum", "window": "1m"})
	require.Equal(t, http.StatusOK, code, body)
	var f mappings.Feature
	require.NoError(t, json.Unmarshal([]byte(body), &f))
	var item int64
	require.NoError(t, r.pool.QueryRow(ctx, `SELECT id FROM outbox_items WHERE state = 'quarantined' AND quarantine_reason LIKE 'feature_unmapped%'`).Scan(&item))
	code, body = post(t, http.MethodPost, fmt.Sprintf("%s/v1/outbox/items/%d/requeue", r.base, item), exportAdmin, map[string]any{"mapping_version": f.Version})
	require.Equal(t, http.StatusOK, code, body)
	r.settled()
	require.Eventually(t, func() bool { return r.gates()["cus_tb"].State == invoices.GateComplete }, 90*time.Second, time.Second,
		"the gate job releases the draft within a minute")
	// Released before Stripe's time for it: auto_advance again, and Stripe
	// finalizes both drafts at the end of the grace.
	r.moveTo(stagetest.AddMonths(r.anchor["tb"], 1).Add(time.Hour + time.Minute))
	r.deliver()
	cycle2 := a.Format("2006-01")
	require.Eventually(t, func() bool { return len(r.checks(cycle2, "all")) == 6 }, time.Minute, 200*time.Millisecond)
	for _, c := range r.checks(cycle2, "all") {
		require.Equal(t, invoices.Matches, c.Status, "%+v", c)
	}
	require.Equal(t, map[string]string{
		"ta/api_calls": "used 11 invoiced 11 ", "ta/logins": "used 1 invoiced 1 ", "ta/exports": "used 0 invoiced 0 ",
		"tb/api_calls": "used 11 invoiced 11 ", "tb/logins": "used 1 invoiced 1 ", "tb/exports": "used 6 invoiced 6 ",
	}, r.invoiced(cycle2))
	for _, c := range r.checks(cycle2, "all") {
		require.NotNil(t, c.ExpectedAmount, "%+v", c)
		require.Equal(t, *c.InvoicedAmount, *c.ExpectedAmount, "what the ledger's usage should bill is what Stripe billed: %+v", c)
	}
	r.billed(cycle2)
	var audited int
	require.NoError(t, r.pool.QueryRow(ctx, `SELECT count(*) FROM audit_log WHERE action IN ('invoice.hold', 'invoice.release')`).Scan(&audited))
	require.Equal(t, 2, audited)
}
