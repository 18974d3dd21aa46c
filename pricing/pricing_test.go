package pricing

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"
)

// metered is a recurring metered per-unit USD price of unit minor units.
func metered(unit int64) *stripe.Price {
	return &stripe.Price{
		ID:            "price_test",
		Type:          stripe.PriceTypeRecurring,
		Recurring:     &stripe.PriceRecurring{Interval: "month", UsageType: stripe.PriceRecurringUsageTypeMetered},
		Currency:      "usd",
		BillingScheme: stripe.PriceBillingSchemePerUnit,
		UnitAmount:    unit,
	}
}

// decimalPrice is metered with a unit_amount_decimal, as Stripe answers a
// fractional one: unit_amount null (0 in stripe-go).
func decimalPrice(dec float64) *stripe.Price {
	p := metered(0)
	p.UnitAmountDecimal = dec
	return p
}

func tieredPrice(mode stripe.PriceTiersMode, tiers ...*stripe.PriceTier) *stripe.Price {
	p := metered(0)
	p.BillingScheme = stripe.PriceBillingSchemeTiered
	p.TiersMode = mode
	p.Tiers = tiers
	return p
}

func packagePrice(unit, divideBy int64, round stripe.PriceTransformQuantityRound) *stripe.Price {
	p := metered(unit)
	p.TransformQuantity = &stripe.PriceTransformQuantity{DivideBy: divideBy, Round: round}
	return p
}

// fonts are the tiers of Stripe's tiered-pricing guide: 1-5 at 7 USD,
// 6-10 at 6.5 USD, 11+ at 6 USD.
func fonts() []*stripe.PriceTier {
	return []*stripe.PriceTier{
		{UpTo: 5, UnitAmount: 700},
		{UpTo: 10, UnitAmount: 650},
		{UnitAmount: 600},
	}
}

// flatRate are the tiers of the same guide's "Add a flat rate" section.
func flatRate() []*stripe.PriceTier {
	return []*stripe.PriceTier{
		{UpTo: 5, UnitAmount: 500, FlatAmount: 1000},
		{UpTo: 10, UnitAmount: 400, FlatAmount: 2000},
		{UpTo: 15, UnitAmount: 300, FlatAmount: 3000},
		{UpTo: 20, UnitAmount: 200, FlatAmount: 4000},
		{UnitAmount: 100, FlatAmount: 5000},
	}
}

func withoutFlats(ts []*stripe.PriceTier) []*stripe.PriceTier {
	for _, t := range ts {
		t.FlatAmount = 0
	}
	return ts
}

func with(p *stripe.Price, edit func(*stripe.Price)) *stripe.Price {
	edit(p)
	return p
}

