package reconcile_test

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// foreign sends a meter event straight to the simulator, as another
// integration sending to the same meter and customer would (a script, a
// replayed import): Tally has no item of it.
func (r *rig) foreign(t *testing.T, id, event, customer string, value int64, at time.Time) {
	t.Helper()
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: r.base})
	require.NoError(t, err)
	_, err = client.Stripe().V1BillingMeterEvents.Create(r.Ctx, &stripe.BillingMeterEventCreateParams{
		EventName: stripe.String(event), Identifier: stripe.String(id), Timestamp: stripe.Int64(at.Unix()),
		Payload: map[string]string{"stripe_customer_id": customer, "value": strconv.FormatInt(value, 10)}})
	require.NoError(t, err)
}

// open reads every open discrepancy, checking that the counts by kind
// and the first ones agree, and returns them.
func (r *rig) open(t *testing.T) []reconcile.Discrepancy {
	t.Helper()
	ds, err := reconcile.OpenDiscrepancies(r.Ctx, r.Pool)
	require.NoError(t, err)
	counts, err := reconcile.OpenCounts(r.Ctx, r.Pool)
	require.NoError(t, err)
	want := map[string]int64{}
	for _, k := range reconcile.Kinds {
		want[k] = 0
	}
	for _, d := range ds {
		require.True(t, d.Open(), "%+v", d)
		want[d.Kind]++
	}
	require.Equal(t, want, counts)
	_, listed, err := reconcile.ListDiscrepancies(r.Ctx, r.Pool, 0, reconcile.StatusOpen)
	require.NoError(t, err)
	require.Equal(t, ds, listed, "the default list is the open discrepancies of every run")
	for _, limit := range []int{1, len(ds) + 1} {
		first, err := reconcile.FirstOpen(r.Ctx, r.Pool, limit)
		require.NoError(t, err)
		require.Equal(t, ds[:min(limit, len(ds))], first, "the first %d open ones", limit)
	}
	return ds
}

// summaryReadsOf counts the simulator's event summary calls for customer.
func (r *rig) summaryReadsOf(customer string) int {
	n := 0
	for _, req := range r.sim.Requests() {
		if strings.HasSuffix(req.Path, "/event_summaries") && req.Form.Get("customer") == customer {
			n++
		}
	}
	return n
}

// oneHourOfT1 delivers t1's usage of one hour, 5 hours ago, of the sum meter
// (two events, 10 and 4) and the count meter (two), and runs: every item
// confirmed. It returns the hour and the run.
func oneHourOfT1(t *testing.T, r *rig) (time.Time, reconcile.Run) {
	t.Helper()
	hour := stagetest.Ago(5 * time.Hour).Truncate(time.Hour)
	at := func(min int) *time.Time { v := hour.Add(time.Duration(min) * time.Minute); return &v }
	r.MustIngest(t, stagetest.Ev("a1", "t1", "api", 10, at(5)), stagetest.Ev("a2", "t1", "api", 4, at(40)),
		stagetest.Ev("l1", "t1", "logins", 1, at(5)), stagetest.Ev("l2", "t1", "logins", 1, at(40)))
	r.deliverAll(t)
	run, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds)
	require.Equal(t, int64(3), run.ItemsConfirmed, "the sum window's item and two count events")
	require.Zero(t, r.counts(t)[outbox.StateAccepted])
	return hour, run
}

// itemsOf lists the ids of the items of event name event, ascending.
func (r *rig) itemsOf(t *testing.T, event string) []int64 {
	t.Helper()
	var ids []int64
	for _, it := range r.items(t, outbox.StateConfirmed, outbox.StateAccepted) {
		if it.event == event {
			ids = append(ids, it.id)
		}
	}
	return ids
}

