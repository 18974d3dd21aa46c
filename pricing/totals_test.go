package pricing

import (
	"math"
	"math/big"
	"testing"

	"github.com/stretchr/testify/require"
)

func quote(currency string, amount, lo, hi int64, exact *big.Rat) Quote {
	return Quote{Currency: currency, Amount: amount, MinAmount: lo, MaxAmount: hi, Exact: exact}
}

func TestTotalsRefuses(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		first Quote
		next  Quote
		code  Code
	}{
		{"a quote without a currency", quote("usd", 1, 1, 1, big.NewRat(1, 1)), quote("", 1, 1, 1, big.NewRat(1, 1)), CodeInvalidCurrency},
		{"amount overflow", quote("usd", math.MaxInt64, 0, 0, nil), quote("usd", 1, 0, 0, nil), CodeOverflow},
		{"max overflow", quote("usd", 0, 0, math.MaxInt64, nil), quote("usd", 0, 0, 1, nil), CodeOverflow},
		{"negative overflow", quote("usd", math.MinInt64, 0, 0, nil), quote("usd", -1, 0, 0, nil), CodeOverflow},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var tot Totals
			require.NoError(t, tot.Add(tc.first))
			before, _ := tot.Sum("usd")
			err := tot.Add(tc.next)
			code, ok := CodeOf(err)
			require.True(t, ok, "%v", err)
			require.Equal(t, tc.code, code)
			after, _ := tot.Sum("usd")
			require.Equal(t, before, after, "a refused quote leaves the sum as it was")
		})
	}
}

func TestTotalsKeepCurrenciesApart(t *testing.T) {
	t.Parallel()
	var tot Totals
	require.Empty(t, tot.Currencies())
	_, ok := tot.Sum("usd")
	require.False(t, ok)

	// Two USD lines of Stripe's decimal example, each 1.5 rounded to 2:
	// the total is 2 + 2 = 4, not 1.5 + 1.5 = 3, because each line rounds.
	require.NoError(t, tot.Add(quote("usd", 2, 1, 2, big.NewRat(3, 2))))
	require.NoError(t, tot.Add(quote("USD", 2, 1, 2, big.NewRat(3, 2))))
	require.NoError(t, tot.Add(quote("jpy", 24000, 24000, 24000, big.NewRat(24000, 1))))
	// A quote without Exact adds its Amount to the exact sum.
	require.NoError(t, tot.Add(quote("eur", 700, 700, 700, nil)))

	require.Equal(t, []string{"eur", "jpy", "usd"}, tot.Currencies())
	usd, ok := tot.Sum("USD")
	require.True(t, ok)
	require.Equal(t, "usd", usd.Currency)
	require.Equal(t, 2, usd.Lines)
	require.Equal(t, int64(4), usd.Amount)
	require.Equal(t, int64(2), usd.MinAmount)
	require.Equal(t, int64(4), usd.MaxAmount)
	require.Equal(t, "3", usd.Exact.RatString())

	jpy, ok := tot.Sum("jpy")
	require.True(t, ok)
	require.Equal(t, 1, jpy.Lines)
	require.Equal(t, int64(24000), jpy.Amount)

	eur, ok := tot.Sum("eur")
	require.True(t, ok)
	require.Equal(t, "700", eur.Exact.RatString())

	// The sum handed out is a copy.
	usd.Exact.SetInt64(0)
	again, _ := tot.Sum("usd")
	require.Equal(t, "3", again.Exact.RatString())

	_, ok = tot.Sum("not a currency")
	require.False(t, ok)
}