func TestEvaluateRefusesWhatItDoesNotModel(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name     string
		price    *stripe.Price
		currency string
		usage    int64
		code     Code
	}{
		{"no price", nil, "", 1, CodeNoPrice},
		{"deleted", with(metered(100), func(p *stripe.Price) { p.Deleted = true }), "", 1, CodeDeleted},
		{"customer chooses the amount", with(metered(0), func(p *stripe.Price) {
			p.CustomUnitAmount = &stripe.PriceCustomUnitAmount{Preset: 500}
		}), "", 1, CodeCustomAmount},
		{"customer chooses the amount in a currency option", with(metered(100), func(p *stripe.Price) {
			p.CurrencyOptions = map[string]*stripe.PriceCurrencyOptions{"eur": {CustomUnitAmount: &stripe.PriceCurrencyOptionsCustomUnitAmount{Preset: 500}}}
		}), "eur", 1, CodeCustomAmount},
		{"one-time", with(metered(100), func(p *stripe.Price) { p.Type = stripe.PriceTypeOneTime; p.Recurring = nil }), "", 1, CodeNotRecurring},
		{"recurring without its recurring object", with(metered(100), func(p *stripe.Price) { p.Recurring = nil }), "", 1, CodeNotRecurring},
		{"licensed seat price", with(metered(100), func(p *stripe.Price) { p.Recurring.UsageType = stripe.PriceRecurringUsageTypeLicensed }), "", 1, CodeLicensed},
		{"usage type absent is Stripe's default, licensed", with(metered(100), func(p *stripe.Price) { p.Recurring.UsageType = "" }), "", 1, CodeLicensed},
		{"unknown usage type", with(metered(100), func(p *stripe.Price) { p.Recurring.UsageType = "rated" }), "", 1, CodeUnknownUsageType},
		{"no currency anywhere", with(metered(100), func(p *stripe.Price) { p.Currency = "" }), "", 1, CodeInvalidCurrency},
		{"currency of two letters", metered(100), "us", 1, CodeInvalidCurrency},
		{"currency with a symbol", metered(100), "u$d", 1, CodeInvalidCurrency},
		{"other currency, options not expanded", metered(100), "eur", 1, CodeNoCurrencyOption},
		{"other currency, no option for it", with(metered(100), func(p *stripe.Price) {
			p.CurrencyOptions = map[string]*stripe.PriceCurrencyOptions{"jpy": {UnitAmount: 150}}
		}), "eur", 1, CodeNoCurrencyOption},
		{"other currency, empty option", with(metered(100), func(p *stripe.Price) {
			p.CurrencyOptions = map[string]*stripe.PriceCurrencyOptions{"eur": nil}
		}), "eur", 1, CodeNoCurrencyOption},
		{"billing scheme absent", with(metered(100), func(p *stripe.Price) { p.BillingScheme = "" }), "", 1, CodeUnknownBillingScheme},
		{"unknown billing scheme", with(metered(100), func(p *stripe.Price) { p.BillingScheme = "stairstep" }), "", 1, CodeUnknownBillingScheme},
		{"tiers mode absent", tieredPrice("", fonts()...), "", 1, CodeUnknownTiersMode},
		{"unknown tiers mode", tieredPrice("stairstep", fonts()...), "", 1, CodeUnknownTiersMode},
		{"tiers not expanded", tieredPrice(stripe.PriceTiersModeGraduated), "", 1, CodeTiersMissing},
		{"currency option without tiers", with(tieredPrice(stripe.PriceTiersModeVolume, fonts()...), func(p *stripe.Price) {
			p.CurrencyOptions = map[string]*stripe.PriceCurrencyOptions{"eur": {}}
		}), "eur", 1, CodeTiersMissing},
		{"transform_quantity with tiers", with(tieredPrice(stripe.PriceTiersModeGraduated, fonts()...), func(p *stripe.Price) {
			p.TransformQuantity = &stripe.PriceTransformQuantity{DivideBy: 5, Round: stripe.PriceTransformQuantityRoundUp}
		}), "", 1, CodeTransformWithTiers},
		{"tiers out of order", tieredPrice(stripe.PriceTiersModeGraduated,
			&stripe.PriceTier{UpTo: 10, UnitAmount: 1}, &stripe.PriceTier{UpTo: 5, UnitAmount: 1}, &stripe.PriceTier{UnitAmount: 1}), "", 1, CodeInvalidTiers},
		{"tiers with equal bounds", tieredPrice(stripe.PriceTiersModeVolume,
			&stripe.PriceTier{UpTo: 5, UnitAmount: 1}, &stripe.PriceTier{UpTo: 5, UnitAmount: 1}, &stripe.PriceTier{UnitAmount: 1}), "", 1, CodeInvalidTiers},
		{"unbounded tier before the last", tieredPrice(stripe.PriceTiersModeGraduated,
			&stripe.PriceTier{UnitAmount: 1}, &stripe.PriceTier{UpTo: 5, UnitAmount: 1}), "", 1, CodeInvalidTiers},
		{"negative bound", tieredPrice(stripe.PriceTiersModeVolume,
			&stripe.PriceTier{UpTo: -1, UnitAmount: 1}, &stripe.PriceTier{UnitAmount: 1}), "", 1, CodeInvalidTiers},
		{"nil tier", tieredPrice(stripe.PriceTiersModeVolume, nil, &stripe.PriceTier{UnitAmount: 1}), "", 1, CodeInvalidTiers},
		{"graduated quantity above the last bounded tier", tieredPrice(stripe.PriceTiersModeGraduated,
			&stripe.PriceTier{UpTo: 5, UnitAmount: 1}, &stripe.PriceTier{UpTo: 10, UnitAmount: 1}), "", 11, CodeBeyondTiers},
		{"volume quantity above the last bounded tier", tieredPrice(stripe.PriceTiersModeVolume,
			&stripe.PriceTier{UpTo: 5, UnitAmount: 1}), "", 6, CodeBeyondTiers},
		{"divide_by zero", packagePrice(1000, 0, stripe.PriceTransformQuantityRoundUp), "", 1, CodeInvalidTransform},
		{"divide_by negative", packagePrice(1000, -5, stripe.PriceTransformQuantityRoundUp), "", 1, CodeInvalidTransform},
		{"round neither up nor down", packagePrice(1000, 5, "nearest"), "", 1, CodeInvalidTransform},
		{"unit_amount and its decimal disagree", with(metered(500), func(p *stripe.Price) { p.UnitAmountDecimal = 499.5 }), "", 1, CodeInconsistentAmounts},
		{"flat_amount and its decimal disagree", tieredPrice(stripe.PriceTiersModeVolume,
			&stripe.PriceTier{UnitAmount: 1, FlatAmount: 100, FlatAmountDecimal: 101}), "", 1, CodeInconsistentAmounts},
		{"tier unit_amount and its decimal disagree", tieredPrice(stripe.PriceTiersModeGraduated,
			&stripe.PriceTier{UnitAmount: 2, UnitAmountDecimal: 2.5}), "", 1, CodeInconsistentAmounts},
		{"negative unit amount", metered(-100), "", 1, CodeNegativeAmount},
		{"currency option with an empty tier", with(tieredPrice(stripe.PriceTiersModeVolume, fonts()...), func(p *stripe.Price) {
			p.CurrencyOptions = map[string]*stripe.PriceCurrencyOptions{"eur": {Tiers: []*stripe.PriceCurrencyOptionsTier{nil}}}
		}), "eur", 1, CodeInvalidTiers},
		{"currency option tier with a negative unit amount", with(tieredPrice(stripe.PriceTiersModeVolume, fonts()...), func(p *stripe.Price) {
			p.CurrencyOptions = map[string]*stripe.PriceCurrencyOptions{"eur": {Tiers: []*stripe.PriceCurrencyOptionsTier{{UnitAmount: -1}}}}
		}), "eur", 1, CodeNegativeAmount},
		{"negative tier flat amount", tieredPrice(stripe.PriceTiersModeGraduated, &stripe.PriceTier{FlatAmount: -100}), "", 1, CodeNegativeAmount},
		{"decimal with 13 places", decimalPrice(0.1234567890123), "", 1, CodeImpreciseDecimal},
		// FormatFloat gives 1234567.1234567892 back: 17 significant digits.
		{"decimal beyond float64's exact digits", decimalPrice(1234567.1234567891), "", 1, CodeImpreciseDecimal},
		{"decimal not a number", decimalPrice(math.NaN()), "", 1, CodeImpreciseDecimal},
		{"decimal infinite", decimalPrice(math.Inf(1)), "", 1, CodeImpreciseDecimal},
		// 10^18 minor units × 10 = 10^19, above int64's 9.22 × 10^18.
		{"amount above int64", metered(1_000_000_000_000_000_000), "", 10, CodeOverflow},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			q, err := Evaluate(tc.price, tc.currency, tc.usage)
			require.Error(t, err)
			var nm *NotModeled
			require.ErrorAs(t, err, &nm)
			require.Equal(t, tc.code, nm.Code, err.Error())
			require.NotEmpty(t, nm.Reason)
			require.Equal(t, Quote{}, q, "a refused price has no amount")
			code, ok := CodeOf(fmt.Errorf("wrapped: %w", err))
			require.True(t, ok)
			require.Equal(t, tc.code, code)
		})
	}
}

