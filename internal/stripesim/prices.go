package stripesim

import (
	"fmt"
	"maps"
	"math/big"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"
)

const (
	priceObjectName   = "price"
	productObjectName = "product"

	schemePerUnit  = "per_unit"
	schemeTiered   = "tiered"
	tiersGraduated = "graduated"
	tiersVolume    = "volume"
	usageMetered   = "metered"
	usageLicensed  = "licensed"
)

// product is a product as the simulator holds it: only what a price needs.
type product struct {
	id       string
	livemode bool
	created  time.Time
	name     string
}

// price is a price as the simulator holds it.
type price struct {
	id        string
	livemode  bool
	created   time.Time
	active    bool
	currency  string
	product   string
	nickname  string
	lookupKey string
	metadata  map[string]string

	billingScheme string   // schemePerUnit or schemeTiered
	unit          *big.Rat // per unit: the unit amount in minor units
	tiers         []tier   // tiered
	tiersMode     string   // tiersGraduated or tiersVolume
	transform     *transform
	recurring     *recurring // nil: a one-time price
	// options are the currency_options, by currency: unit or tiers as the
	// price has them, echoed back; the simulator bills in the price's
	// currency only.
	options map[string]priceAmounts
}

type priceAmounts struct {
	unit  *big.Rat
	tiers []tier
}

type transform struct {
	divideBy int64
	round    string // up or down
}

type recurring struct {
	interval  string // day, week, month or year
	count     int64
	usageType string // usageMetered or usageLicensed
	meter     string // the meter id of a metered price
}

// metered reports whether p is a recurring price billed by a meter.
func (p *price) metered() bool { return p.recurring != nil && p.recurring.usageType == usageMetered }

// priceJSON is the price object stripe-go's stripe.Price decodes. tiers and
// currency_options are includable fields: Stripe leaves them out unless the
// request expands them (the Price object's example has neither).
type priceJSON struct {
	ID                string                        `json:"id"`
	Object            string                        `json:"object"`
	Active            bool                          `json:"active"`
	BillingScheme     string                        `json:"billing_scheme"`
	Created           int64                         `json:"created"`
	Currency          string                        `json:"currency"`
	CurrencyOptions   map[string]currencyOptionJSON `json:"currency_options,omitempty"`
	CustomUnitAmount  *struct{}                     `json:"custom_unit_amount"`
	Livemode          bool                          `json:"livemode"`
	LookupKey         *string                       `json:"lookup_key"`
	Metadata          map[string]string             `json:"metadata"`
	Nickname          *string                       `json:"nickname"`
	Product           string                        `json:"product"`
	Recurring         *recurringJSON                `json:"recurring"`
	TaxBehavior       string                        `json:"tax_behavior"`
	Tiers             []tierJSON                    `json:"tiers,omitempty"`
	TiersMode         *string                       `json:"tiers_mode"`
	TransformQuantity *transformJSON                `json:"transform_quantity"`
	Type              string                        `json:"type"`
	UnitAmount        *int64                        `json:"unit_amount"`
	UnitAmountDecimal *string                       `json:"unit_amount_decimal"`
}

type currencyOptionJSON struct {
	CustomUnitAmount  *struct{}  `json:"custom_unit_amount"`
	TaxBehavior       string     `json:"tax_behavior"`
	Tiers             []tierJSON `json:"tiers,omitempty"`
	UnitAmount        *int64     `json:"unit_amount"`
	UnitAmountDecimal *string    `json:"unit_amount_decimal"`
}

type recurringJSON struct {
	Interval        string  `json:"interval"`
	IntervalCount   int64   `json:"interval_count"`
	Meter           *string `json:"meter"`
	TrialPeriodDays *int64  `json:"trial_period_days"`
	UsageType       string  `json:"usage_type"`
}

type tierJSON struct {
	FlatAmount        *int64  `json:"flat_amount"`
	FlatAmountDecimal *string `json:"flat_amount_decimal"`
	UnitAmount        *int64  `json:"unit_amount"`
	UnitAmountDecimal *string `json:"unit_amount_decimal"`
	UpTo              *int64  `json:"up_to"` // null: inf
}

type transformJSON struct {
	DivideBy int64  `json:"divide_by"`
	Round    string `json:"round"`
}

