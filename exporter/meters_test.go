package exporter_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
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

// A deliverer with the directory leaves a paused event name's items
// pending without attempts, parked out of its claims' way —
// tally_export_stalled{reason="meter_deactivated"} is 1 and Stalls.Meters
// names the meter — and sends every other name's; once the meter is active
// again the items are due at once, go out and record it.
func TestDeactivatedMeterPausesItsEventName(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	dir := exporter.NewMeterDirectory()
	client := r.resolver.Client()
	refresh := func() {
		t.Helper()
		_, err := exporter.RefreshMeters(r.Ctx, r.Pool, client, stripesim.DefaultAccount)
		require.NoError(t, err)
		dir.Invalidate()
	}
	var logins string
	for _, m := range r.sim.Meters(stripesim.DefaultAccount) {
		if m.EventName == "logins" {
			logins = m.ID
		}
	}
	require.NoError(t, r.sim.DeactivateMeter(stripesim.DefaultAccount, logins))
	refresh()
	stalls := exporter.NewStalls(r.resolver, r.Outbox, r.Pool, 0).WithMeters(dir)
	reg := prometheus.NewRegistry()
	reg.MustRegister(stalls)
	require.Equal(t, 1.0, stalledSeries(t, reg)["meter_deactivated"])
	paused, err := stalls.Meters(r.Ctx)
	require.NoError(t, err)
	require.Len(t, paused, 1)
	require.Equal(t, logins, paused[0].Meter)
	require.Contains(t, paused[0].Explain(), "logins")

	// Usage staged before the deliverer starts: its first claim parks it.
	r.MustIngest(t, stagetest.Ev("l1", "t1", "logins", 1, nil), stagetest.Ev("l2", "t2", "logins", 1, nil))
	d, err := exporter.NewDeliverer(exporter.DelivererConfig{PollInterval: 20 * time.Millisecond, Meters: dir}, r.Outbox, r.Pool,
		exporter.NewStripeV1(client, time.Second), time.Second, r.resolver.Destination, exporter.NewLimiter(5000), nil, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(r.Ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	defer func() { cancel(); <-done }()

	require.Never(t, func() bool {
		var attempted int
		require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM outbox_item_states WHERE attempts > 0`).Scan(&attempted))
		return attempted > 0
	}, 300*time.Millisecond, 20*time.Millisecond, "a paused name's items are not attempted")
	require.Eventually(t, func() bool {
		var parked int
		require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM outbox_item_states
			WHERE state = 'pending' AND next_attempt_at > clock_timestamp() + interval '30 seconds'`).Scan(&parked))
		return parked == 2
	}, 10*time.Second, 20*time.Millisecond, "parked out of the claims' way")
	require.Never(t, func() bool {
		var attempted int
		require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM outbox_item_states WHERE attempts > 0`).Scan(&attempted))
		return attempted > 0
	}, 100*time.Millisecond, 20*time.Millisecond, "parked items are not attempted")

	require.NoError(t, r.sim.ReactivateMeter(stripesim.DefaultAccount, logins))
	refresh()
	r.waitDrained(t)
	var recorded int
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM outbox_item_states WHERE state = 'accepted' AND meter = $1`,
		logins).Scan(&recorded))
	require.Equal(t, 2, recorded)
	require.Equal(t, 0.0, stalledSeries(t, reg)["meter_deactivated"])
}