func TestCodeOfAnotherError(t *testing.T) {
	t.Parallel()
	_, ok := CodeOf(errors.New("boom"))
	require.False(t, ok)
	_, ok = CodeOf(nil)
	require.False(t, ok)
}

// want is an expected quote: amounts in minor units and the exact amount as
// big.Rat's RatString ("3/2"); min and max default to amount.
type want struct {
	quantity, billed int64
	exact            string
	amount           int64
	min, max         *int64
	caveats          []CaveatCode
}

func i64(v int64) *int64 { return &v }

func check(t *testing.T, p *stripe.Price, currency string, usage int64, w want) Quote {
	t.Helper()
	q, err := Evaluate(p, currency, usage)
	require.NoError(t, err)
	require.Equal(t, usage, q.Usage)
	require.Equal(t, w.quantity, q.Quantity, "quantity")
	require.Equal(t, w.billed, q.BilledQuantity, "billed quantity")
	require.Equal(t, w.exact, q.Exact.RatString(), "exact")
	require.Equal(t, w.amount, q.Amount, "amount")
	lo, hi := w.amount, w.amount
	if w.min != nil {
		lo = *w.min
	}
	if w.max != nil {
		hi = *w.max
	}
	require.Equal(t, lo, q.MinAmount, "min")
	require.Equal(t, hi, q.MaxAmount, "max")
	var got []CaveatCode
	for _, c := range q.Caveats {
		require.NotEmpty(t, c.Detail)
		got = append(got, c.Code)
	}
	require.ElementsMatch(t, w.caveats, got, "caveats")
	for _, c := range w.caveats {
		require.True(t, q.Has(c), c)
	}
	require.False(t, q.Has("no_such_caveat"))
	return q
}