// amountFields renders a decimal amount as its integer field (null unless
// whole) and its decimal field.
func amountFields(r *big.Rat) (*int64, *string) {
	if r == nil {
		return nil, nil
	}
	d := decimalString(r)
	if n, ok := wholeOf(r); ok {
		return &n, &d
	}
	return nil, &d
}

func tiersJSON(tiers []tier) []tierJSON {
	out := make([]tierJSON, len(tiers))
	for i, t := range tiers {
		out[i].UnitAmount, out[i].UnitAmountDecimal = amountFields(t.unit)
		out[i].FlatAmount, out[i].FlatAmountDecimal = amountFields(t.flat)
		if t.upTo != 0 {
			n := t.upTo
			out[i].UpTo = &n
		}
	}
	return out
}

// priceView says which includable fields a rendering expands.
type priceView struct{ tiers, currencyOptions bool }

// viewOf reads the includable fields a request expands.
func viewOf(form url.Values) priceView {
	return priceView{tiers: expands(form, "tiers"), currencyOptions: expands(form, "currency_options")}
}

func (p *price) json(v priceView) priceJSON {
	out := priceJSON{
		ID: p.id, Object: "price", Active: p.active, BillingScheme: p.billingScheme, Created: p.created.Unix(),
		Currency: p.currency, Livemode: p.livemode, LookupKey: optional(p.lookupKey),
		Metadata: maps.Clone(p.metadata), Nickname: optional(p.nickname), Product: p.product,
		TaxBehavior: "unspecified", Type: "one_time",
	}
	if out.Metadata == nil {
		out.Metadata = map[string]string{}
	}
	out.UnitAmount, out.UnitAmountDecimal = amountFields(p.unit)
	if p.billingScheme == schemeTiered {
		out.TiersMode = optional(p.tiersMode)
		if v.tiers {
			out.Tiers = tiersJSON(p.tiers)
		}
	}
	if p.transform != nil {
		out.TransformQuantity = &transformJSON{DivideBy: p.transform.divideBy, Round: p.transform.round}
	}
	if r := p.recurring; r != nil {
		out.Type = "recurring"
		out.Recurring = &recurringJSON{Interval: r.interval, IntervalCount: r.count, Meter: optional(r.meter), UsageType: r.usageType}
	}
	if v.currencyOptions {
		out.CurrencyOptions = map[string]currencyOptionJSON{}
		own := priceAmounts{unit: p.unit, tiers: p.tiers}
		for ccy, a := range mergeOptions(p.currency, own, p.options) {
			o := currencyOptionJSON{TaxBehavior: "unspecified"}
			o.UnitAmount, o.UnitAmountDecimal = amountFields(a.unit)
			if v.tiers && a.tiers != nil {
				o.Tiers = tiersJSON(a.tiers)
			}
			out.CurrencyOptions[ccy] = o
		}
	}
	return out
}

// mergeOptions is the currency options with the price's own currency, as
// Stripe lists it among them.
func mergeOptions(currency string, own priceAmounts, options map[string]priceAmounts) map[string]priceAmounts {
	out := maps.Clone(options)
	if out == nil {
		out = map[string]priceAmounts{}
	}
	out[currency] = own
	return out
}

// The keys POST /v1/prices takes.
var priceKeys = []*regexp.Regexp{
	exact("currency"), exact("product"), exact("product_data[name]"), exact("product_data[id]"),
	regexp.MustCompile(`^product_data\[metadata\]\[[^\]]+\]$`),
	exact("unit_amount"), exact("unit_amount_decimal"), exact("billing_scheme"), exact("tiers_mode"),
	regexp.MustCompile(`^tiers\[[0-9]+\]\[(up_to|unit_amount|unit_amount_decimal|flat_amount|flat_amount_decimal)\]$`),
	exact("transform_quantity[divide_by]"), exact("transform_quantity[round]"),
	exact("recurring[interval]"), exact("recurring[interval_count]"), exact("recurring[usage_type]"), exact("recurring[meter]"),
	regexp.MustCompile(`^currency_options\[[a-z]{3}\]\[(unit_amount|unit_amount_decimal|tax_behavior)\]$`),
	regexp.MustCompile(`^currency_options\[[a-z]{3}\]\[tiers\]\[[0-9]+\]\[(up_to|unit_amount|unit_amount_decimal|flat_amount|flat_amount_decimal)\]$`),
	metadataKey, exact("nickname"), exact("lookup_key"), exact("active"), exact("tax_behavior"),
}

