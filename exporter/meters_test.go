package exporter_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// The directory of meters: a meter deactivated with no active meter of its
// event name pauses that name in that account and mode alone; a new meter
// of the name (the old one replaced) resumes it and becomes the name's
// meter; RecordMeters reports each change once, and a meter missing from a
// later list keeps its row.
func TestMeterDirectoryPausesAndResumesEventNames(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.New(t)
	dir := exporter.NewMeterDirectory()
	record := func(account string, mode stripeapi.Mode, ms ...stripeapi.Meter) []exporter.MeterChange {
		t.Helper()
		ch, err := exporter.RecordMeters(ctx, pool, account, mode, ms)
		require.NoError(t, err)
		dir.Invalidate()
		return ch
	}
	active := func(id, name string) stripeapi.Meter {
		return stripeapi.Meter{ID: id, EventName: name, Formula: "sum", Status: "active"}
	}
	inactive := func(id, name string) stripeapi.Meter {
		m := active(id, name)
		m.Status = "inactive"
		return m
	}

	ch := record("acct_a", stripeapi.ModeTest, active("mtr_old", "api_calls"), active("mtr_s", "storage"))
	require.Len(t, ch, 2, "new meters")
	record("acct_b", stripeapi.ModeTest, active("mtr_b", "api_calls"))
	record("acct_a", stripeapi.ModeLive, active("mtr_live", "api_calls"))
	assert.Empty(t, record("acct_a", stripeapi.ModeTest, active("mtr_old", "api_calls"), active("mtr_s", "storage")), "nothing changed")

	id, ok, err := dir.ActiveMeter(ctx, pool, "acct_a", outbox.ModeTest, "api_calls")
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, "mtr_old", id)

	// Deactivated, not replaced: paused in acct_a test mode only.
	ch = record("acct_a", stripeapi.ModeTest, inactive("mtr_old", "api_calls"), active("mtr_s", "storage"))
	require.Equal(t, []exporter.MeterChange{{Account: "acct_a", Mode: "test", ID: "mtr_old", EventName: "api_calls",
		From: "active", To: "inactive"}}, ch)
	paused, err := dir.Paused(ctx, pool)
	require.NoError(t, err)
	require.Len(t, paused, 1)
	assert.Equal(t, "acct_a", paused[0].Account)
	assert.Equal(t, "api_calls", paused[0].EventName)
	assert.Equal(t, "mtr_old", paused[0].Meter)
	skip, err := dir.SkipKeys(ctx, pool, outbox.ModeTest)
	require.NoError(t, err)
	assert.Equal(t, []string{outbox.MeterSkipKey("acct_a", "api_calls")}, skip)
	skip, err = dir.SkipKeys(ctx, pool, outbox.ModeLive)
	require.NoError(t, err)
	assert.Empty(t, skip, "the live meter of the name is active")
	_, ok, err = dir.ActiveMeter(ctx, pool, "acct_a", outbox.ModeTest, "api_calls")
	require.NoError(t, err)
	assert.False(t, ok)

	// Replaced by a new meter of the same name: resumed, and the new one is
	// the name's meter. The storage meter, missing from this list, keeps
	// its row.
	record("acct_a", stripeapi.ModeTest, active("mtr_new", "api_calls"), inactive("mtr_old", "api_calls"))
	paused, err = dir.Paused(ctx, pool)
	require.NoError(t, err)
	assert.Empty(t, paused)
	id, ok, err = dir.ActiveMeter(ctx, pool, "acct_a", outbox.ModeTest, "api_calls")
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, "mtr_new", id)
	id, _, err = dir.ActiveMeter(ctx, pool, "acct_a", outbox.ModeTest, "storage")
	require.NoError(t, err)
	assert.Equal(t, "mtr_s", id)
}
