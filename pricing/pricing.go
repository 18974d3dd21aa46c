package pricing

import (
	"math/big"
	"strconv"
	"strings"

	"github.com/stripe/stripe-go/v82"
)

// Quote is what one invoice line of a metered price comes to for one
// period's usage, before tax, discounts and credits.
type Quote struct {
	// PriceID is the price evaluated.
	PriceID string
	// Currency is the currency of every amount, in Stripe's lower case.
	Currency string
	// Usage is the period's usage as given.
	Usage int64
	// Quantity is Usage clamped at 0: Stripe bills a negative period total
	// as quantity 0.
	Quantity int64
	// BilledQuantity is Quantity after transform_quantity (divided and
	// rounded up or down); it equals Quantity when the price has none.
	BilledQuantity int64
	// Exact is the amount in minor units before any rounding.
	Exact *big.Rat
	// Amount is Exact rounded to whole minor units once for the line,
	// a half going up: the reading of Stripe's documentation Tally follows.
	Amount int64
	// MinAmount and MaxAmount bound what Stripe could bill under any
	// rounding its documentation leaves open (down or up, per line or per
	// tier). They equal Amount when Exact is whole.
	MinAmount, MaxAmount int64
	// Tiers holds the tiers that charged, for a tiered price; nil otherwise.
	Tiers []TierCharge
	// Caveats name what a reader of Amount should know; empty when Amount
	// follows from documented rules alone.
	Caveats []Caveat
}

// Has reports whether q carries the caveat code c.
func (q Quote) Has(c CaveatCode) bool {
	for _, cv := range q.Caveats {
		if cv.Code == c {
			return true
		}
	}
	return false
}

// Note is q's caveat codes, comma-separated: what a reader of Amount
// should know, in a line; empty when there is none.
func (q Quote) Note() string {
	codes := make([]string, len(q.Caveats))
	for i, cv := range q.Caveats {
		codes[i] = string(cv.Code)
	}
	return strings.Join(codes, ", ")
}

// TierCharge is one tier's share of a tiered price's amount.
type TierCharge struct {
	// Tier is the tier's index in the price's tiers, from 0.
	Tier int
	// From and UpTo are the first and last units the tier covers; UpTo 0
	// means the tier has no upper bound ("inf").
	From, UpTo int64
	// Units is the number of units charged at the tier's unit amount.
	Units int64
	// UnitAmount and FlatAmount are the tier's amounts in minor units.
	UnitAmount, FlatAmount *big.Rat
	// Exact is Units × UnitAmount + FlatAmount, unrounded.
	Exact *big.Rat
}

// CaveatCode names a caveat. Codes are stable.
type CaveatCode string

// The caveats a Quote can carry.
const (
	// CaveatNegativeUsage: the usage was negative and is billed as 0.
	CaveatNegativeUsage CaveatCode = "negative_usage"
	// CaveatZeroQuantityFlatFee: the quantity is 0 and the amount is the
	// first tier's flat fee, which Stripe bills even then.
	CaveatZeroQuantityFlatFee CaveatCode = "zero_quantity_flat_fee"
	// CaveatFractional: Exact has a fraction of a minor unit; Amount follows
	// the assumed rounding and MinAmount..MaxAmount bound the others.
	CaveatFractional CaveatCode = "fractional_minor_unit"
	// CaveatRoundingTie: Exact is exactly halfway; Stripe's documented
	// example does not decide which way such a half goes.
	CaveatRoundingTie CaveatCode = "rounding_tie"
	// CaveatThreeDecimalLastDigit: a three-decimal currency amount that does
	// not end in 0, which Stripe's payment APIs require.
	CaveatThreeDecimalLastDigit CaveatCode = "three_decimal_last_digit"
	// CaveatWholeUnitCurrency: an ISK or UGX amount that is not whole units
	// (a multiple of 100 minor units).
	CaveatWholeUnitCurrency CaveatCode = "whole_unit_currency"
)

// Caveat is a stable code and a sentence for people.
type Caveat struct {
	Code   CaveatCode
	Detail string
}

// tier is a price tier with its amounts resolved from stripe-go's fields.
type tier struct {
	upTo       int64 // 0: no upper bound
	unit, flat *big.Rat
}

