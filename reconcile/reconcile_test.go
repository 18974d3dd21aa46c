package reconcile_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// settled is a settle delay every accepted item of a test has passed.
const settled = time.Millisecond

type rig struct {
	*stagetest.Env
	sim  *stripesim.Server
	base string
	exp  exporter.Exporter
	rec  *reconcile.Reconciler
}

// newRig is a staging path addressed to the simulator's account with
// features api (sum), seats (last) and logins (count), each mapped to its
// meter, and tenants t0..t9 mapped to the simulator's customers.
func newRig(t *testing.T, cfg outbox.Config) *rig {
	t.Helper()
	sim := stripesim.New(stripesim.Options{Seed: 11})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	env := stagetest.New(t, cfg)
	env.Target.Account = stripesim.DefaultAccount
	for _, f := range []struct {
		name    string
		agg     mappings.Aggregation
		formula string
	}{{"api", mappings.Sum, "sum"}, {"seats", mappings.Last, "last"}, {"logins", mappings.Count, "count"}} {
		sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: f.name, EventName: f.name, Formula: f.formula})
		env.Feature(t, f.name, f.agg, time.Hour)
	}
	for i := 0; i < 10; i++ {
		env.Tenant(t, fmt.Sprintf("t%d", i), nil)
		sim.CreateCustomer(stripesim.DefaultAccount, fmt.Sprintf("cus_t%d", i))
	}
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	r := &rig{Env: env, sim: sim, base: srv.URL, exp: exporter.NewStripeV1(client, 2*time.Second)}
	r.rec = r.reconciler(t, 1000)
	return r
}

func (r *rig) reconciler(t *testing.T, rate float64) *reconcile.Reconciler {
	return r.reconcilerRetrying(t, rate, 5*time.Second)
}

func (r *rig) reconcilerRetrying(t *testing.T, rate float64, retryMax time.Duration) *reconcile.Reconciler {
	t.Helper()
	rec, err := reconcile.New(reconcile.Config{Outbox: r.Outbox, Key: stripesim.DefaultKey, APIBase: r.base,
		Destination: func() (exporter.Destination, error) {
			return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: stripesim.DefaultAccount, Mode: outbox.ModeTest}, nil
		}, Limiter: exporter.NewLimiter(rate), RetryInitial: time.Millisecond, RetryMax: retryMax, InvoiceGrace: testGrace})
	require.NoError(t, err)
	return rec
}

// testGrace is the rig's invoice grace, the longest Stripe allows (as the
// staging harness's): usage dated hours back is in an open period even in
// the first hours of a month.
const testGrace = meter.MaxInvoiceGrace

// deliverAll stages what is due and sends every pending item until none is
// pending or leased: claims, sends and records, as the deliverer does, one
// batch at a time.
func (r *rig) deliverAll(t *testing.T) {
	t.Helper()
	r.Pass(t)
	for deadline := time.Now().Add(30 * time.Second); ; {
		leases, err := r.Outbox.Claim(r.Ctx, r.Pool, outbox.ClaimOptions{Owner: "test", Limit: 200})
		require.NoError(t, err)
		if len(leases) == 0 {
			if c := r.counts(t); c[outbox.StatePending]+c[outbox.StateLeased] == 0 {
				return
			}
			require.False(t, time.Now().After(deadline), "items never drained: %v", r.counts(t))
			time.Sleep(5 * time.Millisecond)
			continue
		}
		outcomes := make([]outbox.Outcome, len(leases))
		for i, l := range leases {
			outcomes[i] = r.exp.Send(r.Ctx, l)
			outcomes[i].Lease = l
		}
		_, err = r.Outbox.Record(r.Ctx, r.Pool, outcomes)
		require.NoError(t, err)
	}
}

// summaryReads counts the simulator's event summary calls.
func (r *rig) summaryReads() int {
	n := 0
	for _, req := range r.sim.Requests() {
		if strings.HasSuffix(req.Path, "/event_summaries") {
			n++
		}
	}
	return n
}

