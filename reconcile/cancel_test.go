package reconcile_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// cancelEvents runs meter.Cancel for tenant t0's events in one transaction.
func (r *rig) cancelEvents(t *testing.T, ids ...string) []meter.CancelResult {
	t.Helper()
	cs := make([]meter.Cancellation, len(ids))
	for i, id := range ids {
		cs[i] = meter.Cancellation{Tenant: "t0", ID: id}
	}
	var out []meter.CancelResult
	require.NoError(t, pgx.BeginFunc(r.Ctx, r.Pool, func(tx pgx.Tx) error {
		var err error
		out, err = r.Stager.Cancel(r.Ctx, tx, "token:ops", cs)
		return err
	}))
	return out
}

// A count event Stripe has, cancelled within its 24 hours: an adjustment
// item goes through the outbox (the v1 exporter sends it), Stripe's count
// drops, and reconciliation — which takes no answer to an adjustment as
// proof — finds the cancelled event absent, as expected, and confirms the
// event's item and its adjustment. A second run finds nothing new; the
// completeness identity holds with the cancellation counted.
func TestReconcileConfirmsACountEventCancelledByAnAdjustment(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	at := stagetest.Ago(3 * time.Hour)
	r.MustIngest(t, stagetest.Ev("l1", "t0", "logins", 1, at), stagetest.Ev("l2", "t0", "logins", 1, at),
		stagetest.Ev("l3", "t0", "logins", 1, at))
	r.deliverAll(t)
	_, n, _ := r.sim.Aggregate("acct_sim", "logins", "cus_t0")
	require.Equal(t, 3, n)

	out := r.cancelEvents(t, "l2")
	require.Equal(t, meter.CancelAdjustment, out[0].Outcome, "%+v", out[0])
	adj := r.item(t, *out[0].Item)
	require.Equal(t, outbox.SubjectUsageCancellation, adj.SubjectKind)
	require.Equal(t, outbox.StatePending, adj.State)
	var cancels string
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT o.identifier FROM usage_events u JOIN outbox_items o ON o.id = u.item_id
		WHERE u.event_id = 'l2'`).Scan(&cancels))
	require.Equal(t, cancels, adj.Payload.Cancels)
	var by int64
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT floor(extract(epoch FROM first_attempt_at + interval '24 hours'))::bigint
		FROM outbox_items WHERE identifier = $1`, cancels).Scan(&by))
	require.Equal(t, by, adj.Payload.CancelBy, "Stripe's deadline, for the claim to check again")

	r.deliverAll(t)
	require.Equal(t, outbox.StateAccepted, r.item(t, adj.ID).State)
	_, n, _ = r.sim.Aggregate("acct_sim", "logins", "cus_t0")
	require.Equal(t, 2, n, "Stripe no longer counts l2")

	run, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds, "the cancelled event is expected absent")
	require.Equal(t, int64(4), run.ItemsConfirmed, "three events' items and the adjustment")
	require.Equal(t, outbox.StateConfirmed, r.item(t, adj.ID).State)
	run, ds = r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds)
	require.Zero(t, run.ItemsConfirmed)

	rep, err := quarantine.CompletenessOf(r.Ctx, r.Pool, at.Format("2006-01"), "t0")
	require.NoError(t, err)
	require.True(t, rep.Holds, "%+v", rep)
	require.Len(t, rep.Lines, 1)
	require.Equal(t, int64(1), rep.Lines[0].Cancelled.Events)
	require.Equal(t, int64(2), rep.Lines[0].Confirmed.Events)
}