var currencyRE = regexp.MustCompile(`^[a-z]{3}$`)

// maxIntervals is the longest interval_count of each interval: "Maximum of
// three years interval allowed (3 years, 36 months, or 156 weeks)"
// (stripe-go PriceCreateRecurringParams.IntervalCount); days are read as
// three years of days.
var maxIntervals = map[string]int64{"day": 1095, "week": 156, "month": 36, "year": 3}

// priceInput is a validated POST /v1/prices whose references (product,
// meter) are still to be checked against the account.
type priceInput struct {
	p           *price
	productName string // product_data[name]: a new product
	productID   string // product_data[id]: its id, if chosen
}

// parsePrice reads and validates the shape of a POST /v1/prices form, as
// Stripe answers it: every problem here is a validation error, nothing
// kept for the Idempotency-Key.
func parsePrice(f url.Values, livemode bool) (priceInput, *apiError) {
	if e := checkParamPatterns(f, priceKeys...); e != nil {
		return priceInput{}, e
	}
	p := &price{livemode: livemode, active: true, currency: f.Get("currency"), product: f.Get("product"),
		nickname: f.Get("nickname"), lookupKey: f.Get("lookup_key"), metadata: nestedMap(f, "metadata"),
		billingScheme: f.Get("billing_scheme"), tiersMode: f.Get("tiers_mode")}
	in := priceInput{p: p, productName: f.Get("product_data[name]"), productID: f.Get("product_data[id]")}
	var e *apiError
	if p.active, e = boolParam(f, "active", true); e != nil {
		return in, e
	}
	switch {
	case p.currency == "":
		return in, errMissingParam("currency")
	case !currencyRE.MatchString(p.currency):
		return in, errValidation("", "currency", "Invalid currency: %s.", p.currency)
	case p.product == "" && !f.Has("product_data[name]"):
		return in, errMissingParam("product")
	case p.product != "" && f.Has("product_data[name]"):
		return in, errValidation("parameters_exclusive", "product_data",
			"You may only specify one of these parameters: product, product_data.")
	case f.Has("product_data[name]") && in.productName == "":
		return in, errMissingParam("product_data[name]")
	}
	if p.billingScheme == "" {
		p.billingScheme = schemePerUnit
	}
	if p.billingScheme != schemePerUnit && p.billingScheme != schemeTiered {
		return in, errValidation("", "billing_scheme", "Invalid billing_scheme: must be one of per_unit or tiered")
	}
	own, e := parseAmounts(f, "", p.billingScheme)
	if e != nil {
		return in, e
	}
	p.unit, p.tiers = own.unit, own.tiers
	if p.billingScheme == schemeTiered {
		switch p.tiersMode {
		case "":
			return in, errMissingParam("tiers_mode")
		case tiersGraduated, tiersVolume:
		default:
			return in, errValidation("", "tiers_mode", "Invalid tiers_mode: must be one of graduated or volume")
		}
	} else if p.tiersMode != "" {
		return in, errValidation("", "tiers_mode", "tiers_mode requires billing_scheme to be set to tiered.")
	}
	if p.transform, e = parseTransform(f, p.billingScheme); e != nil {
		return in, e
	}
	if p.recurring, e = parseRecurring(f); e != nil {
		return in, e
	}
	if p.options, e = parseCurrencyOptions(f, p.currency, p.billingScheme); e != nil {
		return in, e
	}
	return in, nil
}

