package meter_test

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// A late row of a last window joins only a window item of its own window.
// Here the window's only staged row sits in a per-event item — quarantined
// feature_unmapped before the feature was mapped as last — and an older
// late row arrives after the mapping: joining that item would make its
// value, when it is requeued and rebuilt, the older row's (3, not 10), and
// the item would no longer carry what its rows say. It is staged as the
// window's own item instead.
func TestLastLateRowNeverJoinsAPerEventItem(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Tenant(t, "acme", nil)
	hour := time.Now().UTC().Add(-5 * time.Hour).Truncate(time.Hour)
	in := func(min int) *time.Time { v := hour.Add(time.Duration(min) * time.Minute); return &v }
	b.MustIngest(t, ev("a", "acme", "seats", 10, in(30)))
	b.Pass(t)
	items := b.items(t)
	require.Len(t, items, 1)
	require.Equal(t, outbox.SubjectUsageEvent, items[0].kind)
	require.Equal(t, string(outbox.ReasonFeatureUnmapped), items[0].reason)

	b.Feature(t, "seats", mappings.Last, time.Hour)
	b.MustIngest(t, ev("older", "acme", "seats", 3, in(5)))
	b.Pass(t)
	items = b.items(t)
	require.Len(t, items, 2, "the late row is the window's own item")
	require.Equal(t, 1, items[0].events, "the per-event item carries its own event alone")
	require.Equal(t, outbox.SubjectUsageWindow, items[1].kind)
	require.Equal(t, int64(3), items[1].value)
	require.False(t, strings.Contains(items[1].ref, "#"), "the window's first item, not a supplement")
}

// Stripe takes at most 15 digits in a value. A sum window whose total would
// carry more is split, in time order, into supplements that fit; an event
// whose own value has more digits is quarantined value_digits, never sent
// and never truncated; so is a last value or a per-event item that has
// more.
func TestValuesBeyondFifteenDigitsAreSplitOrQuarantined(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Target.MaxValue = 999_999_999_999_999
	const big = 999_999_999_999_999 // 15 digits
	b.Tenant(t, "acme", nil)
	b.Feature(t, "bytes", mappings.Sum, time.Hour)
	b.Feature(t, "peak", mappings.Last, time.Hour)
	b.Feature(t, "calls", mappings.Count, time.Hour)
	hour := time.Now().UTC().Add(-5 * time.Hour).Truncate(time.Hour)
	in := func(min int) *time.Time { v := hour.Add(time.Duration(min) * time.Minute); return &v }
	b.MustIngest(t,
		ev("s1", "acme", "bytes", big, in(1)),
		ev("s2", "acme", "bytes", 1, in(2)),             // big+1 has 16 digits: a new item
		ev("s3", "acme", "bytes", math.MaxInt64, in(3)), // too many digits alone
		ev("s4", "acme", "bytes", 5, in(4)),
		ev("p1", "acme", "peak", big+1, in(5)),
	)
	b.Pass(t)
	var sums []itemRow
	for _, it := range b.items(t) {
		if it.payload.Feature == "bytes" {
			sums = append(sums, it)
		}
	}
	// In time order: big, then 1 (big+1 has 16 digits), then MaxInt64 alone
	// (quarantined), then 5 (a sum with MaxInt64 would not fit either).
	require.Len(t, sums, 4)
	for i, want := range []struct {
		value  int64
		reason outbox.Reason
	}{{big, ""}, {1, ""}, {math.MaxInt64, outbox.ReasonValueDigits}, {5, ""}} {
		require.Equal(t, want.value, sums[i].value, "item %d", i)
		require.Equal(t, string(want.reason), sums[i].reason, "item %d", i)
	}
	require.True(t, strings.HasSuffix(sums[3].ref, "#3"), "supplements of one window")
	total := 0
	for _, it := range sums {
		total += it.events
	}
	require.Equal(t, 4, total, "every row in exactly one item")

	for _, it := range b.items(t) {
		if it.payload.Feature == "peak" {
			require.Equal(t, string(outbox.ReasonValueDigits), it.reason)
			require.Equal(t, int64(big+1), it.value, "never truncated")
		}
	}
}