func TestEvaluatePerUnit(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		price *stripe.Price
		usage int64
		want  want
	}{
		// 3 × 1000
		{"whole unit amount", metered(1000), 3, want{quantity: 3, billed: 3, exact: "3000", amount: 3000}},
		{"zero usage bills nothing", metered(1000), 0, want{exact: "0"}},
		{"free price", metered(0), 1000, want{quantity: 1000, billed: 1000, exact: "0"}},
		// Stripe answers unit_amount 5 with unit_amount_decimal "5": both set, agreeing.
		{"unit_amount with its decimal twin", with(metered(5), func(p *stripe.Price) { p.UnitAmountDecimal = 5 }), 7,
			want{quantity: 7, billed: 7, exact: "35", amount: 35}},
		// Stripe's decimal-amounts example: 0.05 × 30 = 1.5, "rounds up to 2 cents".
		{"decimal, Stripe's example", decimalPrice(0.05), 30, want{quantity: 30, billed: 30, exact: "3/2", amount: 2, min: i64(1),
			caveats: []CaveatCode{CaveatFractional, CaveatRoundingTie}}},
		// 0.05 × 29 = 1.45: nearest is 1, a ceiling would give 2.
		{"decimal below the half", decimalPrice(0.05), 29, want{quantity: 29, billed: 29, exact: "29/20", amount: 1, max: i64(2),
			caveats: []CaveatCode{CaveatFractional}}},
		// 0.05 × 31 = 1.55
		{"decimal above the half", decimalPrice(0.05), 31, want{quantity: 31, billed: 31, exact: "31/20", amount: 2, min: i64(1),
			caveats: []CaveatCode{CaveatFractional}}},
		// 105.5 cents ($1.055), Stripe's example of a decimal unit amount: 2 × 105.5 = 211
		{"decimal with a whole line", decimalPrice(105.5), 2, want{quantity: 2, billed: 2, exact: "211", amount: 211}},
		// 3 × 105.5 = 316.5
		{"decimal line on a half", decimalPrice(105.5), 3, want{quantity: 3, billed: 3, exact: "633/2", amount: 317, min: i64(316),
			caveats: []CaveatCode{CaveatFractional, CaveatRoundingTie}}},
		// 12 decimal places: 10^6 × 0.000000000001 = 0.000001
		{"decimal at Stripe's 12 places", decimalPrice(0.000000000001), 1_000_000, want{quantity: 1_000_000, billed: 1_000_000,
			exact: "1/1000000", amount: 0, max: i64(1), caveats: []CaveatCode{CaveatFractional}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			q := check(t, tc.price, "", tc.usage, tc.want)
			require.Equal(t, "usd", q.Currency)
			require.Equal(t, "price_test", q.PriceID)
			require.Nil(t, q.Tiers)
		})
	}
}

func TestEvaluatePackage(t *testing.T) {
	t.Parallel()
	up, down := stripe.PriceTransformQuantityRoundUp, stripe.PriceTransformQuantityRoundDown
	cases := []struct {
		name  string
		price *stripe.Price
		usage int64
		want  want
	}{
		// Transform quantities guide: 10 USD an hour, usage in minutes, divide_by 60 up;
		// 150 minutes is 3 hours, 30 USD: ceil(150/60) = 3, 3 × 1000.
		{"car rental, 150 minutes", packagePrice(1000, 60, up), 150, want{quantity: 150, billed: 3, exact: "3000", amount: 3000}},
		// Manage prices, package pricing: 25 USD for every 5 units, rounded up,
		// "a customer buying 8 units pays 50 USD": ceil(8/5) = 2, 2 × 2500.
		{"25 USD per 5, 8 units, up", packagePrice(2500, 5, up), 8, want{quantity: 8, billed: 2, exact: "5000", amount: 5000}},
		// The same rounded down: floor(8/5) = 1, 1 × 2500.
		{"25 USD per 5, 8 units, down", packagePrice(2500, 5, down), 8, want{quantity: 8, billed: 1, exact: "2500", amount: 2500}},
		// Quantity transformation guide, 10 USD per 5 users rounded up: 1, 3, 5 users
		// bill 10 USD, 6 and 7 bill 20 USD.
		{"per 5 users, 1", packagePrice(1000, 5, up), 1, want{quantity: 1, billed: 1, exact: "1000", amount: 1000}},
		{"per 5 users, 5, exactly one package", packagePrice(1000, 5, up), 5, want{quantity: 5, billed: 1, exact: "1000", amount: 1000}},
		{"per 5 users, 6", packagePrice(1000, 5, up), 6, want{quantity: 6, billed: 2, exact: "2000", amount: 2000}},
		{"per 5 users, 7", packagePrice(1000, 5, up), 7, want{quantity: 7, billed: 2, exact: "2000", amount: 2000}},
		// Rounded down, 4 users make no full package: floor(4/5) = 0.
		{"down, less than a package", packagePrice(1000, 5, down), 4, want{quantity: 4, exact: "0"}},
		// 0 / 5 is 0 either way.
		{"zero usage, up", packagePrice(1000, 5, up), 0, want{exact: "0"}},
		// A negative total bills as 0 before the division.
		{"negative usage, up", packagePrice(1000, 5, up), -7, want{exact: "0", caveats: []CaveatCode{CaveatNegativeUsage}}},
		// Decimal package: 0.5 per package of 3, 10 units up: ceil(10/3) = 4, 4 × 0.5 = 2.
		{"decimal package", with(packagePrice(0, 3, up), func(p *stripe.Price) { p.UnitAmountDecimal = 0.5 }), 10,
			want{quantity: 10, billed: 4, exact: "2", amount: 2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			check(t, tc.price, "", tc.usage, tc.want)
		})
	}
}

