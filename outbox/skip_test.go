package outbox_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// onAccount returns item n addressed to account.
func onAccount(n int, account string) outbox.NewItem {
	it := newItem(n)
	it.DestinationAccount = account
	return it
}

// A claim that skips a stalled account leaves its items pending without an
// attempt, under both policies and whether or not it names the exporter,
// and takes every other account's items; the next claim without the skip
// takes them.
func TestClaimSkipsStalledAccounts(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		policy   outbox.Policy
		exporter string
	}{
		{"per key", outbox.PerKey, ""},
		{"per key, one exporter", outbox.PerKey, "stripe_meter_events"},
		{"best effort", outbox.BestEffort, ""},
		{"best effort, one exporter", outbox.BestEffort, "stripe_meter_events"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, outbox.Config{})
			ids := b.enqueue(t, onAccount(1, "acct_a"), onAccount(2, "acct_b"), onAccount(3, "acct_c"), onAccount(4, "acct_b"))
			got := b.claim(t, outbox.ClaimOptions{Owner: "w1", Limit: 10, Policy: tc.policy, Exporter: tc.exporter,
				SkipAccounts: []string{"acct_b", "acct_x"}})
			require.ElementsMatch(t, []int64{ids[0], ids[2]}, leaseIDs(got), "only the accounts not skipped")
			for _, id := range []int64{ids[1], ids[3]} {
				it, err := b.store.Get(b.ctx, b.pool, id)
				require.NoError(t, err)
				require.Equal(t, outbox.StatePending, it.State)
				require.Zero(t, it.Attempts, "a skipped item is not attempted")
			}
			rest := b.claim(t, outbox.ClaimOptions{Owner: "w2", Limit: 10, Policy: tc.policy, Exporter: tc.exporter})
			require.ElementsMatch(t, []int64{ids[1], ids[3]}, leaseIDs(rest))
		})
	}
}

// onMeter returns item n addressed to account, for event name.
func onMeter(n int, account, eventName string) outbox.NewItem {
	it := onAccount(n, account)
	it.Payload.EventName = eventName
	return it
}

// A claim that skips paused event names leaves the items of those names of
// those accounts pending without an attempt — the same name in another
// account, and another name in the same account, are claimed — and skips
// stalled accounts at the same time; the next claim without the skips
// takes them.
func TestClaimSkipsPausedMeters(t *testing.T) {
	t.Parallel()
	for _, policy := range []outbox.Policy{outbox.PerKey, outbox.BestEffort} {
		t.Run(policy.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t, outbox.Config{})
			ids := b.enqueue(t, onMeter(1, "acct_a", "api_calls"), onMeter(2, "acct_a", "storage"),
				onMeter(3, "acct_b", "api_calls"), onMeter(4, "acct_a", "api_calls"), onMeter(5, "acct_c", "storage"))
			got := b.claim(t, outbox.ClaimOptions{Owner: "w1", Limit: 10, Policy: policy, Exporter: "stripe_meter_events",
				SkipMeters: []string{outbox.MeterSkipKey("acct_a", "api_calls")}, SkipAccounts: []string{"acct_c"}})
			require.ElementsMatch(t, []int64{ids[1], ids[2]}, leaseIDs(got), "neither the paused name nor the stalled account")
			for _, id := range []int64{ids[0], ids[3], ids[4]} {
				it, err := b.store.Get(b.ctx, b.pool, id)
				require.NoError(t, err)
				require.Equal(t, outbox.StatePending, it.State)
				require.Zero(t, it.Attempts, "a skipped item is not attempted")
			}
			rest := b.claim(t, outbox.ClaimOptions{Owner: "w2", Limit: 10, Policy: policy})
			require.ElementsMatch(t, []int64{ids[0], ids[3], ids[4]}, leaseIDs(rest))
		})
	}
}

func leaseIDs(ls []outbox.Lease) []int64 {
	out := make([]int64, len(ls))
	for i, l := range ls {
		out[i] = l.ID
	}
	return out
}

// An accept records the meter the item's event name resolved to, and an
// accept that names none records none.
func TestAcceptRecordsTheMeter(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, newItem(1), newItem(2))
	ls := b.claim(t, outbox.ClaimOptions{Owner: "w", Limit: 2, Policy: outbox.BestEffort})
	require.Len(t, ls, 2)
	_, err := b.store.Record(b.ctx, b.pool, []outbox.Outcome{
		{Lease: ls[0], Kind: outbox.Accepted, ProviderRef: "req_1", Meter: "mtr_" + fmt.Sprint(ls[0].ID)},
		{Lease: ls[1], Kind: outbox.Accepted, ProviderRef: "req_2"},
	})
	require.NoError(t, err)
	for _, l := range ls {
		var meter *string
		require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT meter FROM outbox_item_states WHERE id = $1`, l.ID).Scan(&meter))
		if l.ID == ls[0].ID {
			require.NotNil(t, meter)
			require.Equal(t, "mtr_"+fmt.Sprint(l.ID), *meter)
		} else {
			require.Nil(t, meter)
		}
	}
	require.ElementsMatch(t, ids, leaseIDs(ls))
}