// parseAmounts reads the unit amount or the tiers under prefix ("" for the
// price, "currency_options[eur]" for an option) as the billing scheme
// wants them.
func parseAmounts(f url.Values, prefix, scheme string) (priceAmounts, *apiError) {
	key := func(name string) string {
		if prefix == "" {
			return name
		}
		return prefix + "[" + name + "]"
	}
	var out priceAmounts
	unit, unitDec := f.Has(key("unit_amount")), f.Has(key("unit_amount_decimal"))
	tiersEntries, e := indexedParams(f, key("tiers"))
	if e != nil {
		return out, e
	}
	if scheme == schemeTiered {
		switch {
		case unit || unitDec:
			param := key("unit_amount")
			if !unit {
				param = key("unit_amount_decimal")
			}
			return out, errValidation("", param, "%s cannot be set when billing_scheme is tiered: set the amounts in tiers.", param)
		case len(tiersEntries) == 0:
			return out, errMissingParam(key("tiers"))
		}
		out.tiers, e = parseTiers(tiersEntries, key("tiers"))
		return out, e
	}
	switch {
	case len(tiersEntries) > 0:
		return out, errValidation("", key("tiers"), "tiers requires billing_scheme to be set to tiered.")
	case unit && unitDec:
		return out, errValidation("parameters_exclusive", key("unit_amount_decimal"),
			"You may only specify one of these parameters: unit_amount, unit_amount_decimal.")
	case unit:
		n, e := intParam(f, key("unit_amount"))
		if e != nil {
			return out, e
		}
		if n < 0 {
			return out, errValidation("", key("unit_amount"), "Invalid %s: must be greater than or equal to 0", key("unit_amount"))
		}
		out.unit = new(big.Rat).SetInt64(n)
	case unitDec:
		out.unit, e = parseDecimal(key("unit_amount_decimal"), f.Get(key("unit_amount_decimal")))
		if e != nil {
			return out, e
		}
	default:
		return out, errMissingParam(key("unit_amount"))
	}
	return out, nil
}

// parseTiers reads the tiers of a tiered price: ascending upper bounds, the
// last one inf, each with an amount.
func parseTiers(entries []indexedEntry, param string) ([]tier, *apiError) {
	out := make([]tier, 0, len(entries))
	for i, en := range entries {
		if en.index != i {
			return nil, errValidation("", fmt.Sprintf("%s[%d]", param, i), "Invalid array: %s must be indexed from 0 without gaps.", param)
		}
		name := func(field string) string { return fmt.Sprintf("%s[%d][%s]", param, i, field) }
		var t tier
		switch v := en.fields.Get("up_to"); {
		case !en.fields.Has("up_to") || v == "":
			return nil, errMissingParam(name("up_to"))
		case v == "inf":
		default:
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 1 {
				return nil, errValidation("", name("up_to"), "Invalid up_to: must be a positive integer or inf")
			}
			t.upTo = n
		}
		for _, pair := range []struct {
			to          **big.Rat
			whole, frac string
		}{{&t.unit, "unit_amount", "unit_amount_decimal"}, {&t.flat, "flat_amount", "flat_amount_decimal"}} {
			hasWhole, hasFrac := en.fields.Has(pair.whole), en.fields.Has(pair.frac)
			switch {
			case hasWhole && hasFrac:
				return nil, errValidation("parameters_exclusive", name(pair.frac),
					"You may only specify one of these parameters: %s, %s.", pair.whole, pair.frac)
			case hasWhole:
				n, err := strconv.ParseInt(en.fields.Get(pair.whole), 10, 64)
				if err != nil || n < 0 {
					return nil, errValidation("parameter_invalid_integer", name(pair.whole), "Invalid non-negative integer: %s", en.fields.Get(pair.whole))
				}
				*pair.to = new(big.Rat).SetInt64(n)
			case hasFrac:
				r, e := parseDecimal(name(pair.frac), en.fields.Get(pair.frac))
				if e != nil {
					return nil, e
				}
				*pair.to = r
			}
		}
		if t.unit == nil && t.flat == nil {
			// Stripe's answer to a tier without an amount, as its users
			// report it.
			return nil, errValidation("", name("unit_amount"), "An entry in the tiers array is missing an amount.")
		}
		if i > 0 {
			prev := out[i-1].upTo
			if prev == 0 || t.upTo != 0 && t.upTo <= prev {
				return nil, errValidation("", name("up_to"), "Invalid tiers: up_to must increase from one tier to the next, and only the last tier may be inf.")
			}
		}
		out = append(out, t)
	}
	if out[len(out)-1].upTo != 0 {
		return nil, errValidation("", fmt.Sprintf("%s[%d][up_to]", param, len(out)-1), "Invalid tiers: the last tier's up_to must be inf.")
	}
	return out, nil
}