// Over-billing in a confirmed hour: an event another integration sends to
// the meter and customer of an hour Tally confirmed makes the next run
// record a discrepancy where Stripe has more, with the items confirmed
// before, and without confirming or moving anything. It stays open — one
// for the hour, however many runs find it — until finance resolves it with
// a reason that fits (a credit in Stripe; a repost does not), which
// settles no item a second time; then nothing is open and the next runs
// record nothing.
func TestStripeHasMoreInAConfirmedHourStaysOpenUntilResolved(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	hour, _ := oneHourOfT1(t, r)
	api := r.itemsOf(t, "api")
	states := r.states(t)
	r.foreign(t, "other-integration-1", "api", "cus_t1", 3, hour.Add(20*time.Minute))

	run, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Len(t, ds, 1)
	d := ds[0]
	require.Equal(t, reconcile.KindStripeHasMore, d.Kind)
	require.Equal(t, reconcile.ReasonMismatch, d.Reason)
	require.True(t, hour.Equal(d.Hour))
	require.Equal(t, "api", d.EventName)
	require.Equal(t, "14", d.Expected)
	require.Equal(t, "17", *d.Provider)
	require.Equal(t, "3", *d.Difference)
	require.Equal(t, api, d.ExpectedItems)
	require.Equal(t, api, d.ConfirmedItems, "Stripe's number moved after the hour was confirmed")
	require.True(t, d.AfterConfirmation())
	require.Equal(t, "unexplained", d.Explanation)
	require.Equal(t, []string{"t1"}, d.Tenants)
	require.Equal(t, []string{"api"}, d.Features)
	require.Zero(t, run.ItemsConfirmed)
	require.Equal(t, 2, run.KeysTotal, "t1's two keys, every item confirmed, read again: the period is open")
	require.Equal(t, 2, run.HoursCompared)
	require.Equal(t, 1, run.HoursMatched, "the count hour still matches, and changes nothing")
	require.Equal(t, states, r.states(t), "nothing moves")
	require.Equal(t, []reconcile.Discrepancy{d}, r.open(t))

	// The next run finds it again: its own discrepancy is the open one,
	// the earlier one is cleared.
	again, ds2 := r.run(t, reconcile.Options{Settle: settled})
	require.Equal(t, findings(ds), findings(ds2))
	open := r.open(t)
	require.Len(t, open, 1)
	require.Equal(t, again.ID, open[0].RunID)
	first, err := reconcile.GetDiscrepancy(r.Ctx, r.Pool, d.ID)
	require.NoError(t, err)
	require.False(t, first.Open())
	require.Equal(t, again.ID, *first.ClearedByRun)

	// A repost does not answer Stripe having more.
	_, err = reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, open[0].ID, reconcile.Decision{Reason: reconcile.ResolvedReposted,
		Note: "posted again", By: "token:fiona"})
	require.ErrorIs(t, err, reconcile.ErrInvalidResolution)
	require.Contains(t, err.Error(), "Stripe has more")

	res, err := reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, open[0].ID, reconcile.Decision{Reason: reconcile.ResolvedCreditedInStripe,
		Note: "credited 3 calls on in_123", By: "token:fiona"})
	require.NoError(t, err)
	require.Empty(t, res.Resolution.SettledItems, "its items were confirmed before: none is confirmed again")
	require.Equal(t, states, r.states(t))
	require.Len(t, r.auditOf(t, open[0].ID), 1)
	require.Empty(t, r.open(t))

	third, ds3 := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds3, "the resolved numbers are not recorded again")
	require.Equal(t, 2, third.HoursCompared)
	require.Empty(t, r.open(t))
	r.holds(t)

	// Across runs, the resolved list has the discrepancy finance resolved,
	// though a later run compared its hour again; every list has it once.
	for _, st := range []reconcile.DiscrepancyStatus{reconcile.StatusResolved, reconcile.StatusAll} {
		_, listed, err := reconcile.ListDiscrepancies(r.Ctx, r.Pool, 0, st)
		require.NoError(t, err)
		require.Len(t, listed, 1, st)
		require.Equal(t, open[0].ID, listed[0].ID)
		require.Equal(t, third.ID, *listed[0].ClearedByRun)
		require.Equal(t, reconcile.ResolvedCreditedInStripe, listed[0].Resolution.Reason)
	}
}

