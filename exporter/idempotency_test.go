package exporter_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
)

// Every attempt of an item has an Idempotency-Key of its own, and an error
// report's sample that names one (stripe-go documents a sample's
// request.identifier as the request's idempotency key) is traced back to
// the item's identifier; anything else is taken as it is.
func TestIdempotencyKeysAndIdentifierOf(t *testing.T) {
	t.Parallel()
	id := "tly_" + strings.Repeat("ab", 32)
	require.Equal(t, id+"-a1", exporter.IdempotencyKey(id, 1))
	require.NotEqual(t, exporter.IdempotencyKey(id, 1), exporter.IdempotencyKey(id, 2))
	require.LessOrEqual(t, len(exporter.IdempotencyKey(id, 1<<30)), 255, "Stripe takes keys of at most 255 characters")
	for _, tc := range []struct{ in, want string }{
		{id, id},
		{id + "-a1", id},
		{id + "-a123", id},
		{id + "-a0", id + "-a0"},
		{id + "-a01", id + "-a01"},
		{id + "-a", id + "-a"},
		{id + "-ax", id + "-ax"},
		{id[:20] + "-a1", id[:20] + "-a1"},
		{"sim_random_key-a1", "sim_random_key-a1"},
		{"", ""},
	} {
		require.Equal(t, tc.want, exporter.IdentifierOf(tc.in), tc.in)
	}
}
