package meter_test

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// cancel runs Cancel in a transaction of its own, committed when it
// succeeds.
func cancel(t *testing.T, e *stagetest.Env, cs ...meter.Cancellation) ([]meter.CancelResult, error) {
	t.Helper()
	var out []meter.CancelResult
	err := pgx.BeginFunc(e.Ctx, e.Pool, func(tx pgx.Tx) error {
		var err error
		out, err = e.Stager.Cancel(e.Ctx, tx, "token:ops", cs)
		return err
	})
	return out, err
}

// itemOf is the state and value of the item that carries a ledger row's
// usage now, and whether the row is marked cancelled.
func itemOf(t *testing.T, e *stagetest.Env, tenant, id string) (state outbox.State, value int64, cancelled bool) {
	t.Helper()
	require.NoError(t, e.Pool.QueryRow(e.Ctx, `SELECT o.state, (o.payload ->> 'value')::bigint, u.cancelled_at IS NOT NULL
		FROM usage_events u JOIN outbox_items o ON o.id = tally_live_item(u.item_id)
		WHERE u.tenant = $1 AND u.event_id = $2`, tenant, id).Scan(&state, &value, &cancelled))
	return state, value, cancelled
}

// Usage no attempt of which may have reached Stripe leaves its window:
// unstaged, it is staged straight into a withdrawn item, which the stager
// and the deliverers never see; a pending per-event item is withdrawn; a
// pending window's item is re-addressed without it (its successor carries
// the rest), or withdrawn when nothing else is left. A second cancellation
// answers the first's outcome.
func TestCancelUsageThatNeverReachedStripe(t *testing.T) {
	t.Parallel()
	e := stagetest.New(t, outbox.Config{})
	e.Feature(t, "api", mappings.Sum, time.Hour)
	e.Feature(t, "logins", mappings.Count, time.Hour)
	e.Tenant(t, "acme", nil)
	at := stagetest.Ago(3 * time.Hour)
	e.MustIngest(t, stagetest.Ev("w1", "acme", "api", 5, at), stagetest.Ev("w2", "acme", "api", 7, at),
		stagetest.Ev("solo", "acme", "api", 11, stagetest.Ago(30*time.Hour)),
		stagetest.Ev("l1", "acme", "logins", 1, at))

	// Unstaged: a withdrawn item, before any staging pass.
	out, err := cancel(t, e, meter.Cancellation{Tenant: "acme", ID: "solo"})
	require.NoError(t, err)
	require.Equal(t, meter.CancelWithdrawn, out[0].Outcome)
	require.NotNil(t, out[0].Item)
	st, v, cancelled := itemOf(t, e, "acme", "solo")
	require.Equal(t, outbox.StateWithdrawn, st)
	require.Equal(t, int64(11), v)
	require.True(t, cancelled)

	e.Pass(t)
	st, v, _ = itemOf(t, e, "acme", "w1")
	require.Equal(t, outbox.StatePending, st)
	require.Equal(t, int64(12), v, "the window holds w1 and w2; solo was never staged into it")
	st, _, _ = itemOf(t, e, "acme", "l1")
	require.Equal(t, outbox.StatePending, st)

	// Staged, never sent: the per-event item is withdrawn, the window
	// re-addressed to a successor without w1.
	out, err = cancel(t, e, meter.Cancellation{Tenant: "acme", ID: "l1"}, meter.Cancellation{Tenant: "acme", ID: "w1"})
	require.NoError(t, err)
	require.Equal(t, meter.CancelWithdrawn, out[0].Outcome)
	require.Nil(t, out[0].Item, "a per-event item is withdrawn, no successor")
	require.Equal(t, meter.CancelWithdrawn, out[1].Outcome)
	require.NotNil(t, out[1].Item, "the window's successor")
	st, _, _ = itemOf(t, e, "acme", "l1")
	require.Equal(t, outbox.StateWithdrawn, st)
	st, v, _ = itemOf(t, e, "acme", "w2")
	require.Equal(t, outbox.StatePending, st)
	require.Equal(t, int64(7), v, "the successor carries w2 alone")
	var superseded int
	require.NoError(t, e.Pool.QueryRow(e.Ctx, `SELECT count(*) FROM outbox_items WHERE state = 'superseded'`).Scan(&superseded))
	require.Equal(t, 1, superseded)

	// The completeness identity counts the cancelled usage in its own
	// bucket; the successor is consistent with the events left in it.
	cancelledEvents, cancelledValue := int64(0), quarantine.ValueOf(0)
	for _, month := range []string{at.Format("2006-01"), stagetest.Ago(30 * time.Hour).Format("2006-01")} {
		rep, err := quarantine.CompletenessOf(e.Ctx, e.Pool, month, "acme")
		require.NoError(t, err)
		require.True(t, rep.Holds, "%+v", rep)
		for _, l := range rep.Lines {
			cancelledEvents += l.Cancelled.Events
			cancelledValue = cancelledValue.Plus(l.Cancelled.Value)
		}
		if at.Format("2006-01") == stagetest.Ago(30*time.Hour).Format("2006-01") {
			break
		}
	}
	require.Equal(t, int64(3), cancelledEvents, "solo, l1 and w1")
	require.Equal(t, "17", cancelledValue.String(), "11 + 1 + 5")

	// The last event of the window: its successor is withdrawn.
	out, err = cancel(t, e, meter.Cancellation{Tenant: "acme", ID: "w2"})
	require.NoError(t, err)
	require.Nil(t, out[0].Item)
	st, _, _ = itemOf(t, e, "acme", "w2")
	require.Equal(t, outbox.StateWithdrawn, st)

	// Again: the first outcome, nothing changes.
	again, err := cancel(t, e, meter.Cancellation{Tenant: "acme", ID: "w1"}, meter.Cancellation{Tenant: "acme", ID: "w1"})
	require.NoError(t, err)
	for _, r := range again {
		require.True(t, r.Duplicate)
		require.Equal(t, meter.CancelWithdrawn, r.Outcome)
	}
	var n int
	require.NoError(t, e.Pool.QueryRow(e.Ctx, `SELECT count(*) FROM usage_cancellations`).Scan(&n))
	require.Equal(t, 4, n)
	require.Zero(t, e.Pass(t).Events, "nothing left to stage")
	_, err = e.Pool.Exec(e.Ctx, `UPDATE usage_events SET cancelled_at = NULL WHERE event_id = 'w1'`)
	require.ErrorContains(t, err, "cancellation are set once")
	_, err = e.Pool.Exec(e.Ctx, `DELETE FROM usage_cancellations`)
	require.ErrorContains(t, err, "never changed or deleted")
}