// Evaluate returns what price p bills, in currency, for one billing period
// whose metered usage totals usage.
//
// currency picks the amounts: p's own when it is p's currency or empty, else
// p.CurrencyOptions[currency] (a subscription in another currency uses that
// option); currency_options and tiers must have been expanded when the
// price was retrieved. usage is the period's total as Tally's ledger holds
// it, corrections included; a negative total bills as 0.
//
// The amount is one invoice line's, before tax, discounts, coupons, credits
// and prorations. A price the package does not model returns a *NotModeled
// error and no amount.
func Evaluate(p *stripe.Price, currency string, usage int64) (Quote, error) {
	if p == nil {
		return Quote{}, notModeled(CodeNoPrice, "no price was given")
	}
	if p.Deleted {
		return Quote{}, notModeled(CodeDeleted, "price "+p.ID+" is deleted")
	}
	if p.CustomUnitAmount != nil {
		return Quote{}, notModeled(CodeCustomAmount, "price "+p.ID+" lets the customer choose the amount (custom_unit_amount)")
	}
	if p.Type == stripe.PriceTypeOneTime || p.Recurring == nil {
		return Quote{}, notModeled(CodeNotRecurring, "price "+p.ID+" is not recurring (type "+strconv.Quote(string(p.Type))+"): it bills no usage")
	}
	switch p.Recurring.UsageType {
	case stripe.PriceRecurringUsageTypeMetered:
	case stripe.PriceRecurringUsageTypeLicensed, "":
		return Quote{}, notModeled(CodeLicensed, "price "+p.ID+" is licensed (recurring.usage_type "+strconv.Quote(string(p.Recurring.UsageType))+", Stripe's default is licensed): it bills the item's quantity, not usage")
	default:
		return Quote{}, notModeled(CodeUnknownUsageType, "price "+p.ID+" has recurring.usage_type "+strconv.Quote(string(p.Recurring.UsageType)))
	}

	q := Quote{PriceID: p.ID, Usage: usage, Quantity: usage}
	if usage < 0 {
		q.Quantity = 0
		q.Caveats = append(q.Caveats, Caveat{CaveatNegativeUsage, "usage " + strconv.FormatInt(usage, 10) + " is negative; Stripe bills a negative period total as quantity 0"})
	}

	amounts, err := pickCurrency(p, currency)
	if err != nil {
		return Quote{}, err
	}
	q.Currency = amounts.currency

	var components []*big.Rat
	switch p.BillingScheme {
	case stripe.PriceBillingSchemePerUnit:
		components, err = perUnit(p, amounts, &q)
	case stripe.PriceBillingSchemeTiered:
		components, err = tiered(p, amounts, &q)
	default:
		err = notModeled(CodeUnknownBillingScheme, "price "+p.ID+" has billing_scheme "+strconv.Quote(string(p.BillingScheme)))
	}
	if err != nil {
		return Quote{}, err
	}
	if err := settle(&q, components); err != nil {
		return Quote{}, err
	}
	return q, nil
}

// currencyAmounts are the amount fields of one of a price's currencies.
type currencyAmounts struct {
	currency   string
	unit       float64
	unitWhole  int64
	tiers      []tier
	tiersGiven bool
	tiersErr   error
}

// pickCurrency returns the amounts p bills in currency.
func pickCurrency(p *stripe.Price, currency string) (currencyAmounts, error) {
	own, err := normalCurrency(string(p.Currency))
	if currency == "" {
		if err != nil {
			return currencyAmounts{}, err
		}
		currency = own
	}
	cur, cerr := normalCurrency(currency)
	if cerr != nil {
		return currencyAmounts{}, cerr
	}
	if err == nil && cur == own {
		a := currencyAmounts{currency: cur, unit: p.UnitAmountDecimal, unitWhole: p.UnitAmount, tiersGiven: len(p.Tiers) > 0}
		a.tiers, a.tiersErr = priceTiers(p.Tiers)
		return a, nil
	}
	if p.CurrencyOptions == nil {
		return currencyAmounts{}, notModeled(CodeNoCurrencyOption, "price "+p.ID+" is in "+strconv.Quote(string(p.Currency))+" and carries no currency_options for "+cur+" (none exist, or currency_options was not expanded)")
	}
	opt := p.CurrencyOptions[cur]
	if opt == nil {
		for k, v := range p.CurrencyOptions {
			if strings.EqualFold(k, cur) {
				opt = v
				break
			}
		}
	}
	if opt == nil {
		return currencyAmounts{}, notModeled(CodeNoCurrencyOption, "price "+p.ID+" has no currency option for "+cur)
	}
	if opt.CustomUnitAmount != nil {
		return currencyAmounts{}, notModeled(CodeCustomAmount, "price "+p.ID+" lets the customer choose the amount in "+cur+" (currency_options custom_unit_amount)")
	}
	a := currencyAmounts{currency: cur, unit: opt.UnitAmountDecimal, unitWhole: opt.UnitAmount, tiersGiven: len(opt.Tiers) > 0}
	a.tiers, a.tiersErr = optionTiers(opt.Tiers)
	return a, nil
}

