package reconcile_test

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// droppedRun delivers three hours of usage, drops four events at Stripe,
// of sums and counts, each in an hour of its own, and runs: four
// discrepancies.
func droppedRun(t *testing.T) (*rig, reconcile.Run, []reconcile.Discrepancy, []itemRef) {
	t.Helper()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 3)
	r.deliverAll(t)
	all := r.items(t, outbox.StateAccepted)
	r.dropInHoursOfTheirOwn(t, all, 4)
	run, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Len(t, ds, 4)
	return r, run, ds, all
}

// dropInHoursOfTheirOwn drops n events at Stripe, alternately of the sum
// and the count meter, no two in one hour of one key: each is a
// discrepancy of its own, whatever the time of day the test runs at.
func (r *rig) dropInHoursOfTheirOwn(t *testing.T, all []itemRef, n int) {
	t.Helper()
	seen := map[droppedHour]bool{}
	for pass := 0; len(seen) < n && pass < n; pass++ {
		for _, event := range []string{"api", "logins"} {
			for _, it := range all {
				h := droppedHour{it.event, it.cust, it.hour}
				if len(seen) == n || it.event != event || seen[h] {
					continue
				}
				require.True(t, r.sim.DropEvent(stripesim.DefaultAccount, it.identifier))
				seen[h] = true
				break
			}
		}
	}
	require.Len(t, seen, n)
}

// auditOf lists the audit entries of discrepancy id.
func (r *rig) auditOf(t *testing.T, id int64) []audit.Entry {
	t.Helper()
	es, err := audit.List(r.Ctx, r.Pool, reconcile.Subject(id), 10)
	require.NoError(t, err)
	return es
}

// A resolution that cannot be asked for, of a discrepancy that does not
// exist, or of one whose items moved since the run changes nothing: no
// item moves, nothing is resolved or audited.
func TestResolveRefusalsChangeNothing(t *testing.T) {
	t.Parallel()
	r, run, ds, all := droppedRun(t)
	d := ds[0]
	before := r.states(t)
	for _, c := range []struct {
		name string
		id   int64
		dec  reconcile.Decision
		want error
	}{
		{"unknown reason", d.ID, reconcile.Decision{Reason: "waived", Note: "n", By: "test"}, reconcile.ErrInvalidResolution},
		{"no note", d.ID, reconcile.Decision{Reason: reconcile.ResolvedAcceptTally, Note: " \t", By: "test"}, reconcile.ErrInvalidResolution},
		{"no such discrepancy", d.ID + 1000, reconcile.Decision{Reason: reconcile.ResolvedAcceptTally, Note: "n", By: "test"}, reconcile.ErrDiscrepancyNotFound},
	} {
		_, err := reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, c.id, c.dec)
		require.ErrorIs(t, err, c.want, c.name)
		require.Empty(t, r.auditOf(t, d.ID), c.name)
	}
	require.Equal(t, before, r.states(t))

	// Stripe's reports of the drops arrive: the dropped items leave
	// accepted (T10), and the discrepancies' numbers are no longer what
	// was reviewed.
	reported := r.recordErrorReports(t, all)
	require.Len(t, reported, 4)
	before = r.states(t)
	for _, d := range ds {
		_, err := reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, d.ID, reconcile.Decision{Reason: reconcile.ResolvedReposted, Note: "n", By: "test"})
		var moved *reconcile.ItemsMovedError
		require.ErrorAs(t, err, &moved)
		require.Equal(t, d.ID, moved.Discrepancy)
		require.Len(t, moved.Items, 1)
		for id, state := range moved.Items {
			require.True(t, reported[id], "item %d", id)
			require.Equal(t, outbox.StateQuarantined, state)
		}
		require.Contains(t, err.Error(), "run reconcile again")
		require.Empty(t, r.auditOf(t, d.ID))
	}
	require.Equal(t, before, r.states(t))
	open, err := reconcile.Discrepancies(r.Ctx, r.Pool, run.ID)
	require.NoError(t, err)
	for _, d := range open {
		require.True(t, d.Open(), "%+v", d)
	}
}

