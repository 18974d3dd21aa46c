package pricing

import "errors"

// Code names why a price cannot be evaluated. Codes are stable: callers may
// store them and match on them.
type Code string

// The reasons Evaluate refuses a price.
const (
	// CodeNoPrice: no price was given.
	CodeNoPrice Code = "no_price"
	// CodeDeleted: the object is a deleted price.
	CodeDeleted Code = "deleted"
	// CodeCustomAmount: the customer chooses the amount (custom_unit_amount).
	CodeCustomAmount Code = "custom_amount"
	// CodeNotRecurring: a one-time price; it bills no usage.
	CodeNotRecurring Code = "not_recurring"
	// CodeLicensed: a licensed (seat) price bills the subscription item's
	// quantity, not usage.
	CodeLicensed Code = "licensed"
	// CodeUnknownUsageType: recurring.usage_type is neither metered nor licensed.
	CodeUnknownUsageType Code = "unknown_usage_type"
	// CodeInvalidCurrency: the currency is not a three-letter code.
	CodeInvalidCurrency Code = "invalid_currency"
	// CodeNoCurrencyOption: the price has no amounts in the asked currency
	// (or currency_options was not expanded).
	CodeNoCurrencyOption Code = "no_currency_option"
	// CodeUnknownBillingScheme: billing_scheme is neither per_unit nor tiered.
	CodeUnknownBillingScheme Code = "unknown_billing_scheme"
	// CodeUnknownTiersMode: tiers_mode is neither graduated nor volume.
	CodeUnknownTiersMode Code = "unknown_tiers_mode"
	// CodeTiersMissing: a tiered price without tiers (tiers was not expanded).
	CodeTiersMissing Code = "tiers_missing"
	// CodeInvalidTiers: tiers Stripe would not have accepted (bounds out of
	// order, an unbounded tier before the last one).
	CodeInvalidTiers Code = "invalid_tiers"
	// CodeBeyondTiers: the quantity exceeds the last tier's upper bound.
	CodeBeyondTiers Code = "beyond_last_tier"
	// CodeTransformWithTiers: transform_quantity on a tiered price, a
	// combination Stripe refuses.
	CodeTransformWithTiers Code = "transform_with_tiers"
	// CodeInvalidTransform: divide_by not positive, or round neither up nor down.
	CodeInvalidTransform Code = "invalid_transform"
	// CodeInconsistentAmounts: an integer amount and its decimal twin disagree.
	CodeInconsistentAmounts Code = "inconsistent_amounts"
	// CodeNegativeAmount: a unit or flat amount below zero.
	CodeNegativeAmount Code = "negative_amount"
	// CodeImpreciseDecimal: a decimal amount that stripe-go's float64 may
	// have altered, or with more than the 12 decimal places Stripe allows.
	CodeImpreciseDecimal Code = "imprecise_decimal"
	// CodeOverflow: the amount does not fit in int64 minor units.
	CodeOverflow Code = "amount_overflow"
)

// NotModeled is the error of a price the package does not evaluate: Code is
// stable, Reason is for people and names the field at fault.
type NotModeled struct {
	Code   Code
	Reason string
}

func (e *NotModeled) Error() string {
	return "pricing: " + string(e.Code) + ": " + e.Reason
}

// CodeOf returns the code of err if it is, or wraps, a *NotModeled.
func CodeOf(err error) (Code, bool) {
	var nm *NotModeled
	if errors.As(err, &nm) {
		return nm.Code, true
	}
	return "", false
}

func notModeled(code Code, reason string) *NotModeled {
	return &NotModeled{Code: code, Reason: reason}
}
