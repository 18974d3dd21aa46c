package outbox_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// keyed returns an item of subject n for customer cus_<key>.
func keyed(n, key int) outbox.NewItem {
	it := newItem(n)
	it.Payload.Customer = "cus_" + string(rune('a'+key))
	return it
}

func TestPerKeyOneLeasePerKey(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, keyed(1, 0), keyed(2, 0), keyed(3, 0), keyed(4, 1))

	first := b.claim(t, outbox.ClaimOptions{Owner: "w1", Limit: 10})
	require.Len(t, first, 2, "one item per key")
	require.NotEqual(t, first[0].OrderingKey, first[1].OrderingKey)
	require.Empty(t, b.claim(t, outbox.ClaimOptions{Owner: "w2", Limit: 10}), "both keys hold a live lease")

	// Best effort ignores keys: it takes the rest.
	rest := b.claim(t, outbox.ClaimOptions{Owner: "w3", Limit: 10, Policy: outbox.BestEffort})
	require.Len(t, rest, 2)

	var a outbox.Lease
	for _, l := range first {
		if l.Payload.Customer == "cus_a" {
			a = l
		}
	}
	require.NoError(t, b.store.Accept(b.ctx, b.pool, a, "r"))
	for _, l := range rest {
		require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "r"))
	}
	// Key a is free again, key b's lease is still live.
	require.Empty(t, b.claim(t, outbox.ClaimOptions{Owner: "w4", Limit: 10}), "everything of key a is done")
}

func TestPerKeyReclaimsTheExpiredItemFirst(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	ids := b.enqueue(t, keyed(1, 0), keyed(2, 0))
	dead := b.claim(t, outbox.ClaimOptions{Owner: "dead", Limit: 10, Lease: 50 * time.Millisecond})
	require.Len(t, dead, 1)
	require.Equal(t, ids[0], dead[0].ID)
	time.Sleep(80 * time.Millisecond)
	next := b.claim(t, outbox.ClaimOptions{Owner: "alive", Limit: 10})
	require.Len(t, next, 1)
	require.Equal(t, ids[0], next[0].ID, "the abandoned item goes out before later items of its key")
	require.Equal(t, int64(2), next[0].LeaseToken)
}

func TestPerKeyStuckKeyDoesNotBlockOthers(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	// A hot key with many due items, older than everything else.
	var hot []outbox.NewItem
	for i := 0; i < 200; i++ {
		hot = append(hot, keyed(i, 0))
	}
	b.enqueue(t, hot...)
	b.enqueue(t, keyed(1000, 1), keyed(1001, 2), keyed(1002, 3))

	got := b.claim(t, outbox.ClaimOptions{Limit: 10})
	keys := map[string]bool{}
	for _, l := range got {
		require.False(t, keys[l.OrderingKey], "two items of one key in one claim")
		keys[l.OrderingKey] = true
	}
	require.Len(t, keys, 4, "every key gets one item, the hot one does not crowd out the rest")

	// The hot key's item fails and backs off; its next item waits behind the
	// live lease only, not behind the backoff: the per-key policy limits
	// concurrency, it does not stop the line.
	for _, l := range got {
		if l.Payload.Customer == "cus_a" {
			_, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "stripe_5xx", Status: 500}, false)
			require.NoError(t, err)
		} else {
			require.NoError(t, b.store.Accept(b.ctx, b.pool, l, "r"))
		}
	}
	again := b.claim(t, outbox.ClaimOptions{Limit: 10})
	require.Len(t, again, 1)
	require.Equal(t, "cus_a", again[0].Payload.Customer)
	require.NotEqual(t, got[0].ID, again[0].ID)
}