// metersReads counts the simulator's GET /v1/billing/meters calls.
func (r *rig) metersReads() int {
	n := 0
	for _, req := range r.sim.Requests() {
		if req.Path == "/v1/billing/meters" {
			n++
		}
	}
	return n
}

func (r *rig) counts(t *testing.T) map[outbox.State]int64 {
	t.Helper()
	g, err := r.Outbox.ReadGauge(r.Ctx, r.Pool)
	require.NoError(t, err)
	return g.Counts
}

func (r *rig) run(t *testing.T, opts reconcile.Options) (reconcile.Run, []reconcile.Discrepancy) {
	t.Helper()
	run, err := r.rec.RunNow(r.Ctx, r.Pool, reconcile.TriggerCommand, "test", opts)
	require.NoError(t, err)
	require.Equal(t, "succeeded", run.Status, "%+v", run)
	ds, err := reconcile.Discrepancies(r.Ctx, r.Pool, run.ID)
	require.NoError(t, err)
	require.Len(t, ds, run.Discrepancies)
	return run, ds
}

// states maps every item to its state.
func (r *rig) states(t *testing.T) map[int64]outbox.State {
	t.Helper()
	rows, err := r.Pool.Query(r.Ctx, `SELECT id, state FROM outbox_items`)
	require.NoError(t, err)
	out := map[int64]outbox.State{}
	for rows.Next() {
		var id int64
		var s outbox.State
		require.NoError(t, rows.Scan(&id, &s))
		out[id] = s
	}
	require.NoError(t, rows.Err())
	return out
}

type itemRef struct {
	id                      int64
	identifier, event, cust string
	hour                    time.Time
}

// items lists the items of the given states with their key and hour.
func (r *rig) items(t *testing.T, states ...outbox.State) []itemRef {
	t.Helper()
	names := make([]string, len(states))
	for i, s := range states {
		names[i] = string(s)
	}
	rows, err := r.Pool.Query(r.Ctx, `SELECT id, identifier, payload ->> 'event_name', payload ->> 'customer',
			to_timestamp((payload ->> 'timestamp')::bigint / 3600 * 3600)
		FROM outbox_items WHERE state = ANY($1) ORDER BY id`, names)
	require.NoError(t, err)
	var out []itemRef
	for rows.Next() {
		var it itemRef
		require.NoError(t, rows.Scan(&it.id, &it.identifier, &it.event, &it.cust, &it.hour))
		it.hour = it.hour.UTC()
		out = append(out, it)
	}
	require.NoError(t, rows.Err())
	return out
}

// ingestMix posts usage of every formula for every tenant over the hours
// 3..3+hours ago, and returns nothing: the ledger is the truth.
func (r *rig) ingestMix(t *testing.T, hours int) {
	t.Helper()
	n := 0
	for h := 0; h < hours; h++ {
		for tn := 0; tn < 10; tn++ {
			tenant := fmt.Sprintf("t%d", tn)
			for k := 0; k < 3; k++ {
				ts := stagetest.Ago(time.Duration(3+h)*time.Hour + time.Duration(k*7+tn)*time.Minute)
				n++
				r.MustIngest(t,
					stagetest.Ev(fmt.Sprintf("a%d", n), tenant, "api", int64(n%9)+1, ts),
					stagetest.Ev(fmt.Sprintf("s%d", n), tenant, "seats", int64(n%13), ts),
					stagetest.Ev(fmt.Sprintf("l%d", n), tenant, "logins", 1, ts))
			}
		}
	}
}

