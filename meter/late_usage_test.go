package meter_test

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// TestLateUsage stages usage of a billing period that ended 2.5 to 3.5
// hours ago (a tenant anchored at :30 three hours back, by the hour) and of
// the period after it, under each policy and grace: usage staged after its period's
// end plus the grace is late — quarantined period_closed by default, sent
// under LateSend, marked late either way — and the usage of the open
// period never is.
func TestLateUsage(t *testing.T) {
	t.Parallel()
	hours := func(h time.Duration) *mappings.Duration { g := mappings.Duration(h * time.Hour); return &g }
	for _, c := range []struct {
		name        string
		policy      meter.LatePolicy
		nodeGrace   time.Duration
		tenantGrace *mappings.Duration
		late        bool   // the closed period's usage is late
		reason      string // its items' quarantine reason
	}{
		{"quarantined by default", meter.LateQuarantine, time.Hour, nil, true, "period_closed"},
		{"sent under LateSend, marked late", meter.LateSend, time.Hour, nil, true, ""},
		{"a grace longer than the time since the period ended", meter.LateQuarantine, 5 * time.Hour, nil, false, ""},
		{"the tenant's grace overrides the node's", meter.LateQuarantine, time.Hour, hours(72), false, ""},
		{"the tenant's shorter grace too", meter.LateQuarantine, 72 * time.Hour, hours(0), true, "period_closed"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			b.Target.LateUsage, b.Target.InvoiceGrace = c.policy, c.nodeGrace
			b.Feature(t, "api", mappings.Sum, time.Hour)
			b.Feature(t, "calls", mappings.Count, time.Hour)
			anchor := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour).Add(30 * time.Minute)
			_, _, err := b.Maps.PutTenant(b.Ctx, b.Pool, "acme",
				mappings.TenantInput{StripeCustomerID: "cus_acme", PeriodAnchor: &anchor, InvoiceGrace: c.tenantGrace}, "test")
			require.NoError(t, err)
			closed, open := anchor.Add(-20*time.Minute), anchor.Add(10*time.Minute)
			b.MustIngest(t, ev("w-closed", "acme", "api", 5, &closed), ev("w-open", "acme", "api", 7, &open),
				ev("c-closed", "acme", "calls", 1, &closed), ev("c-open", "acme", "calls", 1, &open))
			b.Pass(t)

			items := b.items(t)
			require.Len(t, items, 4)
			for _, it := range items {
				inClosed := it.payload.Period != anchor.Format(time.RFC3339)
				if inClosed {
					require.Equal(t, c.late, it.payload.Late, "%s: late", it.ref)
					require.Equal(t, c.reason, it.reason, "%s: reason", it.ref)
					if c.reason == "" {
						require.Equal(t, outbox.StatePending, it.state, it.ref)
					}
					continue
				}
				require.False(t, it.payload.Late, "%s: the open period's usage is never late", it.ref)
				require.Equal(t, "", it.reason, it.ref)
			}
		})
	}
}

// TestLateUsageTimestampOutsideStaysTimestampWindow: usage Stripe would
// refuse outright (older than it accepts) is quarantined for that, not as
// late, and not marked late: nothing of it can reach an invoice.
func TestLateUsageTimestampOutsideStaysTimestampWindow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Target.LateUsage = meter.LateQuarantine
	b.Feature(t, "calls", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)
	old := time.Now().UTC().Add(-40 * 24 * time.Hour)
	b.MustIngest(t, ev("old", "acme", "calls", 1, &old))
	b.Pass(t)
	items := b.items(t)
	require.Len(t, items, 1)
	require.Equal(t, string(outbox.ReasonTimestampWindow), items[0].reason)
	require.False(t, items[0].payload.Late)
}

// TestLateUsageCountsTowardTheQuarantineCap: under LateQuarantine a batch
// of late events would make quarantined items, and the ingest's cap
// refuses it as it refuses any other, naming the reason; under LateSend
// the same batch is taken.
func TestLateUsageCountsTowardTheQuarantineCap(t *testing.T) {
	t.Parallel()
	for _, policy := range []meter.LatePolicy{meter.LateQuarantine, meter.LateSend} {
		t.Run(string(policy), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			b.Target.LateUsage, b.Target.InvoiceGrace = policy, time.Hour
			b.Ingester.MaxQuarantined = 1
			b.Feature(t, "calls", mappings.Count, time.Hour)
			anchor := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour).Add(30 * time.Minute)
			b.Tenant(t, "acme", &anchor)
			closed := anchor.Add(-20 * time.Minute)
			_, err := b.Ingest(t, ev("a", "acme", "calls", 1, &closed), ev("b", "acme", "calls", 1, &closed))
			var capErr *meter.QuarantineCapError
			if policy == meter.LateSend {
				require.NoError(t, err)
				require.Equal(t, 0, b.unstaged(t)+countReason(b, t, "period_closed"))
				return
			}
			require.True(t, errors.As(err, &capErr), "want the cap's refusal, got %v", err)
			require.Equal(t, 2, capErr.Reasons[outbox.ReasonPeriodClosed])
			require.Empty(t, b.items(t), "nothing of a refused batch is stored")
		})
	}
}

func countReason(b *bundle, t *testing.T, reason string) int {
	n := 0
	for _, it := range b.items(t) {
		if it.reason == reason {
			n++
		}
	}
	return n
}