func TestEvaluateGraduated(t *testing.T) {
	t.Parallel()
	g := stripe.PriceTiersModeGraduated
	cases := []struct {
		name  string
		price *stripe.Price
		usage int64
		want  want
		tiers int // number of tiers charged
	}{
		// Tiered-pricing guide, graduated table: 1 font 7 USD, 5 fonts 35 USD,
		// 6 fonts 41.5 USD, 20 fonts 127.5 USD, 25 fonts 157.5 USD.
		// 1 × 700
		{"inside the first tier", tieredPrice(g, fonts()...), 1, want{quantity: 1, billed: 1, exact: "700", amount: 700}, 1},
		// 5 × 700, the first tier's bound
		{"at the first boundary", tieredPrice(g, fonts()...), 5, want{quantity: 5, billed: 5, exact: "3500", amount: 3500}, 1},
		// 5 × 700 + 1 × 650
		{"just across", tieredPrice(g, fonts()...), 6, want{quantity: 6, billed: 6, exact: "4150", amount: 4150}, 2},
		// 5 × 700 + 5 × 650
		{"at the second boundary", tieredPrice(g, fonts()...), 10, want{quantity: 10, billed: 10, exact: "6750", amount: 6750}, 2},
		// 5 × 700 + 5 × 650 + 1 × 600
		{"first unit of the inf tier", tieredPrice(g, fonts()...), 11, want{quantity: 11, billed: 11, exact: "7350", amount: 7350}, 3},
		// 5 × 700 + 5 × 650 + 10 × 600
		{"in the inf tier, 20", tieredPrice(g, fonts()...), 20, want{quantity: 20, billed: 20, exact: "12750", amount: 12750}, 3},
		// 5 × 700 + 5 × 650 + 15 × 600
		{"in the inf tier, 25", tieredPrice(g, fonts()...), 25, want{quantity: 25, billed: 25, exact: "15750", amount: 15750}, 3},
		{"zero, no flat amounts", tieredPrice(g, fonts()...), 0, want{exact: "0"}, 1},
		// Recurring pricing models (an older copy): with the flat-rate section's unit
		// amounts alone, "the total cost for an amount of 6 is 29 USD": 5 × 500 + 1 × 400.
		{"unit amounts of the flat-rate tiers, 6", tieredPrice(g, withoutFlats(flatRate())...), 6, want{quantity: 6, billed: 6, exact: "2900", amount: 2900}, 2},
		// Flat-rate section: quantity 12 graduated is
		// (5 × 5 + 10) + (5 × 4 + 20) + (2 × 3 + 30) = 111 USD.
		{"flat amounts, Stripe's example", tieredPrice(g, flatRate()...), 12, want{quantity: 12, billed: 12, exact: "11100", amount: 11100}, 3},
		// (5 × 500 + 1000) + (5 × 400 + 2000) + (5 × 300 + 3000) + (5 × 200 + 4000)
		{"flat amounts at a boundary", tieredPrice(g, flatRate()...), 20, want{quantity: 20, billed: 20, exact: "17000", amount: 17000}, 4},
		// 17000 + (1 × 100 + 5000): the inf tier's flat amount comes with its first unit.
		{"flat amounts into the inf tier", tieredPrice(g, flatRate()...), 21, want{quantity: 21, billed: 21, exact: "22100", amount: 22100}, 5},
		// "If quantity is 0, the total amount is 10 USD regardless of the tiered
		// pricing model": the first tier's flat amount.
		{"zero bills the first flat amount", tieredPrice(g, flatRate()...), 0,
			want{exact: "1000", amount: 1000, caveats: []CaveatCode{CaveatZeroQuantityFlatFee}}, 1},
		{"negative bills the first flat amount", tieredPrice(g, flatRate()...), -3,
			want{exact: "1000", amount: 1000, caveats: []CaveatCode{CaveatZeroQuantityFlatFee, CaveatNegativeUsage}}, 1},
		// Stripe's way to bill 0 without usage: an up_to=1 tier whose unit amount
		// is the flat rate, no flat amount.
		{"Stripe's zero-usage workaround, at 0", tieredPrice(g,
			&stripe.PriceTier{UpTo: 1, UnitAmount: 1000}, &stripe.PriceTier{UnitAmount: 100}), 0, want{exact: "0"}, 1},
		// 1 × 1000 + 2 × 100
		{"Stripe's zero-usage workaround, at 3", tieredPrice(g,
			&stripe.PriceTier{UpTo: 1, UnitAmount: 1000}, &stripe.PriceTier{UnitAmount: 100}), 3, want{quantity: 3, billed: 3, exact: "1200", amount: 1200}, 2},
		// A single inf tier is per-unit pricing: 4 × 250
		{"single inf tier", tieredPrice(g, &stripe.PriceTier{UnitAmount: 250}), 4, want{quantity: 4, billed: 4, exact: "1000", amount: 1000}, 1},
		// Observed on Stripe's forum: 4 USD for the first 100000 tokens, 0.0065 cents
		// a token after; 100070 tokens bill 4.00 USD: 400 + 70 × 0.0065 = 400.455.
		{"decimal overage, forum example", tieredPrice(g,
			&stripe.PriceTier{UpTo: 100000, FlatAmount: 400}, &stripe.PriceTier{UnitAmountDecimal: 0.0065}), 100070,
			want{quantity: 100070, billed: 100070, exact: "80091/200", amount: 400, max: i64(401), caveats: []CaveatCode{CaveatFractional}}, 2},
		// Per-tier rounding could differ from the line's: 1 × 0.4 + 1 × 0.4 = 0.8 rounds
		// to 1 for the line, to 0 + 0 per tier nearest, to 1 + 1 per tier up.
		{"tiers that round apart", tieredPrice(g,
			&stripe.PriceTier{UpTo: 1, UnitAmountDecimal: 0.4}, &stripe.PriceTier{UnitAmountDecimal: 0.4}), 2,
			want{quantity: 2, billed: 2, exact: "4/5", amount: 1, min: i64(0), max: i64(2), caveats: []CaveatCode{CaveatFractional}}, 2},
		// A decimal flat amount: 2 × 100 + 0.5
		{"decimal flat amount", tieredPrice(g, &stripe.PriceTier{UnitAmount: 100, FlatAmountDecimal: 0.5}), 2,
			want{quantity: 2, billed: 2, exact: "401/2", amount: 201, min: i64(200), caveats: []CaveatCode{CaveatFractional, CaveatRoundingTie}}, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			q := check(t, tc.price, "", tc.usage, tc.want)
			require.Len(t, q.Tiers, tc.tiers)
		})
	}
}

