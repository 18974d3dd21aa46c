package reconcile_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// meterRig is the rig with the meter directory the deliverer consults.
type meterRig struct {
	*rig
	dir    *exporter.MeterDirectory
	client *stripeapi.Client
	// dl is the node's deliverer, which keeps what it parked across runs.
	dl *exporter.Deliverer
}

// refresh reads the simulator's meters into the directory, as the hourly
// listing or a billing.meter.* event does.
func (m *meterRig) refresh(t *testing.T) {
	t.Helper()
	_, err := exporter.RefreshMeters(m.Ctx, m.Pool, m.client, stripesim.DefaultAccount)
	require.NoError(t, err)
	m.dir.Invalidate()
}

// deliver stages what is due and runs a deliverer with the directory for
// d, or until nothing is pending or leased.
func (m *meterRig) deliver(t *testing.T, d time.Duration) {
	t.Helper()
	m.Pass(t)
	if m.dl == nil {
		dl, err := exporter.NewDeliverer(exporter.DelivererConfig{PollInterval: 10 * time.Millisecond, Meters: m.dir}, m.Outbox, m.Pool,
			m.exp, 2*time.Second, func() (exporter.Destination, error) {
				return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: stripesim.DefaultAccount, Mode: outbox.ModeTest}, nil
			}, exporter.NewLimiter(1000), nil, nil)
		require.NoError(t, err)
		m.dl = dl
	}
	ctx, cancel := context.WithTimeout(m.Ctx, d)
	defer cancel()
	done := make(chan struct{})
	go func() { defer close(done); _ = m.dl.Run(ctx) }()
	for ctx.Err() == nil {
		if c := m.counts(t); c[outbox.StatePending]+c[outbox.StateLeased] == 0 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	<-done
}

// metersOf maps each accepted or confirmed item to the meter it recorded.
func (m *meterRig) metersOf(t *testing.T) map[int64]string {
	t.Helper()
	rows, err := m.Pool.Query(m.Ctx, `SELECT id, coalesce(meter, '') FROM outbox_item_states WHERE state IN ('accepted', 'confirmed')`)
	require.NoError(t, err)
	out := map[int64]string{}
	for rows.Next() {
		var id int64
		var meter string
		require.NoError(t, rows.Scan(&id, &meter))
		out[id] = meter
	}
	require.NoError(t, rows.Err())
	return out
}

// A meter deactivated with no active meter of its event name pauses its
// items (pending, no attempt) and nothing else; a new meter of the name
// resumes them, and every accepted item records the meter it went to.
// Reconciliation then reads each item's meter: no hour sent to the old
// meter — nor the hour whose items went to both — is a discrepancy. The
// control: the same items without their meter recorded are compared with
// the new meter alone, and the old hours are Stripe having less.
func TestMeterReplacedUnderTheSameEventName(t *testing.T) {
	t.Parallel()
	r := newRig(t, outbox.Config{})
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: r.base})
	require.NoError(t, err)
	m := &meterRig{rig: r, dir: exporter.NewMeterDirectory(), client: client}
	m.refresh(t)
	old := map[string]string{}
	for _, mt := range r.sim.Meters(stripesim.DefaultAccount) {
		if mt.EventName != "logins" {
			old[mt.EventName] = mt.ID
		}
	}

	// Usage of the sum and the last meter over three hours, sent to the
	// old meters.
	post := func(prefix string, hoursAgo ...int) {
		for _, h := range hoursAgo {
			for tn := 0; tn < 3; tn++ {
				ts := stagetest.Ago(time.Duration(h)*time.Hour + time.Duration(10+tn)*time.Minute)
				id := fmt.Sprintf("%s-%d-%d", prefix, h, tn)
				r.MustIngest(t, stagetest.Ev("a"+id, fmt.Sprintf("t%d", tn), "api", int64(h+tn+1), ts),
					stagetest.Ev("s"+id, fmt.Sprintf("t%d", tn), "seats", int64(10*h+tn), ts))
			}
		}
	}
	post("old", 5, 4, 3)
	m.deliver(t, 10*time.Second)
	for id, meter := range m.metersOf(t) {
		require.Contains(t, []string{old["api"], old["seats"]}, meter, "item %d", id)
	}
	oldItems := len(m.metersOf(t))

	// Both meters deactivated, not replaced: their items wait.
	for _, id := range old {
		require.NoError(t, r.sim.DeactivateMeter(stripesim.DefaultAccount, id))
	}
	m.refresh(t)
	post("late", 4) // late usage of an hour the old meters have
	m.deliver(t, 300*time.Millisecond)
	var waiting, attempted int
	require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*), count(*) FILTER (WHERE attempts > 0)
		FROM outbox_item_states WHERE state = 'pending'`).Scan(&waiting, &attempted))
	require.Equal(t, 6, waiting, "the paused names' items wait")
	require.Zero(t, attempted, "without attempts")
	paused, err := m.dir.Paused(r.Ctx, r.Pool)
	require.NoError(t, err)
	require.Len(t, paused, 2)

	// Replaced under the same event names: the waiting items and new
	// usage go to the new meters.
	for name, formula := range map[string]string{"api": "sum", "seats": "last"} {
		r.sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: name, Formula: formula})
	}
	m.refresh(t)
	post("new", 2)
	m.deliver(t, 10*time.Second)
	meters := m.metersOf(t)
	require.Len(t, meters, oldItems+12)
	newIDs := map[string]bool{}
	for _, id := range meters {
		if id != old["api"] && id != old["seats"] {
			newIDs[id] = true
		}
	}
	require.Len(t, newIDs, 2, "the new meters")

	run, ds := r.run(t, reconcile.Options{Settle: settled})
	require.Empty(t, ds, "no hour sent to the old meters is a discrepancy")
	require.Equal(t, len(meters), int(run.ItemsConfirmed))

	// The control: without the meters recorded, the old meters' hours are
	// read from the new meters, which hold nothing there.
	_, err = r.Pool.Exec(r.Ctx, `UPDATE outbox_item_states SET meter = NULL`)
	require.NoError(t, err)
	_, ds = r.run(t, reconcile.Options{Settle: settled})
	require.NotEmpty(t, ds)
	for _, d := range ds {
		require.Equal(t, "stripe_has_less", d.Kind, "%+v", d)
	}
}