func TestAllMatchingConfirmsEverything(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 4)
	r.deliverAll(t)
	accepted := r.counts(t)[outbox.StateAccepted]
	require.Positive(t, accepted)

	run, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds)
	require.Equal(t, accepted, run.ItemsConfirmed)
	require.Equal(t, run.HoursCompared, run.HoursMatched)
	require.Equal(t, 30, run.KeysTotal, "10 customers × 3 meters")
	require.Equal(t, run.KeysTotal, run.KeysDone)
	require.Zero(t, run.HoursSkipped)
	require.Equal(t, 1+30, run.StripeCalls, "the meters, then one page of summaries per key")
	c := r.counts(t)
	require.Zero(t, c[outbox.StateAccepted])
	require.Equal(t, accepted, c[outbox.StateConfirmed])

	// A second run reads every key of the open period again, finds every
	// hour matching, and changes nothing.
	before := r.states(t)
	again, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds)
	require.Equal(t, 30, again.KeysTotal, "the billing period is open: its keys are read again")
	require.Equal(t, run.HoursCompared, again.HoursCompared)
	require.Equal(t, again.HoursCompared, again.HoursMatched)
	require.Zero(t, again.ItemsConfirmed)
	require.Equal(t, before, r.states(t))
}

func TestDroppedEventsAreDiscrepanciesForExactlyTheirHours(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 3)
	r.deliverAll(t)
	all := r.items(t, outbox.StateAccepted)
	dropped := r.dropOneOfEachFormula(t, all)

	// Stripe's reports of the drops have not reached Tally yet (see the
	// end): the reconciler finds the drops on its own.
	run, ds := r.run(t, reconcile.Options{Settle: settled})
	got := map[droppedHour]bool{}
	for _, d := range ds {
		require.Empty(t, d.ReportedItems, "no report recorded yet: %+v", d)
		got[droppedHour{d.EventName, d.Customer, d.Hour}] = true
		require.Equal(t, stripesim.DefaultAccount, d.Account)
		require.Equal(t, "unexplained", d.Explanation, "no uncertain item explains a drop")
		if d.Formula != "last" {
			require.NotNil(t, d.Provider, "a sum or count of nothing is zero")
		}
	}
	require.Equal(t, dropped, got, "discrepancies for exactly the hours that lost an event")

	// Nothing in those hours is confirmed; everything else is.
	for _, it := range all {
		state := r.states(t)[it.id]
		if dropped[droppedHour{it.event, it.cust, it.hour}] {
			require.Equal(t, outbox.StateAccepted, state, "item %d in a discrepancy hour", it.id)
		} else {
			require.Equal(t, outbox.StateConfirmed, state, "item %d", it.id)
		}
	}
	require.Equal(t, len(dropped), run.Discrepancies)

	// The completeness report counts them on their lines, as of this run.
	months := map[string]bool{}
	for _, it := range all {
		months[it.hour.Format("2006-01")] = true
	}
	require.Equal(t, int64(len(dropped)), r.completenessDiscrepancies(t, months, run.ID))

	// A second run reports the same hours again and changes nothing.
	before := r.states(t)
	_, ds2 := r.run(t, reconcile.Options{Settle: settled})
	require.Equal(t, findings(ds), findings(ds2))
	require.Equal(t, before, r.states(t))

	// Stripe's reports of the drops arrive: the items they name leave
	// accepted (T10; "dropped" is no code Tally knows, so quarantined
	// provider_refused for a human), and the next run confirms the rest of
	// those hours.
	reported := r.recordErrorReports(t, all)
	require.Len(t, reported, 4)
	_, ds3 := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds3)
	for id, state := range r.states(t) {
		if reported[id] {
			require.Equal(t, outbox.StateQuarantined, state, "item %d", id)
		} else {
			require.Equal(t, outbox.StateConfirmed, state, "item %d", id)
		}
	}
	for m := range months {
		rep, err := quarantine.CompletenessOf(r.Ctx, r.Pool, m, "")
		require.NoError(t, err)
		require.True(t, rep.Holds)
	}
}

// droppedHour is one hour of one (event name, customer) key.
type droppedHour struct {
	event, cust string
	hour        time.Time
}

// dropOneOfEachFormula drops, at the simulator, one event of each formula
// (two of last), in different keys and hours, and returns their hours.
func (r *rig) dropOneOfEachFormula(t *testing.T, all []itemRef) map[droppedHour]bool {
	dropped := map[droppedHour]bool{}
	for _, pick := range []struct {
		event string
		nth   int
	}{{"api", 3}, {"seats", 17}, {"logins", 40}, {"logins", 41}} {
		var of []itemRef
		for _, it := range all {
			if it.event == pick.event {
				of = append(of, it)
			}
		}
		it := of[pick.nth]
		require.True(t, r.sim.DropEvent(stripesim.DefaultAccount, it.identifier))
		dropped[droppedHour{it.event, it.cust, it.hour}] = true
	}
	return dropped
}

