package exporter

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// T6 for cancellations: an adjustment whose lease ends after Stripe's 24
// hours (Lease.PastDeadline, decided by the claim) is quarantined
// cancel_too_late unsent when no earlier attempt may have reached Stripe,
// and sent when one may have (Stripe's refusal then sends the exporter to
// the earlier keys); the event's timestamp, which an adjustment does not
// carry, never stops it, while it still stops a meter event.
func TestClaimCheckOfCancellations(t *testing.T) {
	t.Parallel()
	dest := Destination{Exporter: StripeMeterEvents, Account: "acct_1", Mode: outbox.ModeTest}
	lease := func(cancels string, attempts, refused int, past, outside bool) outbox.Lease {
		return outbox.Lease{Item: outbox.Item{
			Identity: outbox.Identity{SubjectKind: outbox.SubjectUsageCancellation, Exporter: StripeMeterEvents,
				DestinationAccount: "acct_1", Mode: outbox.ModeTest},
			Attempts: attempts, RefusedAttempts: refused,
			Payload: outbox.Payload{Customer: "cus_1", EventName: "logins", Cancels: cancels},
		}, PastDeadline: past, TimestampOutside: outside}
	}
	for _, tc := range []struct {
		name   string
		l      outbox.Lease
		stop   bool
		reason outbox.Reason
	}{
		{"in time", lease("tly_a", 1, 0, false, false), false, ""},
		{"past, first attempt", lease("tly_a", 1, 0, true, false), true, outbox.ReasonCancelTooLate},
		{"past, every earlier attempt refused", lease("tly_a", 3, 2, true, false), true, outbox.ReasonCancelTooLate},
		{"past, an earlier attempt may have reached Stripe", lease("tly_a", 2, 0, true, false), false, ""},
		{"the event's timestamp aged past Stripe's window", lease("tly_a", 1, 0, false, true), false, ""},
		{"a supplement's timestamp outside", lease("", 1, 0, false, true), true, outbox.ReasonTimestampWindow},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			o, stop := (&Deliverer{}).claimCheck(tc.l, dest, StripeMeterEvents)
			require.Equal(t, tc.stop, stop, "%+v", o)
			if stop {
				require.Equal(t, outbox.Quarantined, o.Kind)
				require.Equal(t, tc.reason, o.Reason)
			}
		})
	}
}

// A probe of an earlier attempt's key learns nothing from a 5xx Stripe
// kept for that key (Idempotent-Replayed, or Stripe-Should-Retry: false)
// and asks the next key; any other 5xx — a proxy's 502, a fresh failure
// Stripe says to retry — may hide an answer still to come, and retries.
func TestKept5xx(t *testing.T) {
	t.Parallel()
	no, yes := false, true
	for _, tc := range []struct {
		a    Answer
		kept bool
	}{
		{Answer{Status: 500, ShouldRetry: &no}, true},
		{Answer{Status: 500, Replayed: true}, true},
		{Answer{Status: 502}, false},
		{Answer{Status: 503, ShouldRetry: &yes}, false},
		{Answer{Status: 500}, false},
		{Answer{Status: 400, Replayed: true}, false},
		{Answer{}, false},
	} {
		require.Equal(t, tc.kept, kept5xx(tc.a), "%+v", tc.a)
	}
}