func TestGraduatedBreakdown(t *testing.T) {
	t.Parallel()
	// Flat-rate example at 12: (5 × 500 + 1000), (5 × 400 + 2000), (2 × 300 + 3000).
	q, err := Evaluate(tieredPrice(stripe.PriceTiersModeGraduated, flatRate()...), "", 12)
	require.NoError(t, err)
	type row struct {
		tier              int
		from, upTo, units int64
		exact             string
	}
	var got []row
	for _, c := range q.Tiers {
		got = append(got, row{c.Tier, c.From, c.UpTo, c.Units, c.Exact.RatString()})
	}
	require.Equal(t, []row{{0, 1, 5, 5, "3500"}, {1, 6, 10, 5, "4000"}, {2, 11, 15, 2, "3600"}}, got)
}

func TestEvaluateVolume(t *testing.T) {
	t.Parallel()
	v := stripe.PriceTiersModeVolume
	cases := []struct {
		name  string
		price *stripe.Price
		usage int64
		want  want
		tier  int // the tier that charged
	}{
		// Tiered-pricing guide, volume table: 1 → 7 USD, 5 → 35 USD, 6 → 39 USD,
		// 20 → 120 USD, 25 → 150 USD.
		// 1 × 700
		{"1", tieredPrice(v, fonts()...), 1, want{quantity: 1, billed: 1, exact: "700", amount: 700}, 0},
		// 5 × 700: 5 is the first tier's last unit
		{"at the first boundary", tieredPrice(v, fonts()...), 5, want{quantity: 5, billed: 5, exact: "3500", amount: 3500}, 0},
		// 6 × 650: every unit at the second tier's price
		{"just across", tieredPrice(v, fonts()...), 6, want{quantity: 6, billed: 6, exact: "3900", amount: 3900}, 1},
		// 10 × 650
		{"at the second boundary", tieredPrice(v, fonts()...), 10, want{quantity: 10, billed: 10, exact: "6500", amount: 6500}, 1},
		// 11 × 600: the total drops as it crosses into the inf tier
		{"into the inf tier", tieredPrice(v, fonts()...), 11, want{quantity: 11, billed: 11, exact: "6600", amount: 6600}, 2},
		// 20 × 600
		{"20", tieredPrice(v, fonts()...), 20, want{quantity: 20, billed: 20, exact: "12000", amount: 12000}, 2},
		// 25 × 600
		{"25", tieredPrice(v, fonts()...), 25, want{quantity: 25, billed: 25, exact: "15000", amount: 15000}, 2},
		{"zero, no flat amounts", tieredPrice(v, fonts()...), 0, want{exact: "0"}, 0},
		// Flat-rate section: quantity 12 volume is 12 × 3 USD + 30 USD = 66 USD.
		{"flat amount, Stripe's example", tieredPrice(v, flatRate()...), 12, want{quantity: 12, billed: 12, exact: "6600", amount: 6600}, 2},
		// 20 × 200 + 4000, the fourth tier's last unit
		{"flat amount at a boundary", tieredPrice(v, flatRate()...), 20, want{quantity: 20, billed: 20, exact: "8000", amount: 8000}, 3},
		// 21 × 100 + 5000
		{"flat amount in the inf tier", tieredPrice(v, flatRate()...), 21, want{quantity: 21, billed: 21, exact: "7100", amount: 7100}, 4},
		// "If quantity is 0, the total amount is 10 USD regardless of the tiered pricing model."
		{"zero bills the first flat amount", tieredPrice(v, flatRate()...), 0,
			want{exact: "1000", amount: 1000, caveats: []CaveatCode{CaveatZeroQuantityFlatFee}}, 0},
		// Decimal unit amount: 7 × 0.25 = 1.75
		{"decimal unit amount", tieredPrice(v, &stripe.PriceTier{UpTo: 10, UnitAmountDecimal: 0.25}, &stripe.PriceTier{UnitAmountDecimal: 0.2}), 7,
			want{quantity: 7, billed: 7, exact: "7/4", amount: 2, min: i64(1), caveats: []CaveatCode{CaveatFractional}}, 0},
		// A bounded last tier still takes its own bound: 10 × 0.25 = 2.5
		{"bounded last tier at its bound", tieredPrice(v, &stripe.PriceTier{UpTo: 10, UnitAmountDecimal: 0.25}), 10,
			want{quantity: 10, billed: 10, exact: "5/2", amount: 3, min: i64(2), caveats: []CaveatCode{CaveatFractional, CaveatRoundingTie}}, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			q := check(t, tc.price, "", tc.usage, tc.want)
			require.Len(t, q.Tiers, 1)
			require.Equal(t, tc.tier, q.Tiers[0].Tier)
			require.Equal(t, q.BilledQuantity, q.Tiers[0].Units)
		})
	}
}