// completenessDiscrepancies sums the discrepancies the completeness
// reports of months count on their lines, checking that each holds as of
// run runID.
func (r *rig) completenessDiscrepancies(t *testing.T, months map[string]bool, runID int64) int64 {
	var total int64
	for m := range months {
		rep, err := quarantine.CompletenessOf(r.Ctx, r.Pool, m, "")
		require.NoError(t, err)
		require.True(t, rep.Holds)
		require.Equal(t, runID, *rep.ReconcileRun)
		for _, l := range rep.Lines {
			total += l.Discrepancies
		}
	}
	return total
}

// recordErrorReports records every meter error report the simulator has
// made, each failing one item, and returns the items the reports name.
func (r *rig) recordErrorReports(t *testing.T, all []itemRef) map[int64]bool {
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: r.base})
	require.NoError(t, err)
	reported := map[int64]bool{}
	for _, rep := range r.sim.ErrorReports(stripesim.DefaultAccount) {
		full, err := client.MeterErrorEvent(r.Ctx, rep.ID)
		require.NoError(t, err)
		res, err := reconcile.RecordReport(r.Ctx, r.Pool, r.Outbox, full)
		require.NoError(t, err)
		require.Equal(t, reconcile.ReportResult{Recorded: true, Failed: 1}, res)
		for _, it := range all {
			if slices.Contains(rep.Identifiers, it.identifier) {
				reported[it.id] = true
			}
		}
	}
	return reported
}

// Items that became uncertain (every reply lost, so Tally could not know)
// but did land are named by the discrepancy; recovered to accepted, the
// next run confirms them.
func TestUncertainItemsThatLandedAreNamed(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{MaxAttempts: 2, BackoffBase: time.Millisecond, BackoffCap: 2 * time.Millisecond})
	// Accepted items in the hour 5 hours ago, for t1's three meters.
	at := func(min int) *time.Time {
		v := stagetest.Ago(5 * time.Hour).Truncate(time.Hour).Add(time.Duration(min) * time.Minute)
		return &v
	}
	r.MustIngest(t, stagetest.Ev("a1", "t1", "api", 10, at(5)), stagetest.Ev("s1", "t1", "seats", 4, at(5)),
		stagetest.Ev("l1", "t1", "logins", 1, at(5)))
	r.deliverAll(t)
	require.Equal(t, int64(3), r.counts(t)[outbox.StateAccepted])

	// Later usage of the same hour: Stripe records it, every reply is lost.
	r.sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{LoseReply: 1}})
	r.MustIngest(t, stagetest.Ev("a2", "t1", "api", 7, at(30)), stagetest.Ev("s2", "t1", "seats", 9, at(30)),
		stagetest.Ev("l2", "t1", "logins", 1, at(30)), stagetest.Ev("l3", "t1", "logins", 1, at(31)))
	r.deliverAll(t)
	r.sim.ConfigureDefault(stripesim.Limits{})
	uncertain := r.items(t, outbox.StateUncertain)
	require.Len(t, uncertain, 4)
	byEvent := map[string][]int64{}
	for _, it := range uncertain {
		byEvent[it.event] = append(byEvent[it.event], it.id)
	}

	run, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Len(t, ds, 3, "%+v", ds)
	require.Zero(t, run.ItemsConfirmed, "never confirm on a mismatch")
	for _, d := range ds {
		require.Equal(t, "explained", d.Explanation, "%+v", d)
		require.Equal(t, byEvent[d.EventName], d.ExplainedBy, d.EventName)
		require.Equal(t, byEvent[d.EventName], d.UncertainItems, d.EventName)
	}
	want := map[string][3]string{ // expected, provider, difference
		"api": {"10", "17", "7"}, "seats": {"4", "9", "5"}, "logins": {"1", "3", "2"},
	}
	for _, d := range ds {
		w := want[d.EventName]
		require.Equal(t, w[0], d.Expected, d.EventName)
		require.Equal(t, w[1], *d.Provider, d.EventName)
		require.Equal(t, w[2], *d.Difference, d.EventName)
	}

	// The run's plan: recover each named item to accepted. Applied after
	// review, every action is audited; the rerun confirms the whole hour.
	plan, err := reconcile.PlanOf(r.Ctx, r.Pool, r.Outbox, run.ID)
	require.NoError(t, err)
	require.Len(t, plan.Actions, 4)
	require.Zero(t, plan.Unplanned)
	for _, a := range plan.Actions {
		require.Equal(t, outbox.StateUncertain, a.Expect)
		require.Equal(t, outbox.StateAccepted, a.To)
		require.Contains(t, a.Reason, fmt.Sprintf("reconcile run %d", run.ID))
	}
	results := reconcile.ApplyPlan(r.Ctx, r.Pool, r.Outbox, plan, "cli:finance-lead")
	for _, res := range results {
		require.True(t, res.Applied, "%+v", res)
	}
	all, err := audit.List(r.Ctx, r.Pool, "", 100)
	require.NoError(t, err)
	var entries []audit.Entry
	for _, e := range all {
		if e.Action == audit.ActionRecover {
			entries = append(entries, e)
		}
	}
	require.Len(t, entries, 4, "one entry per recovery (the mappings of the rig have theirs)")
	for _, e := range entries {
		require.Equal(t, "cli:finance-lead", e.Actor)
		require.Equal(t, audit.ActionRecover, e.Action)
		require.Equal(t, "uncertain", e.From)
		require.Equal(t, "accepted", e.To)
		require.NotEmpty(t, e.Reason)
	}

	// Applied again, the plan changes nothing: each item is accepted now.
	for _, res := range reconcile.ApplyPlan(r.Ctx, r.Pool, r.Outbox, plan, "cli:finance-lead") {
		require.False(t, res.Applied)
		require.Contains(t, res.Error, "is accepted, not uncertain")
	}

	again, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds)
	require.Equal(t, int64(7), again.ItemsConfirmed)
	require.Equal(t, int64(7), r.counts(t)[outbox.StateConfirmed])
}

