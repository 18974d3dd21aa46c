package outbox_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// counterValue reads one series of a counter family of the bundle's
// registry: labels are name, value pairs.
func (b *testBundle) counterValue(name string, labels ...string) float64 {
	mfs, _ := b.reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if got[labels[i]] != labels[i+1] {
					continue next
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// accepted enqueues one item and takes it to accepted in one attempt.
func (b *testBundle) accepted(t *testing.T, n int) outbox.Lease {
	t.Helper()
	ids := b.enqueue(t, newItem(n))
	l := b.claimOne(t)
	require.Equal(t, ids[0], l.ID)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "req_"+l.Identifier[4:12]))
	return l
}

func (b *testBundle) attemptRows(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(b.ctx, "SELECT count(*) FROM outbox_attempts").Scan(&n))
	return n
}

// fail_accepted moves accepted items to quarantined with the reason, or to
// rejected, with the provider's code and sanitised message; the provider's
// reference stays, and the attempt log is not written (fail_accepted is no
// claim's outcome).
func TestFailAcceptedQuarantinesOrRejects(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	q := b.accepted(t, 1)
	r := b.accepted(t, 2)
	logged := b.attemptRows(t)

	long := "No active meter was found for event_name 'api_calls' sk_live_abcdefghijklmnop " + strings.Repeat("x", 300)
	failed, refused, err := b.store.FailAccepted(b.ctx, b.pool, []outbox.ProviderFailure{
		{ID: q.ID, To: outbox.StateQuarantined, Reason: outbox.ReasonMeterNotFound, Error: outbox.ErrorInfo{Code: "no_meter", Message: long}},
		{ID: r.ID, To: outbox.StateRejected, Error: outbox.ErrorInfo{Code: "timestamp_too_far_in_past", Message: "Timestamp too far in the past"}},
	})
	require.NoError(t, err)
	require.Empty(t, refused)
	require.ElementsMatch(t, []int64{q.ID, r.ID}, failed)

	it := b.get(t, q.ID)
	require.Equal(t, outbox.StateQuarantined, it.State)
	require.Equal(t, outbox.ReasonMeterNotFound, it.QuarantineReason)
	require.Equal(t, "no_meter", it.LastError.Code)
	require.Zero(t, it.LastError.Status, "a report answers no request")
	require.NotContains(t, it.LastError.Message, "sk_live", "secrets never reach the row")
	require.LessOrEqual(t, len([]rune(it.LastError.Message)), outbox.MaxErrorMessage)
	require.NotEmpty(t, it.ProviderRef, "the acceptance stays on the record")
	require.NotNil(t, it.AcceptedAt)

	it = b.get(t, r.ID)
	require.Equal(t, outbox.StateRejected, it.State)
	require.Empty(t, it.QuarantineReason)
	require.Equal(t, &outbox.ErrorInfo{Code: "timestamp_too_far_in_past", Message: "Timestamp too far in the past"}, it.LastError)

	require.Equal(t, logged, b.attemptRows(t), "fail_accepted is not an attempt's outcome")
	require.Equal(t, 1.0, b.counterValue("tally_outbox_transitions_total", "transition", "fail_accepted", "state", "quarantined"))
	require.Equal(t, 1.0, b.counterValue("tally_outbox_transitions_total", "transition", "fail_accepted", "state", "rejected"))
	require.Equal(t, 1.0, b.counterValue("tally_outbox_quarantined_total", "reason", "meter_not_found"))
	require.Zero(t, b.stale(outbox.TransitionFailAccepted))

	// Nothing automatic leaves rejected: a second report finds it moved.
	_, refused, err = b.store.FailAccepted(b.ctx, b.pool, []outbox.ProviderFailure{{ID: r.ID, To: outbox.StateRejected, Error: outbox.ErrorInfo{Code: "x"}}})
	require.NoError(t, err)
	require.ErrorIs(t, refused[r.ID], outbox.ErrStateMismatch)
}

