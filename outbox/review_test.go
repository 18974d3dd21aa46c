package outbox_test

import (
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// The items to review are the uncertain ones first, then the rejected, each
// by id, with their last error in one line, at most the limit.
func TestForReviewUncertainFirst(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, newItem(1), newItem(2), newItem(3), newItem(4))
	rejected := b.claimOne(t)
	require.NoError(t, b.store.Reject(b.ctx, b.pool, rejected, outbox.ErrorInfo{Code: "invalid_request", Status: 400, Message: "bad"}))
	refused := b.claimOne(t)
	require.NoError(t, b.store.MarkUncertain(b.ctx, b.pool, refused, outbox.ErrorInfo{Code: "timeout"}, true))
	lost := b.claimOne(t)
	require.NoError(t, b.store.MarkUncertain(b.ctx, b.pool, lost, outbox.ErrorInfo{Code: "connection_reset"}, false))

	got, err := b.store.ForReview(b.ctx, b.pool, 500)
	require.NoError(t, err)
	require.Len(t, got, 3, "the pending item is not for review")
	uncertain := []int64{min(refused.ID, lost.ID), max(refused.ID, lost.ID)}
	require.Equal(t, []int64{uncertain[0], uncertain[1], rejected.ID}, []int64{got[0].ID, got[1].ID, got[2].ID})
	require.Equal(t, []outbox.State{outbox.StateUncertain, outbox.StateUncertain, outbox.StateRejected},
		[]outbox.State{got[0].State, got[1].State, got[2].State})
	byID := map[int64]outbox.ReviewItem{}
	for _, it := range got {
		byID[it.ID] = it
	}
	require.Equal(t, "invalid_request (400): bad", byID[rejected.ID].LastError)
	require.Equal(t, "timeout", byID[refused.ID].LastError)
	require.Equal(t, 1, byID[refused.ID].Attempts)
	require.Equal(t, 1, byID[refused.ID].RefusedAttempts)
	require.Equal(t, 0, byID[lost.ID].RefusedAttempts)
	require.Equal(t, "acme", byID[lost.ID].Tenant)
	require.Equal(t, "api_calls", byID[lost.ID].Feature)
	require.Equal(t, strconv.FormatInt(lost.Payload.Value, 10), byID[lost.ID].Value)

	first, err := b.store.ForReview(b.ctx, b.pool, 1)
	require.NoError(t, err)
	require.Equal(t, got[:1], first)
}
