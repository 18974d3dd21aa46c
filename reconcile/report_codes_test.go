package reconcile_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// The codes of the current enum: a missing value key, reported as
// meter_event_invalid_value, and a missing dimension key quarantine their
// items payload_keys (a mapping fix cures them); a sample coded
// duplicate_meter_event says Stripe has the event, so it is evidence and
// fails nothing, whether the item is accepted or still in flight.
func TestReportCodesOfTheCurrentEnum(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	r.ingestMix(t, 1)
	r.deliverAll(t)
	all := r.items(t, outbox.StateAccepted)
	require.GreaterOrEqual(t, len(all), 3)
	noValueKey, noDimension, duplicate := all[0], all[1], all[2]

	rep := stripeapi.MeterErrorReport{ID: "evt_test_codes", Type: stripeapi.EventMeterErrorReport, Created: time.Now(),
		ErrorCount: 3, Samples: []stripeapi.MeterErrorSample{
			{Identifier: noValueKey.identifier, Code: "meter_event_invalid_value", Message: "Value key value not found in payload."},
			{Identifier: noDimension.identifier, Code: "missing_dimension_payload_keys", Message: "Missing dimension keys"},
			{Identifier: duplicate.identifier, Code: "duplicate_meter_event", Message: "A meter event with a duplicate identifier has already been submitted."},
		}}
	res, err := reconcile.RecordReport(r.Ctx, r.Pool, r.Outbox, rep)
	require.NoError(t, err)
	require.Equal(t, reconcile.ReportResult{Recorded: true, Failed: 2, EvidenceOnly: 1}, res)
	for _, id := range []int64{noValueKey.id, noDimension.id} {
		it := r.item(t, id)
		require.Equal(t, outbox.StateQuarantined, it.State)
		require.Equal(t, outbox.ReasonPayloadKeys, it.QuarantineReason)
	}
	require.Equal(t, outbox.StateAccepted, r.item(t, duplicate.id).State, "a duplicate is no failure")
	ev, err := reconcile.EvidenceOf(r.Ctx, r.Pool, []int64{duplicate.id})
	require.NoError(t, err)
	require.Len(t, ev, 1, "the sample stays as evidence")
	r.holds(t)
}
