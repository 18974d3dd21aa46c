package meter_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
)

// The backlog is the usage waiting in the ledger: it grows while export is
// stalled (nothing is staged), its age is the oldest row's by received_at,
// and it empties once a pass stages it.
func TestBacklogCountsUnstagedUsageAndAgesByTheOldest(t *testing.T) {
	t.Parallel()
	b := setup(t)
	read := func() meter.Backlog {
		t.Helper()
		bl, err := meter.ReadBacklog(b.Ctx, b.Pool)
		require.NoError(t, err)
		return bl
	}
	require.Equal(t, meter.Backlog{}, read(), "an empty ledger has no backlog")

	b.Feature(t, "api", mappings.Sum, time.Minute)
	b.Tenant(t, "acme", nil)
	working := b.Stager.Target
	b.Stager.Target = func(context.Context) (meter.Target, bool) { return meter.Target{}, false }
	past := time.Now().Add(-time.Hour)
	b.MustIngest(t, ev("a", "acme", "api", 5, &past))
	const apart = 300 * time.Millisecond
	time.Sleep(apart) // received apart: the oldest is the first
	b.MustIngest(t, ev("b", "acme", "api", 7, &past), ev("c", "acme", "api", 1, &past))
	require.Equal(t, meter.PassResult{Stalled: true}, b.Pass(t))

	bl := read()
	require.Equal(t, int64(3), bl.Events)
	require.GreaterOrEqual(t, bl.OldestAge, apart, "the age is the oldest row's")
	require.Less(t, bl.OldestAge, time.Minute, "by received_at, not occurred_at (an hour ago)")

	b.Stager.Target = working
	require.Equal(t, 3, b.Pass(t).Events)
	require.Equal(t, meter.Backlog{}, read(), "staged usage is no backlog")
}
