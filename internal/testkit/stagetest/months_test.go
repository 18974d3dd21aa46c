package stagetest_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/stagetest"
)

func TestAddMonthsClampsTheDayAsBillingCyclesDo(t *testing.T) {
	t.Parallel()
	at := func(s string) time.Time { v, _ := time.Parse(time.RFC3339, s); return v }
	for _, tc := range []struct {
		from string
		n    int
		want string
	}{
		{"2027-01-31T10:00:00Z", 1, "2027-02-28T10:00:00Z"},
		{"2027-03-31T10:00:00Z", -1, "2027-02-28T10:00:00Z"},
		{"2028-03-30T10:00:00Z", -1, "2028-02-29T10:00:00Z"},
		{"2026-12-06T17:44:03Z", -1, "2026-11-06T17:44:03Z"},
		{"2026-12-06T17:44:03Z", 1, "2027-01-06T17:44:03Z"},
	} {
		require.Equal(t, at(tc.want), stagetest.AddMonths(at(tc.from), tc.n), "%s %+d", tc.from, tc.n)
	}
}
