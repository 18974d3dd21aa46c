package reconcile

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// A refused key's range: the hours a comparison would look at give its
// items and what Tally expects by the formula; hours in flight or not
// settled are skipped; hours with nothing to learn are left out.
func TestHoldOverSumsUpTheComparableHours(t *testing.T) {
	t.Parallel()
	const h0, h1, h2, h3 = 0, 3600, 7200, 10800
	byHour := map[int64][]held{
		h0: {acc(1, 5, h0+10), conf(2, 7, h0+20), unc(3, 4, h0+30)},
		// In flight: skipped.
		h1: {acc(4, 9, h1+10), {id: 5, state: outbox.StatePending, value: 1, ts: h1 + 20}},
		// Nothing to learn: left out.
		h2: {conf(6, 2, h2+10)},
		h3: {acc(8, 3, h3+50), acc(7, 6, h3+50), unc(9, 1, h3+59)},
	}
	hours := []int64{h0, h1, h2, h3}
	for _, tc := range []struct {
		formula, expected string
	}{
		{"sum", "21"},  // 5 + 7 + 3 + 6
		{"count", "4"}, // items 1, 2, 7, 8
		{"last", "3"},  // item 8: the latest by time, then by id
	} {
		t.Run(tc.formula, func(t *testing.T) {
			t.Parallel()
			u := holdOver(tc.formula, byHour, hours, closed)
			require.Equal(t, tc.expected, u.expected.String())
			require.Equal(t, 2, u.hours)
			require.Equal(t, 1, u.skipped)
			require.Equal(t, []int64{1, 2, 7, 8}, u.counted)
			require.Equal(t, []int64{3, 9}, u.uncertain)
		})
	}
	u := holdOver("sum", map[int64][]held{h1: byHour[h1]}, []int64{h1}, closed)
	require.Equal(t, uncompared{skipped: 1, expected: u.expected, counted: []int64{}, uncertain: []int64{}}, u)
	require.Equal(t, "0", u.expected.String())

	// In an open period the confirmed hour is read again, so a refusal
	// names its items too.
	u = holdOver("sum", byHour, hours, func(int64) bool { return true })
	require.Equal(t, "23", u.expected.String(), "item 6's 2 as well")
	require.Equal(t, 3, u.hours)
	require.Equal(t, []int64{1, 2, 6, 7, 8}, u.counted)
}

// closed says no hour is of an open billing period.
func closed(int64) bool { return false }

// Which failed summaries reads refuse one key, and what is kept of them.
func TestRefusedKeyIsA4xxAboutTheKey(t *testing.T) {
	t.Parallel()
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name    string
		ctx     context.Context
		err     error
		refused bool
		code    string
	}{
		{"no error", context.Background(), nil, false, ""},
		{"bad request", context.Background(), &stripeapi.Error{HTTPStatus: 400, Type: "invalid_request_error", Code: "resource_missing"}, true, "resource_missing"},
		{"not found, no code", context.Background(), &stripeapi.Error{HTTPStatus: 404, Type: "invalid_request_error"}, true, "invalid_request_error"},
		{"payment required", context.Background(), &stripeapi.Error{HTTPStatus: 402, Code: "Odd Code!"}, true, "odd_code"},
		{"unauthorized", context.Background(), &stripeapi.Error{HTTPStatus: 401}, false, ""},
		{"forbidden", context.Background(), &stripeapi.Error{HTTPStatus: 403}, false, ""},
		{"conflict", context.Background(), &stripeapi.Error{HTTPStatus: 409}, false, ""},
		{"rate limited", context.Background(), &stripeapi.Error{HTTPStatus: 429}, false, ""},
		{"server error", context.Background(), &stripeapi.Error{HTTPStatus: 500}, false, ""},
		{"no answer", context.Background(), &stripeapi.Error{Code: stripeapi.CodeNetwork}, false, ""},
		{"not Stripe's", context.Background(), errors.New("boom"), false, ""},
		{"run stopped", canceled, &stripeapi.Error{HTTPStatus: 400, Code: "resource_missing"}, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			info, ok := refusedKey(tc.ctx, tc.err)
			require.Equal(t, tc.refused, ok)
			if !ok {
				require.Zero(t, info)
				return
			}
			require.Equal(t, tc.code, info.Code)
			require.Equal(t, tc.err.(*stripeapi.Error).HTTPStatus, info.Status)
			require.Empty(t, info.Message, "content-free: no message of Stripe's")
		})
	}
}