// Recovery checks the expected state against the item's, and a plan's
// lease token against the item's: what moved since it was reviewed is
// refused with its current state.
func TestRecoverChecksTheExpectedState(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{MaxAttempts: 1})
	r.MustIngest(t, stagetest.Ev("l1", "t1", "logins", 1, stagetest.Ago(3*time.Hour)),
		stagetest.Ev("l2", "t2", "logins", 1, stagetest.Ago(3*time.Hour)))
	r.sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{FailBeforeRecord: 1}})
	r.deliverAll(t)
	r.sim.ConfigureDefault(stripesim.Limits{})
	unc := r.items(t, outbox.StateUncertain)
	require.Len(t, unc, 2)

	// Wrong expectation: the item is uncertain, the operator says accepted.
	_, err := reconcile.Recover(r.Ctx, r.Pool, r.Outbox, unc[0].id, reconcile.Recovery{Expect: outbox.StateAccepted, To: outbox.StatePending, By: "t"})
	require.ErrorIs(t, err, reconcile.ErrInvalidRecovery)
	// Bad requests store nothing.
	for _, rec := range []reconcile.Recovery{
		{Expect: outbox.StateUncertain, To: outbox.StateConfirmed},
		{Expect: outbox.StateUncertain, To: outbox.StateRejected},                                // no reason
		{Expect: outbox.StateUncertain, To: outbox.StateAccepted, NotReached: true, Reason: "x"}, // not-reached to accepted
	} {
		_, err := reconcile.Recover(r.Ctx, r.Pool, r.Outbox, unc[0].id, rec)
		require.ErrorIs(t, err, reconcile.ErrInvalidRecovery, "%+v", rec)
	}

	// The first recovery lands; a second, expecting uncertain, is refused
	// with the current state.
	it, err := reconcile.Recover(r.Ctx, r.Pool, r.Outbox, unc[0].id, reconcile.Recovery{Expect: outbox.StateUncertain,
		To: outbox.StatePending, NotReached: true, Reason: "the attempt log shows only 500s before recording", By: "token:ops"})
	require.NoError(t, err)
	require.Equal(t, outbox.StatePending, it.State)
	_, err = reconcile.Recover(r.Ctx, r.Pool, r.Outbox, unc[0].id, reconcile.Recovery{Expect: outbox.StateUncertain,
		To: outbox.StateRejected, Reason: "x", By: "token:ops"})
	var se *reconcile.ExpectedStateError
	require.ErrorAs(t, err, &se)
	require.Equal(t, outbox.StatePending, se.Current)

	// A stale lease token (the item was reviewed under another lease).
	old := int64(0)
	_, err = reconcile.Recover(r.Ctx, r.Pool, r.Outbox, unc[1].id, reconcile.Recovery{Expect: outbox.StateUncertain,
		To: outbox.StateAccepted, LeaseToken: &old, By: "token:ops"})
	require.ErrorAs(t, err, &se)
	require.True(t, se.Moved)
	require.Equal(t, outbox.StateUncertain, r.states(t)[unc[1].id])

	entries, err := audit.List(r.Ctx, r.Pool, audit.Item(unc[0].id), 10)
	require.NoError(t, err)
	require.Len(t, entries, 1, "refusals are not actions")
	require.Equal(t, "token:ops", entries[0].Actor)
	require.Equal(t, true, entries[0].Details["not_reached"])
	empty, err := audit.List(r.Ctx, r.Pool, audit.Item(unc[1].id), 10)
	require.NoError(t, err)
	require.Empty(t, empty)
}

