package pricing

import (
	"math"
	"math/big"
	"strconv"
	"strings"
)

// Stripe's decimal amounts have at most 12 decimal places.
const maxDecimalPlaces = 12

// Every decimal of at most 15 significant digits survives a trip through
// float64 (the IEEE 754 binary64 guarantee), so the shortest representation
// of the float gives that decimal back exactly.
const maxExactDigits = 15

// decimalRat turns a *_decimal field, which stripe-go v82 decodes from
// Stripe's decimal string into a float64, back into the decimal Stripe sent.
//
// The shortest representation of the float is that decimal whenever the
// decimal had at most 15 significant digits. A float whose shortest
// representation has more digits, or more than 12 decimal places, cannot
// be told apart from a neighbouring decimal: it is refused, never rounded.
// A decimal of more than 15 significant digits whose extra digits vanished
// in decoding (possible only from 1000 minor units up) cannot be detected;
// its error is below one part in 2^53.
func decimalRat(f float64, field string) (*big.Rat, error) {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return nil, notModeled(CodeImpreciseDecimal, field+" is not a finite number")
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	places := 0
	if i := strings.IndexByte(s, '.'); i >= 0 {
		places = len(s) - i - 1
	}
	if places > maxDecimalPlaces {
		return nil, notModeled(CodeImpreciseDecimal, field+" "+s+" has more than 12 decimal places: not a value Stripe sends, so the float64 decoding altered it")
	}
	digits := strings.Trim(strings.NewReplacer("-", "", ".", "").Replace(s), "0")
	if len(digits) > maxExactDigits {
		return nil, notModeled(CodeImpreciseDecimal, field+" "+s+" has more than 15 significant digits: stripe-go decodes it into a float64, which cannot be trusted to hold it exactly")
	}
	r, ok := new(big.Rat).SetString(s)
	if !ok {
		return nil, notModeled(CodeImpreciseDecimal, field+" "+s+" is not a decimal")
	}
	return r, nil
}

// amountRat is the amount of an integer field and its decimal twin
// (unit_amount and unit_amount_decimal, flat_amount and flat_amount_decimal).
// stripe-go cannot tell an absent field from zero, so a zero decimal defers
// to the integer; when both are set they must agree, as Stripe sets them.
func amountRat(decimal float64, whole int64, field string) (*big.Rat, error) {
	r := new(big.Rat).SetInt64(whole)
	if decimal != 0 {
		d, err := decimalRat(decimal, field+"_decimal")
		if err != nil {
			return nil, err
		}
		if whole != 0 && d.Cmp(r) != 0 {
			return nil, notModeled(CodeInconsistentAmounts, field+" "+strconv.FormatInt(whole, 10)+" and "+field+"_decimal "+d.FloatString(maxDecimalPlaces)+" disagree")
		}
		r = d
	}
	if r.Sign() < 0 {
		return nil, notModeled(CodeNegativeAmount, field+" is negative")
	}
	return r, nil
}

// floorInt is the greatest integer not above r (big.Int's Div is Euclidean
// and a Rat's denominator is positive, so this is the floor for either sign).
func floorInt(r *big.Rat) *big.Int {
	return new(big.Int).Div(r.Num(), r.Denom())
}

// ceilInt is the least integer not below r.
func ceilInt(r *big.Rat) *big.Int {
	return new(big.Int).Neg(floorInt(new(big.Rat).Neg(r)))
}

// roundHalfUp is the integer nearest r, a half going up (away from zero for
// the non-negative amounts this package computes).
func roundHalfUp(r *big.Rat) *big.Int {
	return floorInt(new(big.Rat).Add(r, big.NewRat(1, 2)))
}

// isHalf reports whether r lies exactly halfway between two integers.
func isHalf(r *big.Rat) bool {
	frac := new(big.Rat).Sub(r, new(big.Rat).SetInt(floorInt(r)))
	return frac.Cmp(big.NewRat(1, 2)) == 0
}
