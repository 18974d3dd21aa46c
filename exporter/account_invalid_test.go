package exporter_test

import (
	"context"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/syncbuf"
	"github.com/tallymeter/tally/outbox"
)

// A Connect destination whose access is revoked, answered with Stripe's
// account_invalid at the worst plausible status (400, which alone would
// read as an unrecognised refusal of each item): export stalls visibly and
// no item is quarantined; restored, the waiting items are delivered.
func TestRevokedConnectDestinationStallsNotQuarantines(t *testing.T) {
	t.Parallel()
	const conn = "acct_connected1"
	r := newRig(t, outbox.Config{BackoffBase: 20 * time.Millisecond, BackoffCap: 50 * time.Millisecond, Lease: 10 * time.Second},
		func(o *stripesim.Options) { o.AccountInvalidStatus = http.StatusBadRequest })
	r.sim.AddAccount(conn)
	r.sim.CreateMeter(conn, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
	for _, c := range []string{"cus_t1", "cus_t2"} {
		r.sim.CreateCustomer(conn, c)
	}
	res, err := exporter.NewResolver(exporter.Settings{Key: stripesim.DefaultKey, APIBase: r.base, Account: conn})
	require.NoError(t, err)
	dest, err := res.Resolve(r.Ctx)
	require.NoError(t, err)
	r.Target.Account = dest.Account
	var logs syncbuf.Buffer
	d, err := exporter.NewDeliverer(exporter.DelivererConfig{Workers: 2, Batch: 10, InFlight: 8, PollInterval: 20 * time.Millisecond, Keys: res},
		r.Outbox, r.Pool, exporter.NewStripeV1(res.Client(), time.Second), time.Second, res.Destination,
		exporter.NewLimiter(1000), slog.New(slog.NewTextHandler(&logs, nil)), nil)
	require.NoError(t, err)

	r.sim.RevokeAccess(conn)
	r.MustIngest(t, stagetest.Ev("l1", "t1", "logins", 1, nil), stagetest.Ev("l2", "t2", "logins", 1, nil))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	defer func() { cancel(); <-done }()

	require.Eventually(t, func() bool { return res.Check(r.Ctx) != nil }, 10*time.Second, 10*time.Millisecond)
	require.ErrorContains(t, res.Check(r.Ctx), "(status 400)")
	var refused int
	require.Eventually(t, func() bool {
		require.NoError(t, r.Pool.QueryRow(r.Ctx, `SELECT count(*) FROM outbox_attempts WHERE error_code = 'stripe_account_refused' AND refused`).Scan(&refused))
		return refused >= 4
	}, 10*time.Second, 10*time.Millisecond)
	c := r.counts(t)
	require.Zero(t, c[outbox.StateQuarantined], "the destination's fault quarantines no item: %v", c)
	require.Equal(t, int64(2), c[outbox.StatePending]+c[outbox.StateLeased], "%v", c)
	require.Empty(t, r.sim.Events(conn))

	r.sim.RestoreAccess(conn)
	require.Eventually(t, func() bool { return r.counts(t)[outbox.StateAccepted] == 2 }, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, res.Check(r.Ctx))
	require.Len(t, r.sim.Events(conn), 2)
	require.Contains(t, logs.String(), "export resumed")
}
