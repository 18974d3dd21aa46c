package reconcile_test

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// holds checks the conservation identity for every month the rig's usage
// falls in.
func (r *rig) holds(t *testing.T) {
	t.Helper()
	months := map[string]bool{}
	for _, it := range r.items(t, outbox.States...) {
		months[it.hour.Format("2006-01")] = true
	}
	require.NotEmpty(t, months)
	for m := range months {
		c, err := quarantine.CompletenessOf(r.Ctx, r.Pool, m, "")
		require.NoError(t, err)
		require.True(t, c.Holds, "conservation in %s: %+v", m, c)
	}
}

func (r *rig) item(t *testing.T, id int64) outbox.Item {
	t.Helper()
	it, err := r.Outbox.Get(r.Ctx, r.Pool, id)
	require.NoError(t, err)
	return it
}

// A report recorded for the first time moves the accepted items it names
// (T10) by their codes, records evidence only against items in other
// states, counts identifiers no item has, and keeps conservation; the same
// event again changes nothing.
func TestRecordReportFailsNamedAcceptedItemsOnce(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 1)
	r.deliverAll(t)
	all := r.items(t, outbox.StateAccepted)
	require.GreaterOrEqual(t, len(all), 5)
	noMeter, invalid, twoCodes, confirmed := all[0], all[1], all[2], all[3]
	_, _, err := r.Outbox.Confirm(r.Ctx, r.Pool, []int64{confirmed.id})
	require.NoError(t, err)
	confirmedBefore := r.item(t, confirmed.id)

	rep := stripeapi.MeterErrorReport{ID: "evt_test_t10", Type: stripeapi.EventMeterErrorReport, Created: time.Now(),
		Meter: "mtr_x", ErrorCount: 9, Samples: []stripeapi.MeterErrorSample{
			{Identifier: noMeter.identifier, Code: "no_meter", Message: "No active meter for event_name"},
			{Identifier: invalid.identifier, Code: "timestamp_too_far_in_past", Message: "Timestamp too far in the past"},
			{Identifier: twoCodes.identifier, Code: "archived_meter", Message: "The meter is archived"},
			{Identifier: twoCodes.identifier, Code: "timestamp_in_future", Message: "Timestamp in the future"},
			{Identifier: confirmed.identifier, Code: "no_meter"},
			{Identifier: "tly_someone_elses_event", Code: "no_meter"},
		}}
	res, err := reconcile.RecordReport(r.Ctx, r.Pool, r.Outbox, rep)
	require.NoError(t, err)
	require.Equal(t, reconcile.ReportResult{Recorded: true, Failed: 3, EvidenceOnly: 1, Unmatched: 1}, res)

	it := r.item(t, noMeter.id)
	require.Equal(t, outbox.StateQuarantined, it.State)
	require.Equal(t, outbox.ReasonMeterNotFound, it.QuarantineReason)
	require.Equal(t, "no_meter", it.LastError.Code)
	require.Equal(t, "No active meter for event_name", it.LastError.Message)
	it = r.item(t, invalid.id)
	require.Equal(t, outbox.StateRejected, it.State)
	require.Equal(t, "timestamp_too_far_in_past", it.LastError.Code)
	it = r.item(t, twoCodes.id)
	require.Equal(t, outbox.StateRejected, it.State, "a mapping fix would not cure the second code")
	require.Equal(t, "timestamp_in_future", it.LastError.Code)
	require.Equal(t, confirmedBefore, r.item(t, confirmed.id), "a confirmed item keeps its state: evidence only")
	ev, err := reconcile.EvidenceOf(r.Ctx, r.Pool, []int64{confirmed.id})
	require.NoError(t, err)
	require.Len(t, ev, 1)
	r.holds(t)

	// Delivered again: nothing moves twice, nothing is recorded twice.
	before := map[int64]outbox.Item{}
	for _, x := range all {
		before[x.id] = r.item(t, x.id)
	}
	res, err = reconcile.RecordReport(r.Ctx, r.Pool, r.Outbox, rep)
	require.NoError(t, err)
	require.Equal(t, reconcile.ReportResult{}, res)
	for _, x := range all {
		require.Equal(t, before[x.id], r.item(t, x.id))
	}
	var n int
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM meter_error_evidence`).Scan(&n))
	require.Equal(t, 6, n)

	// Another event naming an item already quarantined: evidence only.
	rep.ID = "evt_test_t10_again"
	rep.Samples = rep.Samples[:1]
	res, err = reconcile.RecordReport(r.Ctx, r.Pool, r.Outbox, rep)
	require.NoError(t, err)
	require.Equal(t, reconcile.ReportResult{Recorded: true, EvidenceOnly: 1}, res)
	require.Equal(t, before[noMeter.id], r.item(t, noMeter.id))
}

// A report of the other mode is evidence only: an identifier names one
// mode's item, and a test-mode report cannot fail a live item.
func TestRecordReportOfAnotherModeIsEvidenceOnly(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 1)
	r.deliverAll(t)
	it := r.items(t, outbox.StateAccepted)[0]
	res, err := reconcile.RecordReport(r.Ctx, r.Pool, r.Outbox, stripeapi.MeterErrorReport{ID: "evt_live", Livemode: true,
		Type: stripeapi.EventNoMeterFound, Created: time.Now(), ErrorCount: 1,
		Samples: []stripeapi.MeterErrorSample{{Identifier: it.identifier, Code: "no_meter"}}})
	require.NoError(t, err)
	require.Equal(t, reconcile.ReportResult{Recorded: true, EvidenceOnly: 1}, res)
	require.Equal(t, outbox.StateAccepted, r.item(t, it.id).State)
}

// A report's samples are a sample. The item it names leaves accepted (the
// simulator's "dropped" is no code Tally knows: quarantined
// provider_refused, for a human), so its hour reconciles on the rest; an
// event Stripe dropped that no report names stays accepted, and the
// reconciler finds its hour as a discrepancy.
func TestReportedDropsAreRejectedAndUnreportedOnesAreDiscrepancies(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 2)
	r.deliverAll(t)
	var api []itemRef
	for _, it := range r.items(t, outbox.StateAccepted) {
		if it.event == "api" {
			api = append(api, it)
		}
	}
	reported, unreported := api[0], api[len(api)-1]
	require.False(t, reported.cust == unreported.cust && reported.hour.Equal(unreported.hour))
	require.True(t, r.sim.DropEvent(stripesim.DefaultAccount, reported.identifier))
	require.True(t, r.sim.DropEvent(stripesim.DefaultAccount, unreported.identifier))

	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: r.base})
	require.NoError(t, err)
	reps := r.sim.ErrorReports(stripesim.DefaultAccount)
	require.Len(t, reps, 2)
	for _, rep := range reps {
		if rep.Identifiers[0] != reported.identifier {
			continue // not in the sample Tally received
		}
		full, err := client.MeterErrorEvent(r.Ctx, rep.ID)
		require.NoError(t, err)
		res, err := reconcile.RecordReport(r.Ctx, r.Pool, r.Outbox, full)
		require.NoError(t, err)
		require.Equal(t, reconcile.ReportResult{Recorded: true, Failed: 1}, res)
	}
	it := r.item(t, reported.id)
	require.Equal(t, outbox.StateQuarantined, it.State)
	require.Equal(t, outbox.ReasonProviderRefused, it.QuarantineReason)
	require.Equal(t, stripesim.CodeDropped, it.LastError.Code)

	_, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Len(t, ds, 1)
	require.Equal(t, unreported.cust, ds[0].Customer)
	require.True(t, unreported.hour.Equal(ds[0].Hour))
	require.Contains(t, ds[0].ExpectedItems, unreported.id)
	require.Empty(t, ds[0].ReportedItems)
	states := r.states(t)
	require.Equal(t, outbox.StateAccepted, states[unreported.id])
	require.Equal(t, outbox.StateQuarantined, states[reported.id])
	for _, x := range r.items(t, outbox.StateAccepted) {
		require.True(t, x.cust == unreported.cust && x.event == unreported.event && x.hour.Equal(unreported.hour),
			"only the unreported drop's hour stays accepted: %+v", x)
	}
	r.holds(t)
}

// The same event delivered twice at once: one delivery records it and moves
// the items, the other waits for it and changes nothing.
func TestRecordReportConcurrentDeliveriesMoveOnce(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 1)
	r.deliverAll(t)
	all := r.items(t, outbox.StateAccepted)
	rep := stripeapi.MeterErrorReport{ID: "evt_test_twice", Type: stripeapi.EventMeterErrorReport, Created: time.Now(), ErrorCount: 10}
	for _, it := range all[:10] {
		rep.Samples = append(rep.Samples, stripeapi.MeterErrorSample{Identifier: it.identifier, Code: "meter_event_customer_not_found"})
	}
	results := make([]reconcile.ReportResult, 4)
	errs := make([]error, len(results))
	var wg sync.WaitGroup
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = reconcile.RecordReport(r.Ctx, r.Pool, r.Outbox, rep)
		}()
	}
	wg.Wait()
	recorded, failed := 0, 0
	for i := range results {
		require.NoError(t, errs[i])
		if results[i].Recorded {
			recorded++
		}
		failed += results[i].Failed
	}
	require.Equal(t, 1, recorded)
	require.Equal(t, 10, failed)
	for _, it := range all[:10] {
		got := r.item(t, it.id)
		require.Equal(t, outbox.StateQuarantined, got.State)
		require.Equal(t, outbox.ReasonCustomerNotFound, got.QuarantineReason)
	}
	r.holds(t)
}

// A report that overtakes the answer to its request — it names items that
// are still leased, once by the event identifier and once by the request's
// per-attempt Idempotency-Key, as Stripe's samples may — is recorded as
// evidence and noted, and the accept recorded afterwards lands where the
// report says. Before, the accept ignored it and the items stayed accepted
// for good with nothing counted at Stripe.
func TestReportWhileLeasedTakesEffectAtTheAccept(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 1)
	r.Pass(t)
	leases, err := r.Outbox.Claim(r.Ctx, r.Pool, outbox.ClaimOptions{Owner: "test", Limit: 3})
	require.NoError(t, err)
	require.Len(t, leases, 3)
	byKey, byIdentifier, untouched := leases[0], leases[1], leases[2]

	rep := stripeapi.MeterErrorReport{ID: "evt_overtaken", Type: stripeapi.EventMeterErrorReport, Created: time.Now(), ErrorCount: 2,
		Samples: []stripeapi.MeterErrorSample{
			{Identifier: exporter.IdempotencyKey(byKey.Identifier, byKey.Attempts), Code: "meter_event_customer_not_found", Message: "No such customer"},
			{Identifier: byIdentifier.Identifier, Code: "timestamp_too_far_in_past", Message: "Timestamp too far in the past"},
		}}
	res, err := reconcile.RecordReport(r.Ctx, r.Pool, r.Outbox, rep)
	require.NoError(t, err)
	require.Equal(t, reconcile.ReportResult{Recorded: true, Noted: 2}, res)
	require.Equal(t, outbox.StateLeased, r.item(t, byKey.ID).State, "the report does not take the lease away")

	outcomes := make([]outbox.Outcome, len(leases))
	for i, l := range leases {
		outcomes[i] = outbox.Outcome{Lease: l, Kind: outbox.Accepted, ProviderRef: "req_x"}
	}
	_, err = r.Outbox.Record(r.Ctx, r.Pool, outcomes)
	require.NoError(t, err)

	it := r.item(t, byKey.ID)
	require.Equal(t, outbox.StateQuarantined, it.State)
	require.Equal(t, outbox.ReasonCustomerNotFound, it.QuarantineReason)
	require.Equal(t, it.Attempts, it.RefusedAttempts, "proven unrecorded: a requeue re-addresses it")
	it = r.item(t, byIdentifier.ID)
	require.Equal(t, outbox.StateRejected, it.State)
	require.Equal(t, "timestamp_too_far_in_past", it.LastError.Code)
	require.Equal(t, outbox.StateAccepted, r.item(t, untouched.ID).State)
	ev, err := reconcile.EvidenceOf(r.Ctx, r.Pool, []int64{byKey.ID, byIdentifier.ID})
	require.NoError(t, err)
	require.Len(t, ev, 2, "the evidence names the items by their identifiers")
	for _, e := range ev {
		require.Contains(t, []string{byKey.Identifier, byIdentifier.Identifier}, e.Identifier)
	}
	r.holds(t)
}