// parseTransform reads transform_quantity, which "Cannot be combined with
// tiers" (stripe-go PriceCreateParams.TransformQuantity).
func parseTransform(f url.Values, scheme string) (*transform, *apiError) {
	div, round := f.Has("transform_quantity[divide_by]"), f.Has("transform_quantity[round]")
	if !div && !round {
		return nil, nil
	}
	if scheme == schemeTiered {
		return nil, errValidation("", "transform_quantity", "transform_quantity cannot be combined with tiers.")
	}
	if !div {
		return nil, errMissingParam("transform_quantity[divide_by]")
	}
	n, e := intParam(f, "transform_quantity[divide_by]")
	if e != nil {
		return nil, e
	}
	if n < 1 {
		return nil, errValidation("", "transform_quantity[divide_by]", "Invalid transform_quantity[divide_by]: must be a positive integer")
	}
	t := &transform{divideBy: n, round: f.Get("transform_quantity[round]")}
	switch t.round {
	case "":
		return nil, errMissingParam("transform_quantity[round]")
	case "up", "down":
	default:
		return nil, errValidation("", "transform_quantity[round]", "Invalid transform_quantity[round]: must be one of up or down")
	}
	return t, nil
}

// parseRecurring reads recurring. Since API version 2025-03-31.basil a
// metered price needs a meter: "You can no longer create a price with a
// usage_type of metered without a specified meter" (Stripe changelog,
// "Removes legacy usage-based billing").
func parseRecurring(f url.Values) (*recurring, *apiError) {
	r := nestedMap(f, "recurring")
	if len(r) == 0 {
		return nil, nil
	}
	out := &recurring{interval: r["interval"], count: 1, usageType: r["usage_type"], meter: r["meter"]}
	if out.interval == "" {
		return nil, errMissingParam("recurring[interval]")
	}
	limit, ok := maxIntervals[out.interval]
	if !ok {
		return nil, errValidation("", "recurring[interval]", "Invalid recurring[interval]: must be one of day, week, month, or year")
	}
	if n, has, e := optionalInt(f, "recurring[interval_count]"); e != nil {
		return nil, e
	} else if has {
		if n < 1 || n > limit {
			return nil, errValidation("", "recurring[interval_count]",
				"Invalid recurring[interval_count]: the maximum interval is three years (3 years, 36 months, or 156 weeks).")
		}
		out.count = n
	}
	switch out.usageType {
	case "":
		out.usageType = usageLicensed
	case usageLicensed, usageMetered:
	default:
		return nil, errValidation("", "recurring[usage_type]", "Invalid recurring[usage_type]: must be one of licensed or metered")
	}
	switch {
	case out.usageType == usageMetered && out.meter == "":
		return nil, errValidation("parameter_missing", "recurring[meter]",
			"A metered price must have a meter: set recurring[meter] when recurring[usage_type] is metered.")
	case out.usageType == usageLicensed && out.meter != "":
		return nil, errValidation("", "recurring[meter]", "recurring[meter] can only be set when recurring[usage_type] is metered.")
	}
	return out, nil
}

// parseCurrencyOptions reads currency_options[<currency>][…]: amounts of
// the price's scheme in other currencies.
func parseCurrencyOptions(f url.Values, currency, scheme string) (map[string]priceAmounts, *apiError) {
	ccys := map[string]bool{}
	re := regexp.MustCompile(`^currency_options\[([a-z]{3})\]`)
	for k := range f {
		if m := re.FindStringSubmatch(k); m != nil {
			ccys[m[1]] = true
		}
	}
	if len(ccys) == 0 {
		return nil, nil
	}
	out := map[string]priceAmounts{}
	for _, ccy := range slices.Sorted(maps.Keys(ccys)) {
		if ccy == currency {
			continue // the price's own amounts win, as its currency's option
		}
		a, e := parseAmounts(f, "currency_options["+ccy+"]", scheme)
		if e != nil {
			return nil, e
		}
		out[ccy] = a
	}
	return out, nil
}