// Stripe having less after confirmation: an event Stripe drops after the
// hour matched is a discrepancy of its own kind, naming the confirmed
// items, which stay confirmed (confirmed has no way back): nothing is
// undone.
func TestStripeHasLessAfterConfirmation(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	hour, _ := oneHourOfT1(t, r)
	logins := r.itemsOf(t, "logins")
	require.Len(t, logins, 2)
	var identifier string
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT identifier FROM outbox_items WHERE id = $1`, logins[1]).Scan(&identifier))
	require.True(t, r.sim.DropEvent(stripesim.DefaultAccount, identifier))
	states := r.states(t)

	_, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Len(t, ds, 1)
	d := ds[0]
	require.Equal(t, reconcile.KindStripeHasLess, d.Kind)
	require.True(t, hour.Equal(d.Hour))
	require.Equal(t, "logins", d.EventName)
	require.Equal(t, "2", d.Expected)
	require.Equal(t, "-1", *d.Difference)
	require.Equal(t, logins, d.ConfirmedItems)
	require.Equal(t, states, r.states(t), "the confirmed items stay confirmed")
	require.Len(t, r.open(t), 1)

	// A credit answers Stripe having more, not less.
	_, err := reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, d.ID, reconcile.Decision{Reason: reconcile.ResolvedCreditedInStripe,
		Note: "n", By: "test"})
	require.ErrorIs(t, err, reconcile.ErrInvalidResolution)
}

// An hour of an open period that Stripe has a number for and Tally has no
// item of is compared: Stripe has more, and the discrepancy, naming no
// item, is the tenant's and the feature's whose mappings name its
// customer and meter. A key Tally never sent anything to is not read (no
// run knows it).
func TestAnHourStripeHasAndTallyHasNoneOf(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	hour, _ := oneHourOfT1(t, r)
	// An hour of the same (calendar) period as t1's usage, without any.
	empty := hour.Add(time.Hour)
	if empty.Month() != hour.Month() {
		empty = hour.Add(-time.Hour)
	}
	r.foreign(t, "other-1", "api", "cus_t1", 7, empty.Add(10*time.Minute))
	r.foreign(t, "other-2", "api", "cus_t2", 9, hour.Add(10*time.Minute)) // t2 has nothing of api

	_, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Len(t, ds, 1, "%+v", ds)
	d := ds[0]
	require.Equal(t, reconcile.KindStripeHasMore, d.Kind)
	require.True(t, empty.Equal(d.Hour))
	require.Equal(t, "cus_t1", d.Customer)
	require.Equal(t, "0", d.Expected)
	require.Equal(t, "7", *d.Provider)
	require.Equal(t, "7", *d.Difference)
	require.Empty(t, d.ExpectedItems)
	require.Empty(t, d.ConfirmedItems)
	require.False(t, d.AfterConfirmation())
	require.Equal(t, []string{"t1"}, d.Tenants, "by the tenant mapping of its customer")
	require.Equal(t, []string{"api"}, d.Features, "by the feature mapping of its meter")
	require.Equal(t, []reconcile.Discrepancy{d}, r.open(t))

	rep := r.completenessOf(t, d.Hour)
	var more int64
	for _, l := range rep.Lines {
		if l.Tenant == "t1" && l.Feature == "api" {
			require.Equal(t, int64(1), l.Discrepancies)
			more = l.DiscrepanciesStripeHasMore
		}
	}
	require.Equal(t, int64(1), more, "the completeness report counts it on t1's api line")
}

// A closed period is not read again: once the tenant's invoice grace has
// passed after its period's end, its invoice is final, and a confirmed
// key of it is not listed (no summary read); the tenant mapping's grace,
// not the node's, decides. Reopened by a longer grace, it is read again.
func TestAClosedPeriodIsNotReadAgain(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	// t7's periods are anchored two hours ago: the period of its usage of
	// three hours ago ended then.
	anchor := stagetest.Ago(2 * time.Hour).Truncate(time.Second)
	grace := func(g time.Duration) {
		d := mappings.Duration(g)
		_, _, err := r.Maps.PutTenant(r.Ctx, r.Pool, "t7", mappings.TenantInput{StripeCustomerID: "cus_t7", PeriodAnchor: &anchor,
			InvoiceGrace: &d}, "test")
		require.NoError(t, err)
	}
	grace(testGrace)
	hour := stagetest.Ago(3 * time.Hour).Truncate(time.Hour)
	at := hour.Add(time.Minute)
	if !at.Before(anchor) {
		at = anchor.Add(-time.Minute)
	}
	r.MustIngest(t, stagetest.Ev("c1", "t7", "logins", 1, &at), stagetest.Ev("c2", "t3", "logins", 1, &at))
	r.deliverAll(t)
	_, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds)
	r.foreign(t, "other-7", "logins", "cus_t7", 1, at)
	r.foreign(t, "other-3", "logins", "cus_t3", 1, at)

	// Its grace of an hour passed an hour ago: t7's key is not read; t3's
	// (a calendar month, open) is.
	grace(time.Hour)
	before := r.summaryReadsOf("cus_t7")
	run, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Equal(t, 1, run.KeysTotal)
	require.Len(t, ds, 1)
	require.Equal(t, "cus_t3", ds[0].Customer)
	require.Equal(t, before, r.summaryReadsOf("cus_t7"), "no summary of the closed period is read")

	grace(testGrace)
	run, ds = r.run(t, reconcile.Options{Settle: settled})
	require.Equal(t, 2, run.KeysTotal)
	require.Len(t, ds, 2, "open again, t7's key is read and its over-count found")
}

// A discrepancy a later run clears — it compared the hour again and found
// it matching — is no longer open: every list, count and report of open
// discrepancies leaves it out, while the run that found it still lists it.
func TestAClearedDiscrepancyIsNoLongerOpen(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	hour := stagetest.Ago(4 * time.Hour).Truncate(time.Hour)
	at := hour.Add(10 * time.Minute)
	r.MustIngest(t, stagetest.Ev("l1", "t4", "logins", 1, &at), stagetest.Ev("l2", "t4", "logins", 1, &at))
	r.deliverAll(t)
	dropped := r.items(t, outbox.StateAccepted)[1]
	require.True(t, r.sim.DropEvent(stripesim.DefaultAccount, dropped.identifier))
	first, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Len(t, ds, 1)
	require.Equal(t, reconcile.KindStripeHasLess, ds[0].Kind)
	require.Len(t, r.open(t), 1)
	require.Equal(t, int64(1), r.completenessOf(t, hour).Lines[0].Discrepancies)

	// Stripe's count catches up (the event posted again by hand): the hour
	// matches, its items are confirmed, the discrepancy is cleared.
	r.foreign(t, "reposted-l2", "logins", "cus_t4", 1, at)
	second, ds2 := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds2)
	require.Equal(t, int64(2), second.ItemsConfirmed)
	require.Empty(t, r.open(t))
	require.Zero(t, r.completenessOf(t, hour).Lines[0].Discrepancies)
	d, err := reconcile.GetDiscrepancy(r.Ctx, r.Pool, ds[0].ID)
	require.NoError(t, err)
	require.False(t, d.Open())
	require.Nil(t, d.Resolution)
	require.Equal(t, second.ID, *d.ClearedByRun)
	_, ofFirst, err := reconcile.ListDiscrepancies(r.Ctx, r.Pool, first.ID, reconcile.StatusAll)
	require.NoError(t, err)
	require.Len(t, ofFirst, 1, "the run that found it lists it still")
	_, openOfFirst, err := reconcile.ListDiscrepancies(r.Ctx, r.Pool, first.ID, reconcile.StatusOpen)
	require.NoError(t, err)
	require.Empty(t, openOfFirst)
}

// A run interrupted after some of its keys resumes after the last one it
// committed: the keys before its cursor are not read again, the ones after
// are, and each key's discrepancies, clearings and open periods are
// committed once. A full run afterwards leaves one open discrepancy per
// hour, as runs that were never interrupted would.
func TestAResumedRunCommitsEachKeyOnce(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	hour := stagetest.Ago(4 * time.Hour).Truncate(time.Hour)
	at := hour.Add(10 * time.Minute)
	for _, tenant := range []string{"t0", "t5", "t9"} {
		r.MustIngest(t, stagetest.Ev("a-"+tenant, tenant, "api", 5, &at))
	}
	r.deliverAll(t)
	_, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds)
	for _, c := range []string{"cus_t0", "cus_t5", "cus_t9"} {
		r.foreign(t, "other-"+c, "api", c, 2, at)
	}

	// As a run killed after its first key leaves itself: interrupted, its
	// cursor past t0's key.
	id, err := reconcile.Queue(r.Ctx, r.Pool, reconcile.TriggerAPI, "test", reconcile.Options{Settle: settled})
	require.NoError(t, err)
	_, err = r.Pool.Exec(r.Ctx, `UPDATE reconcile_runs SET status = 'interrupted', started_at = now(), keys_done = 1,
		cursor = $2 WHERE id = $1`, id, stripesim.DefaultAccount+"|cus_t0|api")
	require.NoError(t, err)
	t0 := r.summaryReadsOf("cus_t0")
	run, err := r.rec.Work(r.Ctx, r.Pool, id)
	require.NoError(t, err)
	require.Equal(t, "succeeded", run.Status)
	require.Equal(t, 3, run.KeysDone)
	require.Equal(t, t0, r.summaryReadsOf("cus_t0"), "t0's key is before the cursor")
	resumed, err := reconcile.Discrepancies(r.Ctx, r.Pool, id)
	require.NoError(t, err)
	require.Len(t, resumed, 2)
	for _, d := range resumed {
		require.Equal(t, reconcile.KindStripeHasMore, d.Kind)
		require.NotEqual(t, "cus_t0", d.Customer)
	}
	_, err = r.rec.Work(r.Ctx, r.Pool, id)
	require.Error(t, err, "a succeeded run does not start again")

	full, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Len(t, ds, 3)
	open := r.open(t)
	require.Len(t, open, 3, "one per hour, across runs")
	for _, d := range open {
		require.Equal(t, full.ID, d.RunID)
	}
	var periods int
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM reconcile_key_periods`).Scan(&periods))
	require.Equal(t, 3, periods, "one open period of each key, noted once")
	var cleared int
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM reconcile_discrepancies WHERE cleared_by_run = $1`, full.ID).Scan(&cleared))
	require.Equal(t, 2, cleared, "the resumed run's two, cleared by the full run")
}

// completenessOf reads the completeness report of the month of hour, every
// tenant, and checks that it holds.
func (r *rig) completenessOf(t *testing.T, hour time.Time) quarantine.Completeness {
	t.Helper()
	rep, err := quarantine.CompletenessOf(r.Ctx, r.Pool, hour.Format("2006-01"), "")
	require.NoError(t, err)
	require.True(t, rep.Holds, "%+v", rep)
	return rep
}