// Bad input, unknown events and items that cannot be decided now refuse
// the whole request: nothing of it is stored.
func TestCancelRefusesWholeAndStoresNothing(t *testing.T) {
	t.Parallel()
	e := stagetest.New(t, outbox.Config{})
	e.Feature(t, "logins", mappings.Count, time.Hour)
	e.Feature(t, "api", mappings.Sum, time.Hour)
	e.Tenant(t, "acme", nil)
	at := stagetest.Ago(3 * time.Hour)
	e.MustIngest(t, stagetest.Ev("a", "acme", "logins", 1, at), stagetest.Ev("b", "acme", "logins", 1, at),
		stagetest.Ev("c", "acme", "api", 4, at), stagetest.Ev("d", "acme", "logins", 1, at))
	e.Pass(t)

	_, err := cancel(t, e, meter.Cancellation{Tenant: "acme", ID: "a"}, meter.Cancellation{Tenant: "-bad", ID: ""},
		meter.Cancellation{Tenant: "acme", ID: "nope"})
	var ib *meter.InvalidBatchError
	require.True(t, errors.As(err, &ib), "%v", err)
	require.Len(t, ib.Problems, 2, "the malformed one's fields")
	_, err = cancel(t, e, meter.Cancellation{Tenant: "acme", ID: "a"}, meter.Cancellation{Tenant: "acme", ID: "nope"})
	require.True(t, errors.As(err, &ib), "%v", err)
	require.Equal(t, 1, *ib.Problems[0].Index)

	// b leased: in flight; c (a sum window) accepted; d rejected: nothing
	// to take back.
	leases, err := e.Outbox.Claim(e.Ctx, e.Pool, outbox.ClaimOptions{Owner: "w", Limit: 10, Policy: outbox.BestEffort})
	require.NoError(t, err)
	var bID int64
	for _, l := range leases {
		var ev string
		require.NoError(t, e.Pool.QueryRow(e.Ctx, `SELECT min(event_id) FROM usage_events WHERE item_id = $1`, l.ID).Scan(&ev))
		switch ev {
		case "b":
			bID = l.ID
		case "c":
			require.NoError(t, e.Outbox.Accept(e.Ctx, e.Pool, l, "req_c"))
		case "a":
			_, err := e.Outbox.Retry(e.Ctx, e.Pool, l, outbox.ErrorInfo{Code: "stripe_auth", Status: 401}, true)
			require.NoError(t, err)
		case "d":
			require.NoError(t, e.Outbox.Reject(e.Ctx, e.Pool, l, outbox.ErrorInfo{Code: "invalid_timestamp", Status: 400}))
		}
	}
	var ce *meter.CancelError
	_, err = cancel(t, e, meter.Cancellation{Tenant: "acme", ID: "a"}, meter.Cancellation{Tenant: "acme", ID: "b"})
	require.True(t, errors.As(err, &ce), "%v", err)
	require.Equal(t, meter.CodeCancelInFlight, ce.Code)
	require.Equal(t, bID, ce.Item)

	var n int
	require.NoError(t, e.Pool.QueryRow(e.Ctx, `SELECT count(*) FROM usage_cancellations`).Scan(&n))
	require.Zero(t, n, "nothing of a refused request is stored")
	require.NoError(t, e.Pool.QueryRow(e.Ctx, `SELECT count(*) FROM usage_events WHERE cancelled_at IS NOT NULL`).Scan(&n))
	require.Zero(t, n)
	st, _, _ := itemOf(t, e, "acme", "a")
	require.Equal(t, outbox.StatePending, st, "a refused attempt only: a is still pending, not withdrawn by the refused request")

	// Alone, a (every attempt refused) is withdrawn; d, which Stripe
	// refused, needs nothing taken back; c, in a sum window Stripe has, is
	// offset by a supplement of the negated value, addressed as its window.
	out, err := cancel(t, e, meter.Cancellation{Tenant: "acme", ID: "a"}, meter.Cancellation{Tenant: "acme", ID: "d"},
		meter.Cancellation{Tenant: "acme", ID: "c"})
	require.NoError(t, err)
	require.Equal(t, meter.CancelWithdrawn, out[0].Outcome)
	require.Equal(t, meter.CancelNotBilled, out[1].Outcome)
	require.Nil(t, out[1].Item)
	require.Equal(t, meter.CancelSupplement, out[2].Outcome)
	sup, err := e.Outbox.Get(e.Ctx, e.Pool, *out[2].Item)
	require.NoError(t, err)
	require.Equal(t, outbox.StatePending, sup.State)
	require.Equal(t, int64(-4), sup.Payload.Value)
	require.Empty(t, sup.Payload.Cancels, "sent as a meter event, not an adjustment")
	var window outbox.Item
	require.NoError(t, e.Pool.QueryRow(e.Ctx, `SELECT item_id FROM usage_events WHERE event_id = 'c'`).Scan(&window.ID))
	window, err = e.Outbox.Get(e.Ctx, e.Pool, window.ID)
	require.NoError(t, err)
	require.Equal(t, window.OrderingKey, sup.OrderingKey, "the window's customer, meter and account")
	require.Equal(t, window.Payload.Timestamp, sup.Payload.Timestamp)
	st, _, _ = itemOf(t, e, "acme", "d")
	require.Equal(t, outbox.StateRejected, st, "the rejected item stays as it is")
	rep, err := quarantine.CompletenessOf(e.Ctx, e.Pool, at.Format("2006-01"), "acme")
	require.NoError(t, err)
	require.True(t, rep.Holds, "%+v", rep)
}