func TestSettleDelayIsRespected(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 1)
	r.deliverAll(t)
	run, ds := r.run(t, reconcile.Options{Settle: reconcile.DefaultSettle})
	require.Empty(t, ds)
	require.Zero(t, run.KeysTotal, "nothing accepted two hours ago")
	require.Zero(t, r.counts(t)[outbox.StateConfirmed])
	require.Zero(t, r.summaryReads(), "no summary was read")
	require.Zero(t, r.metersReads(), "no key: no account's meters are read")

	run, _ = r.run(t, reconcile.Options{Settle: settled})
	require.Positive(t, run.ItemsConfirmed)
	require.Zero(t, r.counts(t)[outbox.StateAccepted])
}

func TestPaginationAcrossManyHours(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	const hours = 250 // three pages of 100 summaries
	for h := 0; h < hours; h++ {
		r.MustIngest(t, stagetest.Ev(fmt.Sprintf("a%d", h), "t3", "api", int64(h+1), stagetest.Ago(time.Duration(3+h)*time.Hour)))
	}
	r.deliverAll(t)
	run, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds)
	require.Equal(t, int64(hours), run.ItemsConfirmed)
	require.Equal(t, hours, run.HoursMatched)
	pages := r.summaryReads()
	require.Equal(t, 3, pages)
	require.Equal(t, 1+pages, run.StripeCalls)
}

