package stripesim

import (
	"math/big"
	"regexp"
	"strings"
)

// The simulator's own reading of how Stripe prices a quantity of metered
// usage (docs/simulator.md, "Billing"): per unit, with a decimal unit
// amount, after transform_quantity, and graduated or volume tiers with flat
// amounts. Amounts are exact rationals in the currency's minor unit until
// the line is rounded once, to the nearest whole unit, halves up: "Rounding
// occurs on the line item level of your invoices"
// (docs.stripe.com/billing/subscriptions/decimal-amounts).

// maxDecimalPlaces is how many decimal places a *_decimal amount may have.
const maxDecimalPlaces = 12

var decimalRE = regexp.MustCompile(`^[0-9]+(\.[0-9]+)?$`)

// parseDecimal reads a non-negative decimal amount of at most 12 decimal
// places, as unit_amount_decimal and flat_amount_decimal take.
func parseDecimal(param, v string) (*big.Rat, *apiError) {
	if !decimalRE.MatchString(v) {
		return nil, errValidation("parameter_invalid_decimal", param, "Invalid decimal: %s", v)
	}
	if _, frac, ok := strings.Cut(v, "."); ok && len(frac) > maxDecimalPlaces {
		return nil, errValidation("parameter_invalid_decimal", param,
			"Invalid decimal: %s. %s can have at most %d decimal places.", v, param, maxDecimalPlaces)
	}
	r, _ := new(big.Rat).SetString(v)
	return r, nil
}

// decimalString renders r as Stripe renders a *_decimal field: the shortest
// decimal, without trailing zeros ("1000", "0.05").
func decimalString(r *big.Rat) string {
	s := r.FloatString(maxDecimalPlaces)
	s = strings.TrimRight(s, "0")
	return strings.TrimSuffix(s, ".")
}

// wholeOf returns r as an int64 when it is a whole number that fits, as the
// integer twin of a *_decimal field (unit_amount is null otherwise).
func wholeOf(r *big.Rat) (int64, bool) {
	if r == nil || !r.IsInt() || !r.Num().IsInt64() {
		return 0, false
	}
	return r.Num().Int64(), true
}

// tier is one tier of a tiered price. upTo 0 is inf.
type tier struct {
	upTo int64
	unit *big.Rat // nil: no per-unit amount
	flat *big.Rat // nil: no flat amount
}

// tierAmount is what quantity units of the tier cost: the units times the
// unit amount, plus the flat amount.
func (t tier) amount(units int64) *big.Rat {
	out := new(big.Rat)
	if t.unit != nil {
		out.Mul(t.unit, new(big.Rat).SetInt64(units))
	}
	if t.flat != nil {
		out.Add(out, t.flat)
	}
	return out
}

// contains reports whether quantity q lies within the tier's upper bound.
func (t tier) contains(q int64) bool { return t.upTo == 0 || q <= t.upTo }

// transformQuantity divides usage by divideBy and rounds up or down, as
// transform_quantity does.
func transformQuantity(q, divideBy int64, round string) int64 {
	out := q / divideBy
	if round == "up" && q%divideBy != 0 {
		out++
	}
	return out
}

// graduatedAmount charges each unit at the tier it falls in, and the flat
// amount of every tier the quantity reaches. Zero usage reaches the first
// tier: its flat amount is charged (the worst plausible reading,
// docs/simulator.md).
func graduatedAmount(tiers []tier, q int64) *big.Rat {
	total := new(big.Rat)
	var lower int64 // the units of the tiers before this one
	for i, t := range tiers {
		if q <= lower && i > 0 {
			break
		}
		units := q - lower
		if !t.contains(q) {
			units = t.upTo - lower
		}
		total.Add(total, t.amount(units))
		if t.upTo == 0 {
			break
		}
		lower = t.upTo
	}
	return total
}

// volumeAmount charges the whole quantity at the first tier whose upper
// bound it does not pass, plus that tier's flat amount.
func volumeAmount(tiers []tier, q int64) *big.Rat {
	for _, t := range tiers {
		if t.contains(q) {
			return t.amount(q)
		}
	}
	return new(big.Rat) // unreachable: the last tier is inf
}

// roundHalfUp rounds a non-negative rational to the nearest integer,
// halves up.
func roundHalfUp(r *big.Rat) int64 {
	half := new(big.Rat).Add(r, big.NewRat(1, 2))
	q := new(big.Int).Quo(half.Num(), half.Denom()) // floor, both positive
	return q.Int64()
}

// lineAmount is the amount of a line billing quantity q (already clamped to
// zero or more) of price p.
func (p *price) lineAmount(q int64) int64 {
	if p.billingScheme == schemeTiered {
		if p.tiersMode == tiersVolume {
			return roundHalfUp(volumeAmount(p.tiers, q))
		}
		return roundHalfUp(graduatedAmount(p.tiers, q))
	}
	if p.transform != nil {
		q = transformQuantity(q, p.transform.divideBy, p.transform.round)
	}
	return roundHalfUp(new(big.Rat).Mul(p.unit, new(big.Rat).SetInt64(q)))
}