// An adjustment whose answer Tally cannot read is quarantined
// provider_refused, never rejected or resent: Stripe cancelled the event on
// the first attempt but answered 500 (kept for its key), and refuses the
// resend as a second cancel; asking the first attempt's key again replays
// the 500. Its event is in doubt, and the hour matches without it, so
// nothing is reported missing.
func TestAnAdjustmentQuarantinedLeavesItsEventInDoubt(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	at := stagetest.Ago(3 * time.Hour)
	r.MustIngest(t, stagetest.Ev("l1", "t0", "logins", 1, at), stagetest.Ev("l2", "t0", "logins", 1, at))
	r.deliverAll(t)
	out := r.cancelEvents(t, "l2")
	adj := r.item(t, *out[0].Item)

	r.sim.Configure("acct_sim", stripesim.Limits{Faults: stripesim.Faults{FailAfterRecord: 1}})
	leases, err := r.Outbox.Claim(r.Ctx, r.Pool, outbox.ClaimOptions{Owner: "test", Limit: 10})
	require.NoError(t, err)
	require.Len(t, leases, 1)
	o := r.exp.Send(r.Ctx, leases[0])
	require.Equal(t, outbox.Retry, o.Kind, "%+v", o)
	o.Lease = leases[0]
	_, err = r.Outbox.Record(r.Ctx, r.Pool, []outbox.Outcome{o})
	require.NoError(t, err)
	r.sim.Configure("acct_sim", stripesim.Limits{})
	r.deliverAll(t) // once the backoff ends
	require.Equal(t, outbox.StateQuarantined, r.item(t, adj.ID).State, "the resend's 400 goes to a human")
	require.Equal(t, outbox.ReasonProviderRefused, r.item(t, adj.ID).QuarantineReason)
	_, n, _ := r.sim.Aggregate("acct_sim", "logins", "cus_t0")
	require.Equal(t, 1, n, "cancelled once")

	_, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds, "the event in doubt explains nothing missing")
}

// Usage Stripe cannot take back is kept for finance: a count event
// received too long ago, and an event of a last window. An event of a sum
// window Stripe has is offset by a supplement of the negated value: sent,
// Stripe's sum drops by it, reconciliation matches, and the completeness
// identity holds with it counted as cancelled.
func TestCancellationsStripeCannotApply(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	at := stagetest.Ago(3 * time.Hour)
	r.MustIngest(t, stagetest.Ev("l1", "t0", "logins", 1, at), stagetest.Ev("s1", "t0", "seats", 4, at),
		stagetest.Ev("a1", "t0", "api", 9, at))
	r.deliverAll(t)

	r.Stager.CancelMargin = 25 * time.Hour // every event is past its deadline
	out := r.cancelEvents(t, "l1", "s1")
	for i, reason := range []outbox.Reason{outbox.ReasonCancelTooLate, outbox.ReasonCancelLastValue} {
		require.Equal(t, meter.CancelRefused, out[i].Outcome)
		require.Equal(t, string(reason), out[i].Reason)
		it := r.item(t, *out[i].Item)
		require.Equal(t, outbox.StateQuarantined, it.State)
		require.Equal(t, reason, it.QuarantineReason)
	}
	// Kept for finance: a requeue refuses it.
	rq := &quarantine.Requeuer{Outbox: r.Outbox, Stager: r.Stager}
	refused := r.item(t, *out[0].Item)
	_, err := rq.RequeueWith(r.Ctx, r.Pool, refused.ID, refused.MappingVersion, "token:ops", quarantine.RequeueOptions{})
	var ie *quarantine.StillIneligibleError
	require.ErrorAs(t, err, &ie)
	require.Equal(t, outbox.StateQuarantined, r.item(t, refused.ID).State)

	again := r.cancelEvents(t, "l1")
	require.True(t, again[0].Duplicate)
	require.Equal(t, string(outbox.ReasonCancelTooLate), again[0].Reason)

	sum := r.cancelEvents(t, "a1")
	require.Equal(t, meter.CancelSupplement, sum[0].Outcome)
	r.deliverAll(t)
	require.Equal(t, outbox.StateAccepted, r.item(t, *sum[0].Item).State)
	s, _, _ := r.sim.Aggregate("acct_sim", "api", "cus_t0")
	require.Zero(t, s, "9 and its offset -9")
	run, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds)
	require.Positive(t, run.ItemsConfirmed)
	require.Equal(t, outbox.StateConfirmed, r.item(t, *sum[0].Item).State)
	rep, err := quarantine.CompletenessOf(r.Ctx, r.Pool, at.Format("2006-01"), "t0")
	require.NoError(t, err)
	require.True(t, rep.Holds, "%+v", rep)
	cancelled := int64(0)
	for _, l := range rep.Lines {
		cancelled += l.Cancelled.Events
	}
	require.Equal(t, int64(3), cancelled, "l1, s1 and a1, whatever became of them")
}