func priceTiers(ts []*stripe.PriceTier) ([]tier, error) {
	out := make([]tier, 0, len(ts))
	for i, t := range ts {
		if t == nil {
			return nil, notModeled(CodeInvalidTiers, "tier "+strconv.Itoa(i)+" is empty")
		}
		rt, err := resolveTier(i, t.UpTo, t.UnitAmountDecimal, t.UnitAmount, t.FlatAmountDecimal, t.FlatAmount)
		if err != nil {
			return nil, err
		}
		out = append(out, rt)
	}
	return out, nil
}

func optionTiers(ts []*stripe.PriceCurrencyOptionsTier) ([]tier, error) {
	out := make([]tier, 0, len(ts))
	for i, t := range ts {
		if t == nil {
			return nil, notModeled(CodeInvalidTiers, "tier "+strconv.Itoa(i)+" is empty")
		}
		rt, err := resolveTier(i, t.UpTo, t.UnitAmountDecimal, t.UnitAmount, t.FlatAmountDecimal, t.FlatAmount)
		if err != nil {
			return nil, err
		}
		out = append(out, rt)
	}
	return out, nil
}

func resolveTier(i int, upTo int64, unitDec float64, unit int64, flatDec float64, flat int64) (tier, error) {
	name := "tier " + strconv.Itoa(i) + " "
	u, err := amountRat(unitDec, unit, name+"unit_amount")
	if err != nil {
		return tier{}, err
	}
	f, err := amountRat(flatDec, flat, name+"flat_amount")
	if err != nil {
		return tier{}, err
	}
	return tier{upTo: upTo, unit: u, flat: f}, nil
}

// perUnit prices BilledQuantity × the unit amount, after transform_quantity.
func perUnit(p *stripe.Price, a currencyAmounts, q *Quote) ([]*big.Rat, error) {
	unit, err := amountRat(a.unit, a.unitWhole, "unit_amount")
	if err != nil {
		return nil, err
	}
	q.BilledQuantity = q.Quantity
	if t := p.TransformQuantity; t != nil {
		if t.DivideBy <= 0 {
			return nil, notModeled(CodeInvalidTransform, "price "+p.ID+" has transform_quantity.divide_by "+strconv.FormatInt(t.DivideBy, 10))
		}
		whole, rest := q.Quantity/t.DivideBy, q.Quantity%t.DivideBy
		switch t.Round {
		case stripe.PriceTransformQuantityRoundUp:
			if rest != 0 {
				whole++
			}
		case stripe.PriceTransformQuantityRoundDown:
		default:
			return nil, notModeled(CodeInvalidTransform, "price "+p.ID+" has transform_quantity.round "+strconv.Quote(string(t.Round)))
		}
		q.BilledQuantity = whole
	}
	line := new(big.Rat).Mul(new(big.Rat).SetInt64(q.BilledQuantity), unit)
	return []*big.Rat{line}, nil
}