// A later run that found other numbers for the hour supersedes a
// discrepancy: it is the later one finance resolves.
func TestResolveRefusesADiscrepancyALaterRunSuperseded(t *testing.T) {
	t.Parallel()
	r, _, ds, _ := droppedRun(t)
	later, err := reconcile.Queue(r.Ctx, r.Pool, reconcile.TriggerAPI, "test", reconcile.Options{})
	require.NoError(t, err)
	d := ds[0]
	_, err = r.Pool.Exec(r.Ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name, meter,
			customer, hour, formula, expected, provider, difference, expected_items, uncertain_items, explained_by, explanation)
		SELECT $1, destination_account, mode, event_name, meter, customer, hour, formula, expected + 1, provider, difference - 1,
			expected_items, uncertain_items, explained_by, explanation
		FROM reconcile_discrepancies WHERE id = $2`, later, d.ID)
	require.NoError(t, err)
	before := r.states(t)
	_, err = reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, d.ID, reconcile.Decision{Reason: reconcile.ResolvedAcceptTally, Note: "n", By: "test"})
	require.ErrorIs(t, err, reconcile.ErrSuperseded)
	require.Equal(t, before, r.states(t))

	// Another of the run's discrepancies is not superseded.
	_, err = reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, ds[1].ID, reconcile.Decision{Reason: reconcile.ResolvedAcceptTally, Note: "n", By: "test"})
	require.NoError(t, err)
}

// Each reason that answers Stripe having less resolves a discrepancy: its
// accepted items are confirmed, the resolution names who, when and
// why and is audited in the same transaction, conservation holds, the
// completeness report no longer counts it, and the next run does not
// report it again. A credit in Stripe answers Stripe having more, not
// less: refused, it changes nothing.
func TestResolvingWithEachReasonSettlesAuditsAndIsNotReportedAgain(t *testing.T) {
	t.Parallel()
	r, run, ds, _ := droppedRun(t)
	months := map[string]bool{}
	for _, d := range ds {
		months[d.Hour.Format("2006-01")] = true
		require.Equal(t, reconcile.KindStripeHasLess, d.Kind)
	}
	require.Equal(t, int64(4), r.completenessDiscrepancies(t, months, run.ID))

	before := r.states(t)
	_, err := reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, ds[0].ID, reconcile.Decision{Reason: reconcile.ResolvedCreditedInStripe,
		Note: "credit note CN-0", By: "token:fiona"})
	require.ErrorIs(t, err, reconcile.ErrInvalidResolution)
	require.Contains(t, err.Error(), "Stripe has less")
	require.Empty(t, r.auditOf(t, ds[0].ID))
	require.Equal(t, before, r.states(t))

	reasons := []reconcile.ResolutionReason{reconcile.ResolvedReposted, reconcile.ResolvedAcceptStripe, reconcile.ResolvedAcceptTally,
		reconcile.ResolvedReposted}
	require.Len(t, reasons, len(ds))
	for i, reason := range reasons {
		d := ds[i]
		t.Run(fmt.Sprintf("%s/%d", reason, i), func(t *testing.T) {
			tenant := "t" + strings.TrimPrefix(d.Customer, "cus_t")
			require.Equal(t, []string{tenant}, d.Tenants)
			require.Equal(t, []string{d.EventName}, d.Features, "each feature is mapped to the meter of its name")
			note := fmt.Sprintf("credit note CN-%d for the difference", i)

			got, err := reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, d.ID, reconcile.Decision{Reason: reason, Note: note, By: "token:fiona"})
			require.NoError(t, err)
			require.NotNil(t, got.Resolution)
			require.Equal(t, reason, got.Resolution.Reason)
			require.Equal(t, note, got.Resolution.Note)
			require.Equal(t, "token:fiona", got.Resolution.By)
			require.Equal(t, d.ID, got.Resolution.Discrepancy)
			require.WithinDuration(t, time.Now(), got.Resolution.At, time.Minute)
			require.ElementsMatch(t, d.ExpectedItems, got.Resolution.SettledItems, "every counted item was accepted: the hour matched nowhere")
			states := r.states(t)
			for _, id := range d.ExpectedItems {
				require.Equal(t, outbox.StateConfirmed, states[id], "item %d", id)
			}
			r.holds(t)

			es := r.auditOf(t, d.ID)
			require.Len(t, es, 1)
			require.Equal(t, reconcile.ActionResolve, es[0].Action)
			require.Equal(t, "token:fiona", es[0].Actor)
			require.Equal(t, "open", es[0].From)
			require.Equal(t, string(reason), es[0].To)
			require.Equal(t, note, es[0].Reason)

			_, err = reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, d.ID, reconcile.Decision{Reason: reason, Note: note, By: "token:fiona"})
			require.ErrorIs(t, err, reconcile.ErrResolved)
			require.Len(t, r.auditOf(t, d.ID), 1)
		})
	}
	require.Zero(t, r.completenessDiscrepancies(t, months, run.ID), "resolved discrepancies are not finance's work")
	_, open, err := reconcile.ListDiscrepancies(r.Ctx, r.Pool, 0, reconcile.StatusOpen)
	require.NoError(t, err)
	require.Empty(t, open)
	_, resolved, err := reconcile.ListDiscrepancies(r.Ctx, r.Pool, run.ID, reconcile.StatusResolved)
	require.NoError(t, err)
	require.Len(t, resolved, 4)

	r.nextRunFindsAndCountsNothing(t)
	r.holds(t)
}

// nextRunFindsAndCountsNothing runs a reconciler whose metrics are read:
// it records no discrepancy and counts none for the alert.
func (r *rig) nextRunFindsAndCountsNothing(t *testing.T) {
	t.Helper()
	reg := prometheus.NewRegistry()
	rec, err := reconcile.New(reconcile.Config{Outbox: r.Outbox, Key: stripesim.DefaultKey, APIBase: r.base,
		Destination: func() (exporter.Destination, error) {
			return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: stripesim.DefaultAccount, Mode: outbox.ModeTest}, nil
		}, Limiter: exporter.NewLimiter(1000), Registry: reg})
	require.NoError(t, err)
	again, err := rec.RunNow(r.Ctx, r.Pool, reconcile.TriggerCommand, "test", reconcile.Options{Settle: settled})
	require.NoError(t, err)
	ds2, err := reconcile.Discrepancies(r.Ctx, r.Pool, again.ID)
	require.NoError(t, err)
	require.Empty(t, ds2, "resolved hours are not reported again")
	require.Zero(t, again.Discrepancies)
	found, err := testutil.GatherAndCount(reg, "tally_reconcile_discrepancies_total")
	require.NoError(t, err)
	require.Equal(t, 1, found)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP tally_reconcile_discrepancies_total Discrepancies found: hours where Stripe's summary and Tally's accepted items differ, and keys whose summaries Stripe refused (a customer or meter it does not know). A rerun finds an unresolved one again; numbers finance resolved are not counted again.
# TYPE tally_reconcile_discrepancies_total counter
tally_reconcile_discrepancies_total 0
`), "tally_reconcile_discrepancies_total"))
}