func TestEvaluateCurrencies(t *testing.T) {
	t.Parallel()
	// Manage prices, multi-currency: unit_amount 1000 USD, currency_options
	// eur 9000 and jpy 12000.
	multi := func() *stripe.Price {
		return with(metered(1000), func(p *stripe.Price) {
			p.CurrencyOptions = map[string]*stripe.PriceCurrencyOptions{
				"usd": {UnitAmount: 1000},
				"eur": {UnitAmount: 9000},
				"jpy": {UnitAmount: 12000},
			}
		})
	}
	tieredMulti := func() *stripe.Price {
		return with(tieredPrice(stripe.PriceTiersModeGraduated, fonts()...), func(p *stripe.Price) {
			p.CurrencyOptions = map[string]*stripe.PriceCurrencyOptions{"eur": {Tiers: []*stripe.PriceCurrencyOptionsTier{
				{UpTo: 5, UnitAmount: 650}, {UnitAmount: 600, FlatAmount: 100},
			}}}
		})
	}
	cases := []struct {
		name     string
		price    *stripe.Price
		currency string
		usage    int64
		currOut  string
		want     want
	}{
		// 2 × 1000
		{"own currency, none asked", multi(), "", 2, "usd", want{quantity: 2, billed: 2, exact: "2000", amount: 2000}},
		{"own currency in upper case", multi(), "USD", 2, "usd", want{quantity: 2, billed: 2, exact: "2000", amount: 2000}},
		// 2 × 9000
		{"eur option", multi(), "eur", 2, "eur", want{quantity: 2, billed: 2, exact: "18000", amount: 18000}},
		// 2 × 12000 yen, zero-decimal: 24000 JPY
		{"jpy option", multi(), "JPY", 2, "jpy", want{quantity: 2, billed: 2, exact: "24000", amount: 24000}},
		// Option tiers, graduated: 5 × 650 + (2 × 600 + 100)
		{"tiered option", tieredMulti(), "eur", 7, "eur", want{quantity: 7, billed: 7, exact: "4550", amount: 4550}},
		// The price's own tiers for its own currency: 5 × 700 + 2 × 650
		{"tiered own currency", tieredMulti(), "usd", 7, "usd", want{quantity: 7, billed: 7, exact: "4800", amount: 4800}},
		// An option keyed in upper case still answers.
		{"option key in another case", with(metered(1000), func(p *stripe.Price) {
			p.CurrencyOptions = map[string]*stripe.PriceCurrencyOptions{"EUR": {UnitAmount: 900}}
		}), "eur", 1, "eur", want{quantity: 1, billed: 1, exact: "900", amount: 900}},
		// A decimal option: 3 × 0.5 = 1.5
		{"decimal option", with(metered(1000), func(p *stripe.Price) {
			p.CurrencyOptions = map[string]*stripe.PriceCurrencyOptions{"gbp": {UnitAmountDecimal: 0.5}}
		}), "gbp", 3, "gbp", want{quantity: 3, billed: 3, exact: "3/2", amount: 2, min: i64(1),
			caveats: []CaveatCode{CaveatFractional, CaveatRoundingTie}}},
		// KWD counts thousandths and Stripe's payment APIs want the last digit 0: 1 × 1234
		{"three-decimal amount not ending in 0", with(metered(1234), func(p *stripe.Price) { p.Currency = "kwd" }), "", 1, "kwd",
			want{quantity: 1, billed: 1, exact: "1234", amount: 1234, caveats: []CaveatCode{CaveatThreeDecimalLastDigit}}},
		// 2 × 1235 = 2470 ends in 0
		{"three-decimal amount ending in 0", with(metered(1235), func(p *stripe.Price) { p.Currency = "kwd" }), "", 2, "kwd",
			want{quantity: 2, billed: 2, exact: "2470", amount: 2470}},
		// ISK is charged in whole krónur counted in hundredths: 3 × 150 = 450 is 4.50 ISK
		{"ISK amount not in whole units", with(metered(150), func(p *stripe.Price) { p.Currency = "isk" }), "", 3, "isk",
			want{quantity: 3, billed: 3, exact: "450", amount: 450, caveats: []CaveatCode{CaveatWholeUnitCurrency}}},
		// 2 × 150 = 300, 3 ISK
		{"ISK amount in whole units", with(metered(150), func(p *stripe.Price) { p.Currency = "isk" }), "", 2, "isk",
			want{quantity: 2, billed: 2, exact: "300", amount: 300}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			q := check(t, tc.price, tc.currency, tc.usage, tc.want)
			require.Equal(t, tc.currOut, q.Currency)
		})
	}
}

