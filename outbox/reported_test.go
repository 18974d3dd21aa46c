package outbox_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// An error report that overtakes the answer to its request — it arrives
// while the item is still leased — is noted, and the accept recorded
// afterwards lands where the report says: quarantined with its reason and
// error, not accepted for good with nothing counted. The item was sent once,
// so the report proves Stripe recorded nothing of it: every attempt counts
// as refused, and a requeue may re-address it.
func TestAcceptAfterAReportLandsWhereTheReportSays(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, newItem(1), newItem(2))
	leases := b.claim(t, outbox.ClaimOptions{Limit: 2})
	require.Len(t, leases, 2)
	reported, other := leases[0], leases[1]

	noted, err := b.store.NoteFailures(b.ctx, b.pool, []outbox.ProviderFailure{{ID: reported.ID, To: outbox.StateQuarantined,
		Reason: outbox.ReasonCustomerNotFound, Error: outbox.ErrorInfo{Code: "meter_event_customer_not_found", Message: "No such customer sk_live_abcdefghijklmnop"}}})
	require.NoError(t, err)
	require.Equal(t, []int64{reported.ID}, noted)
	require.Equal(t, outbox.StateLeased, b.get(t, reported.ID).State, "a note changes no state")

	res, err := b.store.Record(b.ctx, b.pool, []outbox.Outcome{
		{Lease: reported, Kind: outbox.Accepted, ProviderRef: "req_1"},
		{Lease: other, Kind: outbox.Accepted, ProviderRef: "req_2"},
	})
	require.NoError(t, err)
	require.Equal(t, outbox.StateQuarantined, res[0].State)
	require.Equal(t, outbox.ReasonCustomerNotFound, res[0].Reason)
	require.Equal(t, outbox.StateAccepted, res[1].State, "items without a note are accepted as ever")

	it := b.get(t, reported.ID)
	require.Equal(t, outbox.StateQuarantined, it.State)
	require.Equal(t, outbox.ReasonCustomerNotFound, it.QuarantineReason)
	require.Equal(t, "meter_event_customer_not_found", it.LastError.Code)
	require.NotContains(t, it.LastError.Message, "sk_live", "the note was sanitised")
	require.Equal(t, it.Attempts, it.RefusedAttempts, "the only attempt that reached Stripe was failed by the report")
	require.Equal(t, "req_1", it.ProviderRef, "the acceptance stays on the record")
	require.Equal(t, 1.0, b.counterValue("tally_outbox_transitions_total", "transition", "fail_accepted", "state", "quarantined"))
	require.Equal(t, 1.0, b.counterValue("tally_outbox_quarantined_total", "reason", "customer_not_found"))

	atts, err := b.store.Attempts(b.ctx, b.pool, reported.ID)
	require.NoError(t, err)
	require.Len(t, atts, 1)
	require.Equal(t, "accepted", atts[0].Outcome, "the attempt's own outcome was an accept")
	require.Equal(t, outbox.StateQuarantined, atts[0].StateAfter)

	// The note was used up: a requeue in place and a new accept is an accept.
	require.NoError(t, b.store.Requeue(b.ctx, b.pool, reported.ID, 1))
	l := b.claimOne(t)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "req_3"))
	require.Equal(t, outbox.StateAccepted, b.get(t, reported.ID).State)
}

// A report about an attempt that may have reached Stripe, noted while a
// retry is pending, holds for the next accept; an earlier attempt may have
// been recorded, so the item keeps its identifier (refused_attempts stays).
// Of two reports a rejection outranks a quarantine, and a note never lands
// on an item that is not in flight.
func TestNotesWaitForTheNextAcceptAndRejectionOutranks(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, newItem(1))
	l := b.claimOne(t)
	_, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "stripe_5xx", Status: 500}, false)
	require.NoError(t, err)
	_, err = b.pool.Exec(b.ctx, "UPDATE outbox_item_states SET next_attempt_at = clock_timestamp() WHERE id = $1", l.ID)
	require.NoError(t, err)

	quarantine := outbox.ProviderFailure{ID: l.ID, To: outbox.StateQuarantined, Reason: outbox.ReasonMeterNotFound, Error: outbox.ErrorInfo{Code: "no_meter"}}
	reject := outbox.ProviderFailure{ID: l.ID, To: outbox.StateRejected, Error: outbox.ErrorInfo{Code: "meter_event_invalid_value"}}
	noted, err := b.store.NoteFailures(b.ctx, b.pool, []outbox.ProviderFailure{quarantine})
	require.NoError(t, err)
	require.Len(t, noted, 1)
	noted, err = b.store.NoteFailures(b.ctx, b.pool, []outbox.ProviderFailure{quarantine})
	require.NoError(t, err)
	require.Empty(t, noted, "an equal verdict changes nothing")
	noted, err = b.store.NoteFailures(b.ctx, b.pool, []outbox.ProviderFailure{reject})
	require.NoError(t, err)
	require.Len(t, noted, 1, "a rejection outranks a quarantine")
	noted, err = b.store.NoteFailures(b.ctx, b.pool, []outbox.ProviderFailure{quarantine})
	require.NoError(t, err)
	require.Empty(t, noted, "a quarantine never softens a rejection")

	l = b.claimOne(t)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "req_2"))
	it := b.get(t, l.ID)
	require.Equal(t, outbox.StateRejected, it.State)
	require.Equal(t, "meter_event_invalid_value", it.LastError.Code)
	require.Zero(t, it.RefusedAttempts, "the first attempt may have been recorded: the identifier stays for good")

	// Not in flight: accepted, confirmed, rejected items take no note.
	a := b.accepted(t, 2)
	noted, err = b.store.NoteFailures(b.ctx, b.pool, []outbox.ProviderFailure{
		{ID: a.ID, To: outbox.StateRejected, Error: outbox.ErrorInfo{Code: "x"}},
		{ID: l.ID, To: outbox.StateRejected, Error: outbox.ErrorInfo{Code: "x"}},
	})
	require.NoError(t, err)
	require.Empty(t, noted)
}

// NoteFailures checks its input as FailAccepted does, and writes nothing
// when any of it is wrong.
func TestNoteFailuresRefusesBadInput(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, newItem(1))
	l := b.claimOne(t)
	for name, fs := range map[string][]outbox.ProviderFailure{
		"unknown reason":      {{ID: l.ID, To: outbox.StateQuarantined, Reason: "nope"}},
		"rejection w/ reason": {{ID: l.ID, To: outbox.StateRejected, Reason: outbox.ReasonMeterNotFound}},
		"other target":        {{ID: l.ID, To: outbox.StateAccepted}},
		"twice":               {{ID: l.ID, To: outbox.StateRejected}, {ID: l.ID, To: outbox.StateRejected}},
	} {
		_, err := b.store.NoteFailures(b.ctx, b.pool, fs)
		require.Error(t, err, name)
	}
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "req_1"))
	require.Equal(t, outbox.StateAccepted, b.get(t, l.ID).State)
}
