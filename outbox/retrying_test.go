package outbox_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// An item is retrying from its first failed attempt until it is answered:
// pending again, or leased again for another try. Items never attempted,
// leased for their first try or accepted are not; the oldest first attempt
// is the age, by the database's clock.
func TestOldestRetryingIsTheLongestFailingItem(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	oldest := func() (time.Duration, bool) {
		t.Helper()
		age, ok, err := b.store.OldestRetrying(b.ctx, b.pool)
		require.NoError(t, err)
		return age, ok
	}
	_, ok := oldest()
	require.False(t, ok, "no items")

	b.enqueue(t, newItem(1), newItem(2))
	_, ok = oldest()
	require.False(t, ok, "never attempted")
	first := b.claimOne(t)
	_, ok = oldest()
	require.False(t, ok, "leased for its first try")

	_, err := b.store.Retry(b.ctx, b.pool, first, outbox.ErrorInfo{Code: "network"}, true)
	require.NoError(t, err)
	_, ok = oldest()
	require.True(t, ok, "pending after a failed attempt")

	const apart = 200 * time.Millisecond
	time.Sleep(apart)
	second := b.claimOne(t)
	if second.ID == first.ID { // the retried one came first: fail the other one too
		second = b.claimOne(t)
	}
	_, err = b.store.Retry(b.ctx, b.pool, second, outbox.ErrorInfo{Code: "network"}, true)
	require.NoError(t, err)
	time.Sleep(5 * time.Millisecond)
	again := b.claim(t, outbox.ClaimOptions{Limit: 10})
	require.Len(t, again, 2, "both leased again")
	age, ok := oldest()
	require.True(t, ok, "leased again after a failed attempt")
	require.GreaterOrEqual(t, age, apart, "the oldest first attempt")

	for _, l := range again {
		err := b.store.Accept(b.ctx, b.pool, l, "req_1")
		require.NoError(t, err)
	}
	_, ok = oldest()
	require.False(t, ok, "answered")
}
