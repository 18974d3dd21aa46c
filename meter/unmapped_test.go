package meter_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
)

// Unmapped usage is every feature and tenant without a mapping among the
// events received within the span, with their counts: features first, each
// kind by name.
func TestUnmappedUsageWithinSpan(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Hour)
	b.Tenant(t, "acme", nil)
	b.MustIngest(t,
		ev("e1", "acme", "api", 1, nil),
		ev("e2", "acme", "gpu", 1, nil), ev("e3", "acme", "gpu", 1, nil),
		ev("e4", "zeta", "api", 1, nil), ev("e5", "beta", "disk", 1, nil))
	// An event received long ago (written as the ledger keeps it).
	_, err := b.Pool.Exec(b.Ctx, `INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given, received_at, bucket)
		VALUES ('old', 'e6', 'ancient', 1, clock_timestamp() - interval '8 days', false, clock_timestamp() - interval '8 days',
		        tally_bucket('old'))`)
	require.NoError(t, err)

	got, err := meter.UnmappedUsage(b.Ctx, b.Pool, 7*24*time.Hour)
	require.NoError(t, err)
	require.Equal(t, []meter.Unmapped{
		{Kind: meter.UnmappedFeature, Name: "disk", Events: 1},
		{Kind: meter.UnmappedFeature, Name: "gpu", Events: 2},
		{Kind: meter.UnmappedTenant, Name: "beta", Events: 1},
		{Kind: meter.UnmappedTenant, Name: "zeta", Events: 1},
	}, got)

	all, err := meter.UnmappedUsage(b.Ctx, b.Pool, 30*24*time.Hour)
	require.NoError(t, err)
	require.Len(t, all, 6, "a wider span reaches the old event's feature and tenant")
}