// addPriceLocked checks in's references against account a — its product
// and, for a metered price, an active meter of the account and mode — and
// adds the price (and a new product for product_data). s.mu must be held.
func (s *Server) addPriceLocked(a *account, in priceInput) (*price, *apiError) {
	p := in.p
	if p.product != "" {
		if a.products[modeID{p.livemode, p.product}] == nil {
			return nil, errNoSuch(http.StatusBadRequest, productObjectName, "product", p.product)
		}
	}
	if p.metered() {
		m := a.findMeterLocked(p.livemode, p.recurring.meter)
		switch {
		case m == nil:
			return nil, errNoSuch(http.StatusBadRequest, meterObjectName, "recurring[meter]", p.recurring.meter)
		case m.Status != MeterActive:
			return nil, errInvalid(http.StatusBadRequest, "", "recurring[meter]",
				"The meter '%s' is inactive: a metered price needs an active meter.", m.ID)
		}
	}
	if in.productID != "" && a.products[modeID{p.livemode, in.productID}] != nil {
		return nil, errInvalid(http.StatusBadRequest, "resource_already_exists", "product_data[id]",
			"Product already exists.")
	}
	now := s.now()
	if p.product == "" {
		id := in.productID
		if id == "" {
			id = randomID("prod_", 14)
		}
		prod := &product{id: id, livemode: p.livemode, created: now, name: in.productName}
		a.products[modeID{p.livemode, prod.id}] = prod
		p.product = prod.id
	}
	p.id, p.created = randomID("price_", 24), now
	a.prices = append(a.prices, p)
	return p, nil
}

// findPriceLocked returns the price id of a's mode livemode, or nil.
func (a *account) findPriceLocked(livemode bool, id string) *price {
	for _, p := range a.prices {
		if p.id == id && p.livemode == livemode {
			return p
		}
	}
	return nil
}

// createPrice is POST /v1/prices.
func (s *Server) createPrice(w http.ResponseWriter, r *http.Request) {
	c := callerOf(r)
	in, e := parsePrice(r.Form, c.livemode)
	if e != nil {
		writeError(w, e)
		return
	}
	s.mu.Lock()
	p, e := s.addPriceLocked(s.accountLocked(c.account), in)
	var out priceJSON
	if p != nil {
		out = p.json(viewOf(r.Form))
	}
	s.mu.Unlock()
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// getPrice is GET /v1/prices/{id}.
func (s *Server) getPrice(w http.ResponseWriter, r *http.Request) {
	if e := checkParams(r.Form); e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	p := s.accountLocked(c.account).findPriceLocked(c.livemode, id)
	var out priceJSON
	if p != nil {
		out = p.json(viewOf(r.Form))
	}
	s.mu.Unlock()
	if p == nil {
		writeError(w, errNoSuch(http.StatusNotFound, priceObjectName, "id", id))
		return
	}
	writeJSON(w, http.StatusOK, out)
}

var priceListKeys = append([]*regexp.Regexp{exact("active"), exact("currency"), exact("product"), exact("type"),
	exact("recurring[interval]"), exact("recurring[usage_type]"), exact("recurring[meter]")},
	append(slices.Clone(listKeys), createdKeys...)...)

// listPrices is GET /v1/prices: newest first, filtered by active,
// currency, product, type, recurring[interval|usage_type|meter] and
// created.
func (s *Server) listPrices(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	if e := checkParamPatterns(f, priceListKeys...); e != nil {
		writeError(w, e)
		return
	}
	lp, e := parseListParams(f)
	if e != nil {
		writeError(w, e)
		return
	}
	created, e := parseCreatedFilter(f, "created")
	if e != nil {
		writeError(w, e)
		return
	}
	active, e := boolParam(f, "active", false)
	if e != nil {
		writeError(w, e)
		return
	}
	typ := f.Get("type")
	if typ != "" && typ != "one_time" && typ != "recurring" {
		writeError(w, errValidation("", "type", "Invalid type: must be one of one_time or recurring"))
		return
	}
	keep := func(p *price) bool {
		rec := p.recurring
		switch {
		case f.Has("active") && p.active != active,
			f.Has("currency") && p.currency != f.Get("currency"),
			f.Has("product") && p.product != f.Get("product"),
			typ == "one_time" && rec != nil, typ == "recurring" && rec == nil,
			f.Has("recurring[interval]") && (rec == nil || rec.interval != f.Get("recurring[interval]")),
			f.Has("recurring[usage_type]") && (rec == nil || rec.usageType != f.Get("recurring[usage_type]")),
			f.Has("recurring[meter]") && (rec == nil || rec.meter != f.Get("recurring[meter]")),
			!created.keeps(p.created):
			return false
		}
		return true
	}
	c, view := callerOf(r), viewOf(f)
	s.mu.Lock()
	var all []*price
	if a := s.accounts[c.account]; a != nil {
		for i := len(a.prices) - 1; i >= 0; i-- {
			if a.prices[i].livemode == c.livemode {
				all = append(all, a.prices[i])
			}
		}
	}
	page, more, e := paginate(all, func(p *price) string { return p.id }, keep, lp, priceObjectName)
	out := make([]priceJSON, len(page))
	for i, p := range page {
		out[i] = p.json(view)
	}
	s.mu.Unlock()
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, listEnvelope{Object: "list", Data: out, HasMore: more, URL: "/v1/prices"})
}