// TestEvaluateStripeJSON evaluates prices decoded by stripe-go from JSON in
// the shape Stripe answers: unit_amount null beside a fractional
// unit_amount_decimal, the last tier's up_to null.
func TestEvaluateStripeJSON(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		json  string
		usage int64
		want  want
	}{
		// 0.05 × 30 = 1.5, Stripe's decimal example
		{"decimal per unit", `{"id":"price_dec","object":"price","type":"recurring","billing_scheme":"per_unit","currency":"usd",
			"recurring":{"interval":"month","interval_count":1,"usage_type":"metered","meter":"mtr_1"},
			"unit_amount":null,"unit_amount_decimal":"0.05","tiers_mode":null,"transform_quantity":null,"custom_unit_amount":null}`,
			30, want{quantity: 30, billed: 30, exact: "3/2", amount: 2, min: i64(1), caveats: []CaveatCode{CaveatFractional, CaveatRoundingTie}}},
		// Volume, Stripe's flat-rate tiers: 12 × 300 + 3000
		{"volume tiers", `{"id":"price_vol","object":"price","type":"recurring","billing_scheme":"tiered","tiers_mode":"volume","currency":"usd",
			"recurring":{"interval":"month","usage_type":"metered"},"unit_amount":null,"unit_amount_decimal":null,
			"tiers":[{"up_to":5,"unit_amount":500,"unit_amount_decimal":"500","flat_amount":1000,"flat_amount_decimal":"1000"},
			{"up_to":10,"unit_amount":400,"unit_amount_decimal":"400","flat_amount":2000,"flat_amount_decimal":"2000"},
			{"up_to":15,"unit_amount":300,"unit_amount_decimal":"300","flat_amount":3000,"flat_amount_decimal":"3000"},
			{"up_to":20,"unit_amount":200,"unit_amount_decimal":"200","flat_amount":4000,"flat_amount_decimal":"4000"},
			{"up_to":null,"unit_amount":100,"unit_amount_decimal":"100","flat_amount":5000,"flat_amount_decimal":"5000"}]}`,
			12, want{quantity: 12, billed: 12, exact: "6600", amount: 6600}},
		// Package: ceil(150 / 60) × 1000
		{"package", `{"id":"price_pkg","object":"price","type":"recurring","billing_scheme":"per_unit","currency":"usd",
			"recurring":{"interval":"month","usage_type":"metered"},"unit_amount":1000,"unit_amount_decimal":"1000",
			"transform_quantity":{"divide_by":60,"round":"up"}}`,
			150, want{quantity: 150, billed: 3, exact: "3000", amount: 3000}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var p stripe.Price
			require.NoError(t, json.Unmarshal([]byte(tc.json), &p))
			check(t, &p, "", tc.usage, tc.want)
		})
	}
}
