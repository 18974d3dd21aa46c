package reconcile

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The schedule is cron in UTC, whatever the node's zone; "off" is none.
func TestPeriodicSchedule(t *testing.T) {
	t.Parallel()
	job, err := Periodic("off")
	require.NoError(t, err)
	require.Nil(t, job)
	_, err = Periodic("nightly")
	require.Error(t, err)
	job, err = Periodic(DefaultSchedule)
	require.NoError(t, err)
	require.NotNil(t, job)

	s, err := parseUTC(DefaultSchedule)
	require.NoError(t, err)
	tokyo := time.FixedZone("JST", 9*3600)
	from := time.Date(2026, 11, 30, 10, 0, 0, 0, tokyo) // 01:00 UTC
	require.Equal(t, time.Date(2026, 11, 30, 2, 0, 0, 0, time.UTC), s.Next(from).UTC())
	require.Equal(t, time.Date(2026, 12, 1, 2, 0, 0, 0, time.UTC), s.Next(time.Date(2026, 11, 30, 2, 0, 0, 0, time.UTC)).UTC())
}