// PriceSpec describes a metered price to create with [Server.CreatePrice].
type PriceSpec struct {
	Livemode bool
	Currency string // default usd
	// Product is an existing product id; empty creates a product named
	// ProductName (default "Metered usage").
	Product     string
	ProductName string
	Meter       string // required: the id of an active meter of the account
	// Interval (day, week, month or year; default month) and
	// IntervalCount (default 1) are the billing period.
	Interval      string
	IntervalCount int64
	// UnitAmountDecimal is the per-unit amount in minor units ("25",
	// "0.05"); leave it empty for a tiered price.
	UnitAmountDecimal string
	// Tiers and TiersMode (graduated or volume) make a tiered price.
	Tiers     []TierSpec
	TiersMode string
	// DivideBy and Round (up or down) are the transform_quantity.
	DivideBy int64
	Round    string
}

// TierSpec is one tier of a [PriceSpec]. UpTo 0 is inf; an empty amount
// is not set.
type TierSpec struct {
	UpTo              int64
	UnitAmountDecimal string
	FlatAmountDecimal string
}

// form is spec as the POST /v1/prices parameters Stripe would take.
func (spec PriceSpec) form() url.Values {
	f := url.Values{}
	set := func(k, v string) {
		if v != "" {
			f.Set(k, v)
		}
	}
	currency, interval, name := spec.Currency, spec.Interval, spec.ProductName
	if currency == "" {
		currency = "usd"
	}
	if interval == "" {
		interval = "month"
	}
	if name == "" && spec.Product == "" {
		name = "Metered usage"
	}
	set("currency", currency)
	set("product", spec.Product)
	set("product_data[name]", name)
	set("recurring[interval]", interval)
	if spec.IntervalCount != 0 {
		f.Set("recurring[interval_count]", strconv.FormatInt(spec.IntervalCount, 10))
	}
	set("recurring[usage_type]", usageMetered)
	set("recurring[meter]", spec.Meter)
	set("unit_amount_decimal", spec.UnitAmountDecimal)
	if len(spec.Tiers) > 0 {
		f.Set("billing_scheme", schemeTiered)
		set("tiers_mode", spec.TiersMode)
	}
	for i, t := range spec.Tiers {
		upTo := "inf"
		if t.UpTo != 0 {
			upTo = strconv.FormatInt(t.UpTo, 10)
		}
		f.Set(fmt.Sprintf("tiers[%d][up_to]", i), upTo)
		set(fmt.Sprintf("tiers[%d][unit_amount_decimal]", i), t.UnitAmountDecimal)
		set(fmt.Sprintf("tiers[%d][flat_amount_decimal]", i), t.FlatAmountDecimal)
	}
	if spec.DivideBy != 0 {
		f.Set("transform_quantity[divide_by]", strconv.FormatInt(spec.DivideBy, 10))
	}
	set("transform_quantity[round]", spec.Round)
	return f
}

// CreatePrice adds a metered price to account (added if unknown) without
// HTTP, for test setup, validated as POST /v1/prices would. It returns the
// price id and panics when the API would refuse the price.
func (s *Server) CreatePrice(account string, spec PriceSpec) string {
	in, e := parsePrice(spec.form(), spec.Livemode)
	if e == nil {
		s.mu.Lock()
		defer s.mu.Unlock()
		var p *price
		if p, e = s.addPriceLocked(s.accountLocked(account), in); e == nil {
			return p.id
		}
	}
	panic("stripesim: CreatePrice: " + e.Message)
}
