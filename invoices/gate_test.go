package invoices_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/quarantine"
)

// deliver runs a deliverer against the simulator, and the outbox's
// maintenance, until the test ends.
func (b *billing) deliver() {
	d, err := exporter.NewDeliverer(exporter.DelivererConfig{Workers: 1, Batch: 20, InFlight: 4, PollInterval: 20 * time.Millisecond},
		b.env.Outbox, b.env.Pool, exporter.NewStripeV1(b.resolver.Client(), 5*time.Second), 5*time.Second,
		b.resolver.Destination, exporter.NewLimiter(1000), nil, nil)
	require.NoError(b.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = d.Run(ctx) }()
	go func() {
		defer wg.Done()
		_ = b.env.Outbox.RunMaintenance(ctx, b.env.Pool, 20*time.Millisecond, slog.Default())
	}()
	b.t.Cleanup(func() { cancel(); wg.Wait() })
}

// accepted waits until no item is pending or leased.
func (b *billing) accepted() {
	require.Eventually(b.t, func() bool {
		var open int
		_ = b.env.Pool.QueryRow(b.ctx, `SELECT count(*) FROM outbox_items WHERE state IN ('pending', 'leased')`).Scan(&open)
		return open == 0
	}, 20*time.Second, 20*time.Millisecond)
}

// gateState reads a gate's state and whether it counts as incomplete.
func (b *billing) gateState(invoice string) (invoices.GateState, bool) {
	var (
		state      string
		incomplete bool
	)
	require.NoError(b.t, b.env.Pool.QueryRow(b.ctx, `SELECT state, incomplete FROM invoice_gates WHERE invoice = $1`, invoice).Scan(&state, &incomplete))
	return invoices.GateState(state), incomplete
}

// With the hold on, a draft whose period has a quarantined item is held
// (auto_advance false), the incomplete gauge says so and Stripe does not
// finalize it; once the mapping is fixed and the item requeued and
// accepted, the gate releases it (finalized now: its time has passed)
// and the finalized invoice matches the ledger. A hold that runs out
// releases the draft incomplete, counts it, and the comparison reports
// what it lacks. Every hold and release is audited.
func TestGateHoldsADraftUntilItsPeriodIsComplete(t *testing.T) {
	t.Parallel()
	for _, bounded := range []bool{false, true} {
		name := "complete"
		if bounded {
			name = "bounded"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := newBilling(t)
			calls := b.meterFor("api_calls", mappings.Sum, "2")
			exports := b.sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "exports"})
			_, err := b.env.Pool.Exec(b.ctx, `INSERT INTO stripe_meters (account, mode, id, event_name, status, formula)
				VALUES ('', 'test', $1, 'exports', 'active', 'sum')`, exports.ID)
			require.NoError(t, err)
			exportsPrice := b.sim.CreatePrice(stripesim.DefaultAccount, stripesim.PriceSpec{UnitAmountDecimal: "5", Meter: exports.ID})
			b.subscribe(calls, exportsPrice)
			b.clock.Add(b.anchor.Sub(b.clock.Now()) - time.Minute) // Stripe takes usage up to its now
			b.deliver()

			b.ledger("c1", "api_calls", 5, 10*24*time.Hour)
			b.ledger("x1", "exports", 4, 3*24*time.Hour) // no mapping yet: quarantined
			b.accepted()

			reg := prometheus.NewRegistry()
			metrics, err := invoices.NewGateMetrics(reg)
			require.NoError(t, err)
			metrics.Use(b.env.Pool)
			gate := &invoices.Gate{DB: b.env.Pool, Stager: b.env.Stager, Holder: b.reader, Hold: true,
				HoldMax: time.Hour, Metrics: metrics, Logger: slog.New(slog.DiscardHandler)}
			if bounded {
				gate.HoldMax = time.Second
			}
			rc := invoices.Receiver{Reader: b.reader, Maps: b.env.Maps, Gate: gate}
			receive := func(id string) invoices.Received {
				r, err := rc.Receive(b.ctx, b.env.Pool, b.cus, id)
				require.NoError(t, err)
				return r
			}
			draft, _ := b.invoice(2 * time.Minute)
			require.Equal(t, "draft", draft.Status)
			receive(draft.ID)
			state, incomplete := b.gateState(draft.ID)
			require.Equal(t, invoices.GateHeld, state)
			require.True(t, incomplete)
			require.Equal(t, 1.0, testutil.ToFloat64(metrics), "the alert's gauge")
			b.clock.Add(2 * time.Hour)
			held, _ := b.invoice(0)
			require.Equal(t, "draft", held.Status, "a held draft is not finalized")
			require.False(t, held.AutoAdvance)

			f, _, err := b.env.Maps.PutFeature(b.ctx, b.env.Pool, "exports", mappings.FeatureInput{EventName: "exports",
				Aggregation: mappings.Sum, Window: mappings.Duration(time.Hour)}, "op")
			require.NoError(t, err)
			if bounded {
				// The mapping is fixed, the item is not requeued in time.
				time.Sleep(1100 * time.Millisecond)
				n, err := gate.CheckOpen(b.ctx, 10)
				require.NoError(t, err)
				require.Equal(t, 1, n)
				state, _ = b.gateState(draft.ID)
				require.Equal(t, invoices.GateReleased, state)
				n, err = testutil.GatherAndCount(reg, "tally_invoice_holds_expired_total")
				require.NoError(t, err)
				require.Equal(t, 1, n)
			} else {
				var item int64
				require.NoError(t, b.env.Pool.QueryRow(b.ctx, `SELECT id FROM outbox_items WHERE state = 'quarantined'`).Scan(&item))
				rq := &quarantine.Requeuer{Outbox: b.env.Outbox, Stager: b.env.Stager}
				_, err = rq.Requeue(b.ctx, b.env.Pool, item, f.Version, "op")
				require.NoError(t, err)
				b.accepted()
				_, err = gate.CheckOpen(b.ctx, 10)
				require.NoError(t, err)
				state, _ = b.gateState(draft.ID)
				require.Equal(t, invoices.GateComplete, state)
			}
			require.Equal(t, 0.0, testutil.ToFloat64(metrics))
			final, r := b.invoice(0)
			require.Equal(t, "open", final.Status, "released: finalized now, its time had passed")
			r = receive(final.ID)
			checks := byName(r.Checks)
			if bounded {
				require.Equal(t, invoices.Matches, checks["api_calls"].Status)
				require.Equal(t, []string{invoices.KindInvoicedLess}, checks["exports"].Kinds)
				require.Equal(t, value(0), checks["exports"].Invoiced)
				require.Equal(t, value(4), checks["exports"].Expected)
			} else {
				for name, c := range checks {
					require.Equal(t, invoices.Matches, c.Status, "%s: %+v", name, c)
				}
				require.Equal(t, value(4), checks["exports"].Invoiced)
			}
			var audited []string
			rows, err := b.env.Pool.Query(b.ctx, `SELECT action || ' ' || to_state FROM audit_log WHERE action LIKE 'invoice.%' ORDER BY id`)
			require.NoError(t, err)
			for rows.Next() {
				var a string
				require.NoError(t, rows.Scan(&a))
				audited = append(audited, a)
			}
			release := "invoice.release complete"
			if bounded {
				release = "invoice.release released"
			}
			require.Equal(t, []string{"invoice.hold held", release}, audited)
		})
	}
}