// Two requests cancelling the same event at once: one decides, the other
// waits for its lock and answers the first's outcome; nothing fails.
func TestConcurrentCancellationsOfOneEvent(t *testing.T) {
	t.Parallel()
	e := stagetest.New(t, outbox.Config{})
	e.Feature(t, "logins", mappings.Count, time.Hour)
	e.Tenant(t, "acme", nil)
	e.MustIngest(t, stagetest.Ev("x", "acme", "logins", 1, stagetest.Ago(3*time.Hour)))
	first, err := e.Pool.Begin(e.Ctx)
	require.NoError(t, err)
	defer func() { _ = first.Rollback(e.Ctx) }()
	out, err := e.Stager.Cancel(e.Ctx, first, "token:a", []meter.Cancellation{{Tenant: "acme", ID: "x"}})
	require.NoError(t, err)
	require.False(t, out[0].Duplicate)

	done := make(chan []meter.CancelResult, 1)
	go func() {
		res, err := cancel(t, e, meter.Cancellation{Tenant: "acme", ID: "x"})
		if err != nil {
			t.Error(err)
		}
		done <- res
	}()
	time.Sleep(100 * time.Millisecond)
	require.NoError(t, first.Commit(e.Ctx))
	second := <-done
	require.Len(t, second, 1)
	require.True(t, second[0].Duplicate)
	require.Equal(t, out[0].Outcome, second[0].Outcome)
}