// tiered prices a graduated or volume price; each charged tier is one
// component of the amount.
func tiered(p *stripe.Price, a currencyAmounts, q *Quote) ([]*big.Rat, error) {
	if p.TransformQuantity != nil {
		return nil, notModeled(CodeTransformWithTiers, "price "+p.ID+" is tiered and has transform_quantity, which Stripe does not combine")
	}
	mode := p.TiersMode
	if mode != stripe.PriceTiersModeGraduated && mode != stripe.PriceTiersModeVolume {
		return nil, notModeled(CodeUnknownTiersMode, "price "+p.ID+" has tiers_mode "+strconv.Quote(string(mode)))
	}
	if !a.tiersGiven {
		return nil, notModeled(CodeTiersMissing, "price "+p.ID+" is tiered but carries no tiers in "+a.currency+" (expand tiers, or currency_options, when retrieving it)")
	}
	if a.tiersErr != nil {
		return nil, a.tiersErr
	}
	ts := a.tiers
	var prev int64
	for i, t := range ts {
		last := i == len(ts)-1
		switch {
		case t.upTo == 0 && !last:
			return nil, notModeled(CodeInvalidTiers, "price "+p.ID+": tier "+strconv.Itoa(i)+" has no upper bound but is not the last tier")
		case t.upTo < 0 || (t.upTo != 0 && t.upTo <= prev):
			return nil, notModeled(CodeInvalidTiers, "price "+p.ID+": tier "+strconv.Itoa(i)+" up_to "+strconv.FormatInt(t.upTo, 10)+" is not above the previous tier's "+strconv.FormatInt(prev, 10))
		}
		prev = t.upTo
	}
	q.BilledQuantity = q.Quantity
	n := q.Quantity
	if last := ts[len(ts)-1]; last.upTo != 0 && n > last.upTo {
		return nil, notModeled(CodeBeyondTiers, "price "+p.ID+": quantity "+strconv.FormatInt(n, 10)+" is above the last tier's up_to "+strconv.FormatInt(last.upTo, 10))
	}

	charge := func(i int, from, units int64) *big.Rat {
		t := ts[i]
		exact := new(big.Rat).Mul(new(big.Rat).SetInt64(units), t.unit)
		exact.Add(exact, t.flat)
		q.Tiers = append(q.Tiers, TierCharge{Tier: i, From: from, UpTo: t.upTo, Units: units, UnitAmount: t.unit, FlatAmount: t.flat, Exact: exact})
		return exact
	}

	var components []*big.Rat
	if mode == stripe.PriceTiersModeVolume {
		// The whole quantity at the unit amount of the tier it falls in,
		// plus that tier's flat amount; quantity 0 falls in the first tier.
		prev = 0
		for i, t := range ts {
			if t.upTo == 0 || n <= t.upTo {
				components = append(components, charge(i, prev+1, n))
				break
			}
			prev = t.upTo
		}
	} else {
		// Each tier charges the units that fall in it, plus its flat amount
		// when any do; quantity 0 still charges the first tier's flat amount.
		prev = 0
		for i, t := range ts {
			if i > 0 && n <= prev {
				break
			}
			top := n
			if t.upTo != 0 && t.upTo < n {
				top = t.upTo
			}
			components = append(components, charge(i, prev+1, max(top-prev, 0)))
			if t.upTo == 0 || n <= t.upTo {
				break
			}
			prev = t.upTo
		}
	}
	if n == 0 && ts[0].flat.Sign() != 0 {
		q.Caveats = append(q.Caveats, Caveat{CaveatZeroQuantityFlatFee, "quantity is 0 and Stripe still bills the first tier's flat amount " + ts[0].flat.FloatString(maxDecimalPlaces)})
	}
	return components, nil
}

// settle sets Exact, Amount, MinAmount, MaxAmount and the rounding and
// currency caveats from the amount's components (one per charged tier, or
// the one line of a per-unit price).
func settle(q *Quote, components []*big.Rat) error {
	exact := new(big.Rat)
	lo, hi := new(big.Int), new(big.Int)
	for _, c := range components {
		exact.Add(exact, c)
		lo.Add(lo, floorInt(c))
		hi.Add(hi, ceilInt(c))
	}
	amount := roundHalfUp(exact)
	if !lo.IsInt64() || !hi.IsInt64() || !amount.IsInt64() {
		return notModeled(CodeOverflow, "price "+q.PriceID+": the amount "+exact.FloatString(0)+" does not fit in int64 minor units")
	}
	q.Exact, q.Amount, q.MinAmount, q.MaxAmount = exact, amount.Int64(), lo.Int64(), hi.Int64()
	if !exact.IsInt() {
		q.Caveats = append(q.Caveats, Caveat{CaveatFractional, "the exact amount " + exact.FloatString(maxDecimalPlaces) + " has a fraction of a minor unit; Amount rounds it half up once for the line, Stripe could bill anything from MinAmount to MaxAmount"})
		if isHalf(exact) {
			q.Caveats = append(q.Caveats, Caveat{CaveatRoundingTie, "the exact amount is exactly halfway; Stripe's documented example does not say which way a half goes"})
		}
	}
	switch {
	case threeDecimal[q.Currency] && q.Amount%10 != 0:
		q.Caveats = append(q.Caveats, Caveat{CaveatThreeDecimalLastDigit, "Stripe's payment APIs want " + strings.ToUpper(q.Currency) + " amounts to end in 0; how an invoice line of " + Format(q.Amount, q.Currency) + " is charged is not documented"})
	case wholeUnitTwoDecimal[q.Currency] && q.Amount%100 != 0:
		q.Caveats = append(q.Caveats, Caveat{CaveatWholeUnitCurrency, strings.ToUpper(q.Currency) + " is charged in whole units (multiples of 100 minor units); Stripe documents rounding such invoice totals to the nearest whole unit only for UGX"})
	}
	return nil
}
