package reconcile

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

func acc(id, value, ts int64) held {
	return held{id: id, state: outbox.StateAccepted, value: value, ts: ts, settled: true}
}
func conf(id, value, ts int64) held {
	return held{id: id, state: outbox.StateConfirmed, value: value, ts: ts}
}
func unc(id, value, ts int64) held {
	return held{id: id, state: outbox.StateUncertain, value: value, ts: ts}
}

func TestCompareHour(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		formula     string
		items       []held
		summary     float64
		found       bool
		open        bool // an hour of an open billing period
		skip        string
		match       bool
		confirm     []int64
		expected    string
		diff        string
		explanation string
		explainedBy []int64
		confirmed   []int64
	}{
		{name: "sum equal confirms the accepted, not the confirmed", formula: "sum",
			items: []held{acc(1, 5, 10), conf(2, 7, 20), acc(3, -2, 30)}, summary: 10, found: true,
			match: true, confirm: []int64{1, 3}, expected: "10"},
		{name: "sum short: a dropped event, unexplained", formula: "sum",
			items: []held{acc(1, 5, 10), acc(2, 7, 20)}, summary: 5, found: true,
			expected: "12", diff: "-7", explanation: "unexplained"},
		{name: "sum with no summary is zero", formula: "sum",
			items: []held{acc(1, 5, 10)}, expected: "5", diff: "-5", explanation: "unexplained"},
		{name: "sum of zero with no summary matches", formula: "sum",
			items: []held{acc(1, 0, 10)}, match: true, confirm: []int64{1}, expected: "0"},
		{name: "sum over: one uncertain item landed", formula: "sum",
			items: []held{acc(1, 5, 10), unc(2, 3, 20), unc(3, 4, 30)}, summary: 9, found: true,
			expected: "5", diff: "4", explanation: "explained", explainedBy: []int64{3}},
		{name: "sum over: two sets explain it", formula: "sum",
			items: []held{acc(1, 5, 10), unc(2, 3, 20), unc(3, 3, 30)}, summary: 8, found: true,
			expected: "5", diff: "3", explanation: "ambiguous"},
		{name: "sum over, explained by none", formula: "sum",
			items: []held{acc(1, 5, 10), unc(2, 3, 20)}, summary: 6, found: true,
			expected: "5", diff: "1", explanation: "unexplained"},
		{name: "sum not a whole number", formula: "sum",
			items: []held{acc(1, 5, 10)}, summary: 5.5, found: true, expected: "5", diff: "0.5", explanation: "unexplained"},
		{name: "only uncertain items, nothing at Stripe: a match with nothing to confirm", formula: "sum",
			items: []held{unc(2, 3, 20)}, match: true, expected: "0"},
		{name: "only uncertain items, landed", formula: "sum",
			items: []held{unc(2, 3, 20)}, summary: 3, found: true, expected: "0", diff: "3",
			explanation: "explained", explainedBy: []int64{2}},
		{name: "count equal", formula: "count",
			items: []held{acc(1, 1, 10), acc(2, 1, 20), conf(3, 1, 30)}, summary: 3, found: true,
			match: true, confirm: []int64{1, 2}, expected: "3"},
		{name: "count: every uncertain item landed", formula: "count",
			items: []held{acc(1, 1, 10), unc(2, 1, 20), unc(3, 1, 30)}, summary: 3, found: true,
			expected: "1", diff: "2", explanation: "explained", explainedBy: []int64{2, 3}},
		{name: "count: some uncertain items landed, which cannot be told", formula: "count",
			items: []held{acc(1, 1, 10), unc(2, 1, 20), unc(3, 1, 30)}, summary: 2, found: true,
			expected: "1", diff: "1", explanation: "ambiguous"},
		{name: "last equal: the latest by time, then id", formula: "last",
			items: []held{acc(1, 9, 10), acc(2, 4, 30), acc(3, 6, 30)}, summary: 6, found: true,
			match: true, confirm: []int64{1, 2, 3}, expected: "6"},
		{name: "last with no event at Stripe", formula: "last",
			items: []held{acc(1, 9, 10)}, expected: "9", explanation: "unexplained"},
		{name: "last: a later uncertain item landed", formula: "last",
			items: []held{acc(1, 9, 10), unc(2, 5, 20), unc(3, 7, 30)}, summary: 7, found: true,
			expected: "9", diff: "-2", explanation: "explained", explainedBy: []int64{3}},
		{name: "last: an earlier uncertain item does not explain", formula: "last",
			items: []held{acc(1, 9, 30), unc(2, 5, 20)}, summary: 5, found: true,
			expected: "9", diff: "-4", explanation: "unexplained"},
		{name: "an item in flight skips the hour", formula: "sum",
			items: []held{acc(1, 5, 10), {id: 2, state: outbox.StateLeased, value: 1, ts: 20}}, skip: skipInFlight},
		{name: "a pending item skips the hour", formula: "sum",
			items: []held{acc(1, 5, 10), {id: 2, state: outbox.StatePending, value: 1, ts: 20}}, skip: skipInFlight},
		{name: "an unsettled accepted item skips the hour", formula: "sum",
			items: []held{acc(1, 5, 10), {id: 2, state: outbox.StateAccepted, value: 1, ts: 20}}, skip: skipUnsettled},
		{name: "only confirmed items: nothing to do", formula: "sum",
			items: []held{conf(1, 5, 10)}, summary: 5, found: true, skip: skipNothing},
		{name: "only confirmed items of an open period, equal: a match that changes nothing", formula: "sum",
			items: []held{conf(1, 5, 10)}, summary: 5, found: true, open: true, match: true, expected: "5"},
		{name: "only confirmed items of an open period, Stripe has more", formula: "sum",
			items: []held{conf(1, 5, 10), conf(2, 2, 20)}, summary: 9, found: true, open: true,
			expected: "7", diff: "2", explanation: "unexplained", confirmed: []int64{1, 2}},
		{name: "only confirmed items of an open period, Stripe has less", formula: "count",
			items: []held{conf(1, 1, 10), conf(2, 1, 20)}, summary: 1, found: true, open: true,
			expected: "2", diff: "-1", explanation: "unexplained", confirmed: []int64{1, 2}},
		{name: "confirmed and accepted of an open period, Stripe has more: the accepted is not confirmed", formula: "sum",
			items: []held{conf(1, 5, 10), acc(2, 2, 20)}, summary: 8, found: true, open: true,
			expected: "7", diff: "1", explanation: "unexplained", confirmed: []int64{1}},
		{name: "no item of an open period, Stripe has a sum", formula: "sum",
			summary: 4, found: true, open: true, expected: "0", diff: "4", explanation: "unexplained"},
		{name: "no item of an open period, Stripe has a last value", formula: "last",
			summary: 0, found: true, open: true, expected: "0", diff: "0", explanation: "unexplained"},
		{name: "an open period's hour in flight is still skipped", formula: "sum", open: true,
			items: []held{conf(1, 5, 10), {id: 2, state: outbox.StateLeased, value: 1, ts: 20}}, skip: skipInFlight},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			v := compareHour(tc.formula, tc.items, tc.summary, tc.found, tc.open)
			require.Equal(t, tc.skip, v.skip)
			if tc.skip != "" {
				return
			}
			require.Equal(t, tc.match, v.match)
			require.Equal(t, tc.confirm, v.confirm)
			require.Equal(t, tc.expected, v.expected.String())
			if tc.match {
				return
			}
			require.Equal(t, tc.diff, v.differenceText())
			require.Equal(t, tc.explanation, v.explanation)
			require.Equal(t, tc.explainedBy, v.explainedBy)
			require.Equal(t, tc.confirmed, v.confirmed)
		})
	}
}

func TestSubsetSumCountsToTwo(t *testing.T) {
	t.Parallel()
	items := []held{unc(1, 2, 0), unc(2, 3, 0), unc(3, 5, 0), unc(4, -5, 0)}
	set, n := subsetSum(items, 5)
	require.Equal(t, 2, n, "{2,3} and {5}: ambiguous")
	require.NotEmpty(t, set)
	set, n = subsetSum(items, 10)
	require.Equal(t, 1, n)
	require.Equal(t, []int64{1, 2, 3}, set)
	_, n = subsetSum(items, 100)
	require.Zero(t, n)
}
