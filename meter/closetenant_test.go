package meter_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
)

// CloseTenant stages a tenant's windows that have ended without waiting
// for the grace, and only that tenant's; a window still running waits.
func TestCloseTenantStagesEndedWindowsAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Stager.Grace = time.Hour
	b.Feature(t, "api", mappings.Sum, time.Minute)
	b.Tenant(t, "acme", nil)
	b.Tenant(t, "other", nil)
	minute := time.Now().UTC().Truncate(time.Minute)
	ended, running := minute.Add(-30*time.Second), time.Now().UTC()
	b.MustIngest(t, ev("e1", "acme", "api", 3, &ended), ev("e2", "acme", "api", 4, &running), ev("e3", "other", "api", 5, &ended))
	require.Equal(t, meter.PassResult{}, b.Pass(t), "the grace holds every window")

	res, err := b.Stager.CloseTenant(b.Ctx, b.Pool, "acme")
	require.NoError(t, err)
	if time.Now().UTC().Truncate(time.Minute) != minute {
		t.Skip("the minute turned while the test ran: the running window ended too")
	}
	require.Equal(t, meter.PassResult{Items: 1, Events: 1}, res)
	items := b.items(t)
	require.Len(t, items, 1)
	require.Equal(t, int64(3), items[0].value)
	var unstaged int
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT count(*) FROM usage_events WHERE item_id IS NULL`).Scan(&unstaged))
	require.Equal(t, 2, unstaged, "the running window and the other tenant wait")
}
