package meter_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// The quarantine cap: a batch whose new events would make more quarantined
// items than Ingester.MaxQuarantined is refused whole.

// batchOf is n events ev-<prefix>-<i> of tenant and feature, value v, at ts.
func batchOf(n int, prefix, tenant, feature string, v int64, ts *time.Time) []meter.Event {
	evs := make([]meter.Event, n)
	for i := range evs {
		evs[i] = ev(fmt.Sprintf("%s-%d", prefix, i), tenant, feature, v, ts)
	}
	return evs
}

func (b *bundle) count(t *testing.T, sql string) int {
	t.Helper()
	var n int
	require.NoError(t, b.Pool.QueryRow(b.Ctx, sql).Scan(&n))
	return n
}

// requireCapped checks that err is the cap's refusal of items items, all for
// reason, and that nothing of the batch was stored.
func (b *bundle) requireCapped(t *testing.T, err error, items int, reason outbox.Reason, ledgerBefore int) {
	t.Helper()
	var capErr *meter.QuarantineCapError
	require.ErrorAs(t, err, &capErr)
	require.Equal(t, items, capErr.Items)
	require.Equal(t, b.Ingester.MaxQuarantined, capErr.Max)
	require.Equal(t, map[outbox.Reason]int{reason: items}, capErr.Reasons)
	require.Equal(t, ledgerBefore, b.count(t, "SELECT count(*) FROM usage_events"), "nothing of a refused batch is stored")
}

// The case: backdated usage of an unmapped feature, one quarantined
// item per event at the stager's next pass.
func TestQuarantineCapRefusesBackdatedUnmappedUsage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Ingester.MaxQuarantined = 5
	backdated := ago(3 * time.Hour)
	_, err := b.Ingest(t, batchOf(6, "over", "acme", "mystery", 1, backdated)...)
	b.requireCapped(t, err, 6, outbox.ReasonFeatureUnmapped, 0)
	require.Empty(t, b.Items(t))

	// At the cap: stored, and the stager makes exactly what was counted.
	b.MustIngest(t, batchOf(5, "at", "acme", "mystery", 1, backdated)...)
	require.Equal(t, meter.PassResult{Items: 5, Quarantined: 5, Events: 5}, b.Pass(t))

	// A batch re-posted whole is all duplicates: nothing new to count.
	res := b.MustIngest(t, append(batchOf(5, "at", "acme", "mystery", 1, backdated), ev("new", "acme", "mystery", 1, nil))...)
	require.Equal(t, meter.Result{Accepted: 1, Duplicates: 5, Unmapped: 1}, res)
}

func TestQuarantineCapCountsEachReason(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Hour)
	b.Feature(t, "calls", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)
	b.Ingester.MaxQuarantined = 3
	old := ago(40 * 24 * time.Hour)

	t.Run("count events older than Stripe takes", func(t *testing.T) {
		_, err := b.Ingest(t, batchOf(4, "old", "acme", "calls", 1, old)...)
		b.requireCapped(t, err, 4, outbox.ReasonTimestampWindow, 0)
	})
	t.Run("count corrections", func(t *testing.T) {
		_, err := b.Ingest(t, batchOf(4, "corr", "acme", "calls", -1, nil)...)
		b.requireCapped(t, err, 4, outbox.ReasonCountValue, 0)
	})
	t.Run("a tenant without a customer", func(t *testing.T) {
		_, err := b.Ingest(t, batchOf(4, "nobody", "nobody", "calls", 1, nil)...)
		b.requireCapped(t, err, 4, outbox.ReasonNoCustomer, 0)
	})
	t.Run("windows, one item each", func(t *testing.T) {
		base := old.Truncate(time.Hour)
		var evs []meter.Event
		for i := 0; i < 4; i++ { // 4 windows, 10 events in each
			at := base.Add(time.Duration(i) * time.Hour)
			evs = append(evs, batchOf(10, fmt.Sprintf("w%d", i), "acme", "api", 2, &at)...)
		}
		_, err := b.Ingest(t, evs...)
		b.requireCapped(t, err, 4, outbox.ReasonTimestampWindow, 0)
		b.MustIngest(t, evs[:30]...) // 3 windows
		res := b.Pass(t)
		require.Equal(t, 3, res.Quarantined, "%+v", res)
	})
	t.Run("usage that would not be quarantined", func(t *testing.T) {
		before := b.count(t, "SELECT count(*) FROM usage_events")
		b.MustIngest(t, batchOf(10, "fine", "acme", "calls", 1, ago(time.Hour))...)
		b.MustIngest(t, batchOf(10, "fine-sum", "acme", "api", 7, ago(2*time.Hour))...)
		require.Equal(t, before+20, b.count(t, "SELECT count(*) FROM usage_events"))
	})
	t.Run("no account", func(t *testing.T) {
		b.Target.Account = ""
		defer func() { b.Target.Account = "acct_1" }()
		_, err := b.Ingest(t, batchOf(4, "noacct", "acme", "calls", 1, nil)...)
		b.requireCapped(t, err, 4, outbox.ReasonNoAccount, b.count(t, "SELECT count(*) FROM usage_events"))
	})
}

// Without a destination (export stalled) only the missing mappings count:
// the timestamp window and the account are the destination's.
func TestQuarantineCapWithoutDestination(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "calls", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)
	b.Ingester.MaxQuarantined = 3
	b.Stager.Target = func(context.Context) (meter.Target, bool) { return meter.Target{}, false }
	b.MustIngest(t, batchOf(4, "old", "acme", "calls", 1, ago(40*24*time.Hour))...)
	_, err := b.Ingest(t, batchOf(4, "unmapped", "acme", "mystery", 1, nil)...)
	b.requireCapped(t, err, 4, outbox.ReasonFeatureUnmapped, 4)
}

// The zero Ingester has no cap.
func TestQuarantineCapZeroIsUnlimited(t *testing.T) {
	t.Parallel()
	b := setup(t)
	require.Zero(t, b.Ingester.MaxQuarantined)
	b.MustIngest(t, batchOf(50, "many", "acme", "mystery", 1, ago(3*time.Hour))...)
	require.Equal(t, 50, b.count(t, "SELECT count(*) FROM usage_events"))
}