// Numbers finance resolved are not recorded again by a later run that
// finds them; once they change again (late usage of the hour), the hour
// is a new discrepancy.
func TestResolvedNumbersAreNotRecordedAgainUntilTheyChange(t *testing.T) {
	t.Parallel()
	r, _, ds, _ := droppedRun(t)
	i := slices.IndexFunc(ds, func(d reconcile.Discrepancy) bool { return d.Formula == "sum" })
	require.GreaterOrEqual(t, i, 0)
	d := ds[i]

	// A late event of the hour, delivered: a new accepted item, and both
	// Tally's number and Stripe's grow by its value.
	tenant := d.Tenants[0]
	ts := d.Hour.Add(59 * time.Minute)
	r.MustIngest(t, stagetest.Ev("late-1", tenant, "api", 7, &ts))
	r.deliverAll(t)
	_, err := reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, d.ID, reconcile.Decision{Reason: reconcile.ResolvedAcceptStripe, Note: "written off", By: "test"})
	require.NoError(t, err)

	_, ds2 := r.run(t, reconcile.Options{Settle: settled})
	var found *reconcile.Discrepancy
	for k := range ds2 {
		require.False(t, ds2[k].Expected == d.Expected && ds2[k].Hour.Equal(d.Hour) && ds2[k].Customer == d.Customer && ds2[k].EventName == d.EventName)
		if ds2[k].Hour.Equal(d.Hour) && ds2[k].Customer == d.Customer && ds2[k].EventName == d.EventName {
			found = &ds2[k]
		}
	}
	require.NotNil(t, found, "the hour's numbers changed: it is a discrepancy again")
	require.True(t, found.Open())
	require.Equal(t, *d.Difference, *found.Difference, "the same event is still missing")
	r.holds(t)
}

// findings are discrepancies without what names their record (id, run):
// what two runs that found the same things agree on.
func findings(ds []reconcile.Discrepancy) []reconcile.Discrepancy {
	out := slices.Clone(ds)
	for i := range out {
		out[i].ID, out[i].RunID = 0, 0
	}
	return out
}

// A resolution covers the same numbers of the hour found by another run:
// resolving the first run's discrepancy resolves the second's too. Of
// resolutions of one discrepancy at once, one wins; the others are told
// it is resolved and change nothing.
func TestAResolutionCoversTheSameNumbersInEveryRunAndWinsOnce(t *testing.T) {
	t.Parallel()
	r, _, ds, _ := droppedRun(t)
	second, ds2 := r.run(t, reconcile.Options{Settle: settled})
	require.Equal(t, findings(ds), findings(ds2))

	const n = 5
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Half on the first run's discrepancy, half on the second's.
			id := ds[0].ID
			if i%2 == 1 {
				id = ds2[0].ID
			}
			_, err := reconcile.Resolve(r.Ctx, r.Pool, r.Outbox, id, reconcile.Decision{Reason: reconcile.ResolvedAcceptTally,
				Note: fmt.Sprintf("resolver %d", i), By: "test"})
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	won := 0
	for err := range errs {
		if err == nil {
			won++
			continue
		}
		require.ErrorIs(t, err, reconcile.ErrResolved)
	}
	require.Equal(t, 1, won)
	var entries int
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM audit_log WHERE action = $1`, reconcile.ActionResolve).Scan(&entries))
	require.Equal(t, 1, entries)

	for _, id := range []int64{ds[0].ID, ds2[0].ID} {
		d, err := reconcile.GetDiscrepancy(r.Ctx, r.Pool, id)
		require.NoError(t, err)
		require.False(t, d.Open(), "discrepancy %d", id)
	}
	_, open, err := reconcile.ListDiscrepancies(r.Ctx, r.Pool, 0, reconcile.StatusOpen)
	require.NoError(t, err)
	require.Len(t, open, len(ds)-1, "the latest run's other discrepancies are open")
	require.Equal(t, second.ID, open[0].RunID)
	r.holds(t)
}