// fail_accepted on an item that is not accepted — leased, pending, confirmed,
// already quarantined, rejected, unknown — reports a *StateError
// (ErrNotFound) per item, counted as stale, and changes nothing at all; the
// accepted items of the same batch still move.
func TestFailAcceptedRefusesItemsNotAccepted(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ok := b.accepted(t, 1)
	confirmed := b.accepted(t, 2)
	_, _, err := b.store.Confirm(b.ctx, b.pool, []int64{confirmed.ID})
	require.NoError(t, err)
	b.enqueue(t, newItem(3))
	quarantined := b.claimOne(t)
	require.NoError(t, b.store.Quarantine(b.ctx, b.pool, quarantined, outbox.ReasonAccountMismatch, outbox.ErrorInfo{Code: "account_mismatch"}))
	require.Equal(t, 1.0, b.counterValue("tally_outbox_quarantined_total", "reason", "account_mismatch"), "quarantine counts, as the help says")
	b.enqueue(t, newItem(4))
	rejected := b.claimOne(t)
	require.NoError(t, b.store.Reject(b.ctx, b.pool, rejected, outbox.ErrorInfo{Code: "invalid_request", Status: 400}))
	b.enqueue(t, newItem(5))
	leased := b.claimOne(t)
	pending := b.enqueue(t, newItem(6))[0]

	others := []int64{confirmed.ID, quarantined.ID, rejected.ID, leased.ID, pending}
	before := map[int64]outbox.Item{}
	for _, id := range others {
		before[id] = b.get(t, id)
	}
	var fs []outbox.ProviderFailure
	for _, id := range append([]int64{ok.ID, 999999}, others...) {
		fs = append(fs, outbox.ProviderFailure{ID: id, To: outbox.StateQuarantined, Reason: outbox.ReasonCustomerNotFound,
			Error: outbox.ErrorInfo{Code: "meter_event_customer_not_found"}})
	}
	failed, refused, err := b.store.FailAccepted(b.ctx, b.pool, fs)
	require.NoError(t, err)
	require.Equal(t, []int64{ok.ID}, failed)
	require.Len(t, refused, len(others)+1)
	require.ErrorIs(t, refused[999999], outbox.ErrNotFound)
	for _, id := range others {
		var se *outbox.StateError
		require.ErrorAs(t, refused[id], &se, "item %d", id)
		require.Equal(t, outbox.TransitionFailAccepted, se.Transition)
		require.Equal(t, outbox.StateAccepted, se.Expected)
		require.Equal(t, before[id].State, se.Current)
		require.Equal(t, before[id], b.get(t, id), "a refused fail_accepted changes nothing")
	}
	require.Equal(t, float64(len(others)+1), b.stale(outbox.TransitionFailAccepted))
	require.Equal(t, outbox.StateQuarantined, b.get(t, ok.ID).State)

	// The leased item's owner still settles it: fail_accepted did not touch
	// its lease.
	require.NoError(t, b.store.Accept(b.ctx, b.pool, leased, "req_late"))
}

// The same failure twice (a report delivered again, or two reports naming
// one item): the second moves nothing and says where the item is.
func TestFailAcceptedTwiceMovesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	l := b.accepted(t, 1)
	f := []outbox.ProviderFailure{{ID: l.ID, To: outbox.StateQuarantined, Reason: outbox.ReasonMeterNotFound, Error: outbox.ErrorInfo{Code: "no_meter"}}}
	failed, _, err := b.store.FailAccepted(b.ctx, b.pool, f)
	require.NoError(t, err)
	require.Equal(t, []int64{l.ID}, failed)
	once := b.get(t, l.ID)

	failed, refused, err := b.store.FailAccepted(b.ctx, b.pool, f)
	require.NoError(t, err)
	require.Empty(t, failed)
	var se *outbox.StateError
	require.ErrorAs(t, refused[l.ID], &se)
	require.Equal(t, outbox.StateQuarantined, se.Current)
	require.Equal(t, once, b.get(t, l.ID))
	require.Equal(t, 1.0, b.counterValue("tally_outbox_transitions_total", "transition", "fail_accepted", "state", "quarantined"))
	require.Equal(t, 1.0, b.stale(outbox.TransitionFailAccepted))
}

// Bad input is refused before anything is written.
func TestFailAcceptedInputErrors(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	l := b.accepted(t, 1)
	for name, fs := range map[string][]outbox.ProviderFailure{
		"twice":                 {{ID: l.ID, To: outbox.StateRejected}, {ID: l.ID, To: outbox.StateRejected}},
		"to pending":            {{ID: l.ID, To: outbox.StatePending}},
		"to confirmed":          {{ID: l.ID, To: outbox.StateConfirmed}},
		"quarantine, no reason": {{ID: l.ID, To: outbox.StateQuarantined}},
		"unknown reason":        {{ID: l.ID, To: outbox.StateQuarantined, Reason: "bogus"}},
		"reject with a reason":  {{ID: l.ID, To: outbox.StateRejected, Reason: outbox.ReasonMeterNotFound}},
	} {
		_, _, err := b.store.FailAccepted(b.ctx, b.pool, fs)
		require.Error(t, err, name)
	}
	require.Equal(t, outbox.StateAccepted, b.get(t, l.ID).State)
	failed, refused, err := b.store.FailAccepted(b.ctx, b.pool, nil)
	require.NoError(t, err)
	require.Empty(t, failed)
	require.Empty(t, refused)
}