// A run stopped mid-way (its context cancelled, as a shutdown does) is
// interrupted; resumed, it continues after its last key. A run whose worker
// died (no heartbeat) is taken over. Either way the items end as an
// uninterrupted run leaves them.
func TestInterruptedRunsResumeOrRerunToTheSameEnd(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 2)
	r.deliverAll(t)
	all := r.items(t, outbox.StateAccepted)
	drop := all[len(all)/2]
	require.True(t, r.sim.DropEvent(stripesim.DefaultAccount, drop.identifier))

	id, err := reconcile.Queue(r.Ctx, r.Pool, reconcile.TriggerAPI, "test", reconcile.Options{Settle: settled})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(r.Ctx)
	go func() {
		for ctx.Err() == nil {
			if run, err := reconcile.Get(r.Ctx, r.Pool, id); err == nil && run.KeysDone >= 5 {
				cancel()
			}
			time.Sleep(time.Millisecond)
		}
	}()
	// A slow limiter (20 calls a second) so that the cancel lands mid-run.
	run, err := r.reconciler(t, 20).Work(ctx, r.Pool, id)
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, "interrupted", run.Status)
	require.Less(t, run.KeysDone, run.KeysTotal)
	done := run.KeysDone

	// Resume: the same run goes on from its cursor.
	run, err = r.rec.Work(r.Ctx, r.Pool, id)
	require.NoError(t, err)
	require.Equal(t, "succeeded", run.Status)
	require.Equal(t, 30, run.KeysDone)
	require.Equal(t, 30, run.KeysTotal)
	require.Equal(t, 1, run.Discrepancies)
	require.Greater(t, done, 0)
	wantEnd := r.states(t)
	for _, it := range all {
		want := outbox.StateConfirmed
		if it.event == drop.event && it.cust == drop.cust && it.hour.Equal(drop.hour) {
			want = outbox.StateAccepted
		}
		require.Equal(t, want, wantEnd[it.id], "item %d", it.id)
	}

	// A run whose process died: running, its heartbeat stale. A new run
	// takes over (the dead one is marked interrupted) and changes nothing
	// more: the end state is the same.
	dead, err := reconcile.Queue(r.Ctx, r.Pool, reconcile.TriggerSchedule, "schedule", reconcile.Options{Settle: settled})
	require.NoError(t, err)
	_, err = r.Pool.Exec(r.Ctx, `UPDATE reconcile_runs SET status = 'running', started_at = now(), heartbeat_at = now() - interval '1 hour' WHERE id = $1`, dead)
	require.NoError(t, err)
	rerun, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Len(t, ds, 1)
	require.Equal(t, wantEnd, r.states(t))
	deadRun, err := reconcile.Get(r.Ctx, r.Pool, dead)
	require.NoError(t, err)
	require.Equal(t, "interrupted", deadRun.Status)
	require.Equal(t, "no_heartbeat", deadRun.ErrorCode)
	require.Greater(t, rerun.ID, dead)

	// While one runs, another is refused.
	live, err := reconcile.Queue(r.Ctx, r.Pool, reconcile.TriggerAPI, "test", reconcile.Options{Settle: settled})
	require.NoError(t, err)
	_, err = r.Pool.Exec(r.Ctx, `UPDATE reconcile_runs SET status = 'running', started_at = now(), heartbeat_at = now() WHERE id = $1`, live)
	require.NoError(t, err)
	_, err = r.rec.RunNow(r.Ctx, r.Pool, reconcile.TriggerCommand, "test", reconcile.Options{Settle: settled})
	require.ErrorIs(t, err, reconcile.ErrRunning)
	require.True(t, slices.Contains([]string{"running"}, func() string { run, _ := reconcile.Get(r.Ctx, r.Pool, live); return run.Status }()))
}

// Stripe's reads fail now and then (429, 500): the run reads again with
// backoff and ends as it would have. When they keep failing, the run fails
// visibly — its error a code and a status — having confirmed only what it
// proved.
func TestTransientReadFailuresAreRetried(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 2)
	r.deliverAll(t)
	accepted := r.counts(t)[outbox.StateAccepted]

	r.sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{ReadFault: 1}})
	run, err := r.reconcilerRetrying(t, 1000, 100*time.Millisecond).RunNow(r.Ctx, r.Pool, reconcile.TriggerCommand, "test",
		reconcile.Options{Settle: settled})
	require.Error(t, err)
	require.Equal(t, "failed", run.Status)
	require.Contains(t, []string{"api_error", "rate_limit"}, run.ErrorCode)
	require.Zero(t, run.ItemsConfirmed)
	require.Equal(t, accepted, r.counts(t)[outbox.StateAccepted])

	r.sim.ConfigureDefault(stripesim.Limits{Faults: stripesim.Faults{ReadFault: 0.3}})
	run, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds)
	require.Equal(t, accepted, run.ItemsConfirmed)
	require.Greater(t, run.StripeCalls, 31, "some reads were made again")
}
