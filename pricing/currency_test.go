package pricing

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestMinorUnits(t *testing.T) {
	t.Parallel()
	cases := []struct {
		currency string
		want     int
	}{
		// Currencies are two-decimal unless Stripe says otherwise.
		{"usd", 2}, {"EUR", 2}, {"gbp", 2}, {"xyz", 2}, {"", 2},
		// Stripe's zero-decimal list.
		{"jpy", 0}, {"JPY", 0}, {"krw", 0}, {"bif", 0}, {"clp", 0}, {"djf", 0}, {"gnf", 0},
		{"kmf", 0}, {"mga", 0}, {"pyg", 0}, {"rwf", 0}, {"vnd", 0}, {"vuv", 0},
		{"xaf", 0}, {"xof", 0}, {"xpf", 0},
		// Stripe's three-decimal list.
		{"bhd", 3}, {"jod", 3}, {"kwd", 3}, {"KWD", 3}, {"omr", 3}, {"tnd", 3},
		// Special cases: ISK and UGX are whole units written with two decimals;
		// HUF and TWD are zero-decimal only for payouts, two-decimal for charges.
		{"isk", 2}, {"ugx", 2}, {"huf", 2}, {"twd", 2},
	}
	for _, tc := range cases {
		t.Run(tc.currency, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.want, MinorUnits(tc.currency))
		})
	}
}

func TestFormat(t *testing.T) {
	t.Parallel()
	cases := []struct {
		amount   int64
		currency string
		want     string
	}{
		{1234, "usd", "12.34 USD"},
		{5, "usd", "0.05 USD"},
		{0, "usd", "0.00 USD"},
		{100, "eur", "1.00 EUR"},
		{-1234, "eur", "-12.34 EUR"},
		{-5, "eur", "-0.05 EUR"},
		// Stripe: "enter 10 to charge 10 JPY".
		{1200, "jpy", "1200 JPY"},
		{0, "JPY", "0 JPY"},
		{-1200, "krw", "-1200 KRW"},
		// Stripe's three-decimal example: 5.124 KWD is 5124 minor units.
		{5124, "kwd", "5.124 KWD"},
		{1234, "KWD", "1.234 KWD"},
		{5, "bhd", "0.005 BHD"},
		{-50, "omr", "-0.050 OMR"},
		// Stripe: "to charge 5 ISK, provide an amount value of 500".
		{500, "isk", "5.00 ISK"},
		{math.MaxInt64, "usd", "92233720368547758.07 USD"},
		{math.MinInt64, "usd", "-92233720368547758.08 USD"},
		{math.MinInt64, "jpy", "-9223372036854775808 JPY"},
	}
	for _, tc := range cases {
		t.Run(tc.want, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.want, Format(tc.amount, tc.currency))
		})
	}
}
