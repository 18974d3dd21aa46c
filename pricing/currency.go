package pricing

import (
	"strconv"
	"strings"
)

// zeroDecimal are the currencies Stripe's API counts in whole units: an
// amount of 500 JPY is 500. Stripe's list (docs.stripe.com/currencies,
// "Zero-decimal currencies") also names UGX; see wholeUnitTwoDecimal.
var zeroDecimal = map[string]bool{
	"bif": true, "clp": true, "djf": true, "gnf": true, "jpy": true,
	"kmf": true, "krw": true, "mga": true, "pyg": true, "rwf": true,
	"vnd": true, "vuv": true, "xaf": true, "xof": true, "xpf": true,
}

// threeDecimal are counted in thousandths: 1234 KWD minor units is 1.234 KWD.
// Stripe's payment APIs want their amounts to end in 0.
var threeDecimal = map[string]bool{
	"bhd": true, "jod": true, "kwd": true, "omr": true, "tnd": true,
}

// wholeUnitTwoDecimal are zero-decimal currencies that Stripe's API still
// counts in hundredths "for backwards compatibility", whose amounts must be
// whole units (a multiple of 100): 500 is 5 ISK. Stripe's special-cases
// table says so for both; its zero-decimal list also names UGX, and the
// more specific rule is the one followed here.
var wholeUnitTwoDecimal = map[string]bool{
	"isk": true, "ugx": true,
}

// MinorUnits is the number of decimal places of currency's amounts in
// Stripe's API: 0 for zero-decimal currencies, 3 for three-decimal ones,
// and 2 for every other code, as Stripe says currencies are unless
// specified otherwise. The code is matched without regard to case.
func MinorUnits(currency string) int {
	c := strings.ToLower(currency)
	switch {
	case zeroDecimal[c]:
		return 0
	case threeDecimal[c]:
		return 3
	default:
		return 2
	}
}

// Format writes amount, in currency's minor units, in major units with the
// upper-case code after it, for reports: "12.34 USD", "1200 JPY",
// "1.234 KWD", "-0.05 EUR". It uses no thousands separators.
func Format(amount int64, currency string) string {
	return Major(amount, currency) + " " + strings.ToUpper(currency)
}

// Major writes amount, in currency's minor units, in major units without
// the currency: "12.34" for 1234 usd, "1200" for 1200 jpy.
func Major(amount int64, currency string) string {
	sign := ""
	mag := uint64(amount)
	if amount < 0 {
		sign = "-"
		mag = -mag
	}
	digits := strconv.FormatUint(mag, 10)
	places := MinorUnits(currency)
	if places == 0 {
		return sign + digits
	}
	if len(digits) <= places {
		digits = strings.Repeat("0", places-len(digits)+1) + digits
	}
	cut := len(digits) - places
	return sign + digits[:cut] + "." + digits[cut:]
}

// normalCurrency is currency in Stripe's lower case, or an error when it is
// not three ASCII letters.
func normalCurrency(currency string) (string, error) {
	c := strings.ToLower(currency)
	if len(c) != 3 {
		return "", notModeled(CodeInvalidCurrency, strconv.Quote(currency)+" is not a three-letter currency code")
	}
	for i := 0; i < len(c); i++ {
		if c[i] < 'a' || c[i] > 'z' {
			return "", notModeled(CodeInvalidCurrency, strconv.Quote(currency)+" is not a three-letter currency code")
		}
	}
	return c, nil
}