// The report proves that the event the provider received under the item's
// identifier was not recorded. With exactly one attempt that may have
// reached the provider, nothing of the item was recorded: refused_attempts
// becomes attempts and the item may be re-addressed. With several, a later
// send may have been recorded: refused_attempts stays.
func TestFailAcceptedRefusedAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	fail := func(id int64) outbox.Item {
		t.Helper()
		failed, refused, err := b.store.FailAccepted(b.ctx, b.pool, []outbox.ProviderFailure{
			{ID: id, To: outbox.StateQuarantined, Reason: outbox.ReasonMeterNotFound, Error: outbox.ErrorInfo{Code: "no_meter"}}})
		require.NoError(t, err)
		require.Empty(t, refused)
		require.Equal(t, []int64{id}, failed)
		return b.get(t, id)
	}
	// claimAgain retries lease l (refused or not) and claims the item again.
	claimAgain := func(l outbox.Lease, refused bool) outbox.Lease {
		t.Helper()
		_, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "x"}, refused)
		require.NoError(t, err)
		time.Sleep(10 * time.Millisecond)
		next := b.claimOne(t)
		require.Equal(t, l.ID, next.ID)
		return next
	}

	// One attempt, accepted.
	one := b.accepted(t, 1)
	it := fail(one.ID)
	require.Equal(t, 1, it.Attempts)
	require.Equal(t, 1, it.RefusedAttempts)

	// A 401 (refused), then accepted: still only one attempt may have reached.
	b.enqueue(t, newItem(2))
	l := claimAgain(b.claimOne(t), true)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "req"))
	it = fail(l.ID)
	require.Equal(t, 2, it.Attempts)
	require.Equal(t, 2, it.RefusedAttempts)

	// A timeout, then accepted: two sends carried the identifier.
	b.enqueue(t, newItem(3))
	l = claimAgain(b.claimOne(t), false)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "req"))
	it = fail(l.ID)
	require.Equal(t, 2, it.Attempts)
	require.Equal(t, 0, it.RefusedAttempts)
}

// A fail_accepted-quarantined item is requeued like any quarantined item
// (requeue, same identifier, a fresh attempt budget) and re-addressed
// (supersede) only when refused_attempts = attempts.
func TestFailAcceptedThenRequeueOrReaddress(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	quarantine := func(id int64) {
		t.Helper()
		failed, _, err := b.store.FailAccepted(b.ctx, b.pool, []outbox.ProviderFailure{
			{ID: id, To: outbox.StateQuarantined, Reason: outbox.ReasonMeterNotFound, Error: outbox.ErrorInfo{Code: "no_meter"}}})
		require.NoError(t, err)
		require.Equal(t, []int64{id}, failed)
	}
	supersede := func(id int64, succ outbox.NewItem) (outbox.Enqueued, error) {
		t.Helper()
		tx, err := b.pool.Begin(b.ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(b.ctx) }()
		res, err := b.store.Supersede(b.ctx, tx, id, 1, succ)
		if err != nil {
			return res, err
		}
		return res, tx.Commit(b.ctx)
	}

	// Requeue in place: back to pending, sent again with the same identifier.
	l := b.accepted(t, 1)
	quarantine(l.ID)
	require.NoError(t, b.store.Requeue(b.ctx, b.pool, l.ID, 1))
	it := b.get(t, l.ID)
	require.Equal(t, outbox.StatePending, it.State)
	require.Empty(t, it.QuarantineReason)
	require.Equal(t, it.Attempts, it.AttemptsBase, "a fresh attempt budget")
	again := b.claimOne(t)
	require.Equal(t, l.ID, again.ID)
	require.Equal(t, l.Identifier, again.Identifier)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, again, "req_again"))

	// Re-address: one attempt reached the provider and its report proves it
	// unrecorded, so a successor under a new identity may carry the usage.
	l = b.accepted(t, 2)
	quarantine(l.ID)
	succ := newItem(2)
	succ.MappingVersion = 2
	res, err := supersede(l.ID, succ)
	require.NoError(t, err)
	require.True(t, res.Inserted)
	require.Equal(t, outbox.StateSuperseded, b.get(t, l.ID).State)

	// Two sends carried the identifier: it keeps it for good.
	require.Equal(t, res.ID, b.claimOne(t).ID, "the successor goes out")
	b.enqueue(t, newItem(3))
	l = b.claimOne(t)
	_, err = b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "timeout"}, false)
	require.NoError(t, err)
	time.Sleep(10 * time.Millisecond)
	l = b.claimOne(t)
	require.Equal(t, 2, l.Attempts)
	require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "req"))
	quarantine(l.ID)
	succ = newItem(3)
	succ.MappingVersion = 2
	_, err = supersede(l.ID, succ)
	require.ErrorIs(t, err, outbox.ErrMayHaveReached)
	require.Equal(t, outbox.StateQuarantined, b.get(t, l.ID).State)
	require.NoError(t, b.store.Requeue(b.ctx, b.pool, l.ID, 1), "a requeue in place stays possible")
}

// The database guard knows fail_accepted's two edges and still refuses the
// others out of accepted.
func TestDatabaseGuardsFailAcceptedEdges(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	l := b.accepted(t, 1)
	for _, sql := range []string{
		"UPDATE outbox_item_states SET state = 'pending' WHERE id = $1",
		"UPDATE outbox_item_states SET state = 'uncertain' WHERE id = $1",
		"UPDATE outbox_item_states SET state = 'leased' WHERE id = $1",
	} {
		_, err := b.pool.Exec(b.ctx, sql, l.ID)
		require.ErrorContains(t, err, "not an edge", sql)
	}
	_, err := b.pool.Exec(b.ctx, "UPDATE outbox_item_states SET state = 'rejected' WHERE id = $1", l.ID)
	require.NoError(t, err)
}
