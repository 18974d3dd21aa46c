package outbox

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A notification's payload names distinct buckets in order; one that is
// not a list of buckets names every bucket, so that no claim passes over
// a group on a payload it cannot read.
func TestNotifyPayloadBuckets(t *testing.T) {
	t.Parallel()
	require.Equal(t, "3,12,1023", formatBuckets([]int16{12, 1023, 3, 12}))
	require.Equal(t, []int16{3, 12, 1023}, parseBuckets("3,12,1023"))
	for _, p := range []string{"", "x", "1,,2", "1024", "-1", "3, 4"} {
		require.Nil(t, parseBuckets(p), "%q", p)
	}
}
