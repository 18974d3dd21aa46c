package quarantine_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// lateSetup stages, under LateQuarantine, usage of a billing period that
// ended hours ago (window "w" of 5 and count event "c") and of the open
// one (window "o" of 7): the closed period's items are quarantined
// period_closed.
func lateSetup(t *testing.T) (b *bundle, version int, anchor time.Time) {
	b = setup(t)
	b.Target.LateUsage, b.Target.InvoiceGrace = meter.LateQuarantine, time.Hour
	f := b.Feature(t, "api", mappings.Sum, time.Hour)
	c := b.Feature(t, "calls", mappings.Count, time.Hour)
	anchor = time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour).Add(30 * time.Minute)
	tn := b.Tenant(t, "acme", &anchor)
	closed, open := anchor.Add(-20*time.Minute), anchor.Add(10*time.Minute)
	b.MustIngest(t, ev("w", "acme", "api", 5, &closed), ev("c", "acme", "calls", 1, &closed), ev("o", "acme", "api", 7, &open))
	b.Pass(t)
	for _, id := range []string{"w", "c"} {
		it := b.itemOf(t, "acme", id)
		require.Equal(t, outbox.StateQuarantined, it.State, id)
		require.Equal(t, outbox.ReasonPeriodClosed, it.QuarantineReason, id)
		require.True(t, it.Payload.Late, id)
	}
	return b, max(f.Version, c.Version, tn.Version), anchor
}

// TestRequeuePeriodClosedOnlyKnowingly: a requeue of late usage is refused
// with a *PeriodClosedError (the refusal code period_closed) and changes
// nothing; with AcceptPeriodClosed it goes back to pending, still marked
// late, and the audit log says it was sent knowingly.
func TestRequeuePeriodClosedOnlyKnowingly(t *testing.T) {
	t.Parallel()
	b, version, _ := lateSetup(t)
	it := b.itemOf(t, "acme", "w")

	_, err := b.requeuer.Requeue(b.Ctx, b.Pool, it.ID, version, "finance")
	var pc *quarantine.PeriodClosedError
	require.ErrorAs(t, err, &pc)
	require.Equal(t, quarantine.RefusalPeriodClosed, quarantine.RefusalCode(err))
	require.True(t, quarantine.IsConflict(err))
	again := b.itemOf(t, "acme", "w")
	require.Equal(t, outbox.StateQuarantined, again.State, "a refusal changes nothing")

	res, err := b.requeuer.RequeueWith(b.Ctx, b.Pool, it.ID, version, "finance", quarantine.RequeueOptions{AcceptPeriodClosed: true})
	require.NoError(t, err)
	require.Equal(t, quarantine.ActionRequeued, res.Action)
	sent := b.itemOf(t, "acme", "w")
	require.Equal(t, outbox.StatePending, sent.State)
	require.True(t, sent.Payload.Late, "it stays marked late: the completeness report counts it")
	trail, err := audit.List(b.Ctx, b.Pool, audit.Item(it.ID), 10)
	require.NoError(t, err)
	require.Len(t, trail, 1)
	require.Equal(t, "finance", trail[0].Actor)
	require.Contains(t, trail[0].Details, "accepted_period_closed")
}

// TestBulkRequeuePeriodClosed: the bulk requeue refuses late usage with
// period_closed unless the request accepts it, and then sends every
// matching item.
func TestBulkRequeuePeriodClosed(t *testing.T) {
	t.Parallel()
	b, _, _ := lateSetup(t)
	f := quarantine.Filter{Reason: string(outbox.ReasonPeriodClosed)}

	res, err := b.requeuer.RequeueMatching(b.Ctx, b.Pool, quarantine.BulkRequest{Filter: f, By: "finance"})
	require.NoError(t, err)
	require.Equal(t, 2, res.Totals.Refused)
	require.Equal(t, map[string]int{quarantine.RefusalPeriodClosed: 2}, res.Totals.RefusedBy)

	res, err = b.requeuer.RequeueMatching(b.Ctx, b.Pool, quarantine.BulkRequest{Filter: f, By: "finance",
		Options: quarantine.RequeueOptions{AcceptPeriodClosed: true}})
	require.NoError(t, err)
	require.Equal(t, 2, res.Totals.Requeued)
	require.Equal(t, 0, res.Totals.Refused)
}

// TestCompletenessCountsLateUsage: the report's period_closed bucket holds
// the late usage whatever its state — quarantined, then requeued — as a
// part of the other buckets, and the identity holds throughout.
func TestCompletenessCountsLateUsage(t *testing.T) {
	t.Parallel()
	b, version, anchor := lateSetup(t)
	closedPeriod := meter.PeriodStart(anchor.Add(-time.Minute), anchor)
	read := func() map[string]quarantine.Line {
		t.Helper()
		out := map[string]quarantine.Line{}
		for _, month := range []string{closedPeriod.Format("2006-01"), anchor.Format("2006-01")} {
			c, err := quarantine.CompletenessOf(b.Ctx, b.Pool, month, "")
			require.NoError(t, err)
			require.True(t, c.Holds, "the identity holds with late usage")
			for _, l := range c.Lines {
				out[l.Feature+" "+l.Period] = l
			}
		}
		return out
	}
	closedKey := func(f string) string { return f + " " + closedPeriod.Format(time.RFC3339) }
	lines := read()
	require.EqualValues(t, 1, lines[closedKey("api")].PeriodClosed.Events)
	require.Equal(t, "5", lines[closedKey("api")].PeriodClosed.Value.String())
	require.Equal(t, "5", lines[closedKey("api")].Quarantined.Value.String())
	require.EqualValues(t, 1, lines[closedKey("calls")].PeriodClosed.Events)
	open := lines["api "+anchor.Format(time.RFC3339)]
	require.EqualValues(t, 0, open.PeriodClosed.Events, "the open period's usage is not late")
	require.Equal(t, "7", open.Ingested.Value.String())

	_, err := b.requeuer.RequeueWith(b.Ctx, b.Pool, b.itemOf(t, "acme", "w").ID, version, "finance",
		quarantine.RequeueOptions{AcceptPeriodClosed: true})
	require.NoError(t, err)
	lines = read()
	require.Equal(t, "5", lines[closedKey("api")].PeriodClosed.Value.String(), "requeued, still late")
	require.Equal(t, "5", lines[closedKey("api")].Pending.Value.String())
	require.EqualValues(t, 0, lines[closedKey("api")].Quarantined.Events)
}
