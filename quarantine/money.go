package quarantine

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math/big"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/redact"
	"github.com/tallymeter/tally/pricing"
)

// Amount is the money of the report's lines in one currency.
type Amount struct {
	Currency string `json:"currency"`
	// Amount is what the usage should bill, in the currency's minor units.
	Amount int64 `json:"amount"`
	// AtRisk is the part of Amount whose usage Stripe has not accepted.
	AtRisk int64 `json:"at_risk"`
	// Lines is how many lines add up to it.
	Lines int `json:"lines"`
}

// CustomerAmount is one customer's money in one currency.
type CustomerAmount struct {
	Customer string `json:"customer"`
	Amount
}

// sqlItemPrices reads, for the report's tenants and features, the
// subscription items of each tenant's customer that bill the feature's
// meter: reference tables only, a row per customer, item and feature.
const sqlItemPrices = `
SELECT DISTINCT tm.tenant, fm.feature, si.account, si.customer, si.price, si.currency,
       si.start_date, coalesce(si.ended_at, si.gone_at)
FROM tenant_mappings tm
JOIN stripe_subscription_items si ON si.customer = tm.stripe_customer_id
JOIN stripe_meters m ON m.account = si.account AND m.id = si.meter
JOIN feature_mappings fm ON fm.event_name = m.event_name
WHERE tm.tenant = ANY(@tenants) AND fm.feature = ANY(@features)`

// sqlCheckPrices reads the prices the month's compared invoices billed,
// per tenant and feature they cover, the latest comparison first: an index
// range of the month's checks.
const sqlCheckPrices = `
SELECT t.tenant, f.feature, c.period_start, c.account, c.customer, c.prices, c.currency
FROM invoice_checks c, unnest(c.tenants) AS t (tenant), unnest(c.features) AS f (feature)
WHERE c.period_start >= @from AND c.period_start < @to
ORDER BY c.compared_at DESC`

// sqlKeptPrices reads the kept prices by account and id.
const sqlKeptPrices = `
SELECT account, price, body FROM stripe_prices
WHERE (account, price) IN (SELECT * FROM unnest(@accounts::text[], @prices::text[]))`

// priceOf is the price that bills a line's usage.
type priceOf struct {
	account, customer, price, currency string
}

// linePrice is where a line's price comes from: the price, or why none.
type linePrice struct {
	p         priceOf
	formula   string
	note      string
	candidate []priceOf
}

// addMoney prices c's lines (Line.Amount, AtRisk, AmountNote) and sums
// them (Completeness.Amounts, Customers). A line's price is the one its
// period's finalized invoice billed (its invoice check), else the price of
// its customer's subscription item that bills the feature's meter. Lines
// billed by one price on one customer's invoice are priced together, as
// Stripe prices their meter's total, and the amount is shared among them
// by usage. Its cost grows with the report's lines and the customers'
// subscription items, never with usage.
func (c *Completeness) addMoney(ctx context.Context, q pgdb.Querier) error {
	if len(c.Lines) == 0 {
		c.sumAmounts()
		return nil
	}
	from, to, err := ParsePeriod(c.Period)
	if err != nil {
		return err
	}
	var tenants, features []string
	seenTenant, seenFeature := map[string]bool{}, map[string]bool{}
	for _, l := range c.Lines {
		if !seenTenant[l.Tenant] {
			seenTenant[l.Tenant] = true
			tenants = append(tenants, l.Tenant)
		}
		if !seenFeature[l.Feature] {
			seenFeature[l.Feature] = true
			features = append(features, l.Feature)
		}
	}
	prices := make([]linePrice, len(c.Lines))
	if err := formulas(ctx, q, c.Lines, prices, features); err != nil {
		return fmt.Errorf("quarantine: reading the features' formulas: %w", err)
	}
	if err := itemPrices(ctx, q, c.Lines, prices, tenants, features); err != nil {
		return fmt.Errorf("quarantine: reading the subscription items' prices: %w", err)
	}
	if err := checkPrices(ctx, q, c.Lines, prices, from, to); err != nil {
		return fmt.Errorf("quarantine: reading the invoices' prices: %w", err)
	}
	bodies, err := keptPrices(ctx, q, prices)
	if err != nil {
		return fmt.Errorf("quarantine: reading the kept prices: %w", err)
	}
	groups := map[[2]string][]int{}
	var order [][2]string
	for i := range c.Lines {
		l, lp := &c.Lines[i], &prices[i]
		l.Amount, l.AmountAtRisk, l.Price, l.Currency, l.Customer, l.AmountNote = nil, nil, "", "", "", ""
		switch {
		case lp.formula == "":
			l.AmountNote = "the feature has no mapping"
			continue
		case lp.formula != "sum" && lp.formula != "count":
			l.AmountNote = "the meter's formula is " + lp.formula + ": Stripe bills the period's last value, which Tally does not price per line"
			continue
		}
		if lp.note == "" {
			lp.decide()
		}
		if lp.note != "" {
			l.AmountNote = lp.note
			continue
		}
		l.Price, l.Currency, l.Customer = lp.p.price, lp.p.currency, lp.p.customer
		if bodies[[2]string{lp.p.account, lp.p.price}] == nil {
			l.AmountNote = "price " + lp.p.price + " has not been read from Stripe yet"
			continue
		}
		key := [2]string{lp.p.account + " " + lp.p.customer + " " + lp.p.price + " " + lp.p.currency, l.Period}
		if _, ok := groups[key]; !ok {
			order = append(order, key)
		}
		groups[key] = append(groups[key], i)
	}
	for _, key := range order {
		idx := groups[key]
		lp := prices[idx[0]]
		priceGroup(c.Lines, idx, bodies[[2]string{lp.p.account, lp.p.price}], lp.p.currency, lp.formula)
	}
	c.sumAmounts()
	return nil
}

// decide picks the line's price from its candidates, or says why none.
func (lp *linePrice) decide() {
	var distinct []priceOf
	for _, p := range lp.candidate {
		if !slices.Contains(distinct, p) {
			distinct = append(distinct, p)
		}
	}
	switch len(distinct) {
	case 0:
		lp.note = "no subscription item of the customer bills the feature's meter"
	case 1:
		lp.p = distinct[0]
	default:
		lp.note = "the feature's meter is billed by more than one price"
	}
}

// itemPrices sets each line's candidate prices from its customer's
// subscription items whose subscription had started by the line's period
// and had not ended, nor left the subscription, before it.
func itemPrices(ctx context.Context, q pgdb.Querier, lines []Line, prices []linePrice, tenants, features []string) error {
	rows, err := q.Query(ctx, sqlItemPrices, pgx.NamedArgs{"tenants": tenants, "features": features})
	if err != nil {
		return err
	}
	type item struct {
		p     priceOf
		start time.Time
		ended *time.Time
	}
	items := map[[2]string][]item{}
	var (
		it   item
		line [2]string
	)
	if _, err := pgx.ForEachRow(rows, []any{&line[0], &line[1], &it.p.account, &it.p.customer,
		&it.p.price, &it.p.currency, &it.start, &it.ended}, func() error {
		items[line] = append(items[line], it)
		return nil
	}); err != nil {
		return err
	}
	for i, l := range lines {
		per, err := time.Parse(time.RFC3339, l.Period)
		if err != nil {
			return err
		}
		for _, it := range items[[2]string{l.Tenant, l.Feature}] {
			if it.start.After(per) || (it.ended != nil && !it.ended.After(per)) {
				continue
			}
			prices[i].candidate = append(prices[i].candidate, it.p)
		}
	}
	return nil
}

// formulas sets each line's meter formula from its feature's mapping.
func formulas(ctx context.Context, q pgdb.Querier, lines []Line, prices []linePrice, features []string) error {
	rows, err := q.Query(ctx, `SELECT feature, aggregation FROM feature_mappings WHERE feature = ANY($1)`, features)
	if err != nil {
		return err
	}
	of := map[string]string{}
	var feature, formula string
	if _, err := pgx.ForEachRow(rows, []any{&feature, &formula}, func() error {
		of[feature] = formula
		return nil
	}); err != nil {
		return err
	}
	for i, l := range lines {
		prices[i].formula = of[l.Feature]
	}
	return nil
}

// checkPrices sets the price of each line whose period's invoice was
// compared: the one price that invoice billed the meter with, or why none.
func checkPrices(ctx context.Context, q pgdb.Querier, lines []Line, prices []linePrice, from, to time.Time) error {
	rows, err := q.Query(ctx, sqlCheckPrices, pgx.NamedArgs{"from": from, "to": to})
	if err != nil {
		return err
	}
	index := map[[3]string]int{}
	for i, l := range lines {
		index[[3]string{l.Tenant, l.Feature, l.Period}] = i
	}
	seen := map[[3]string]bool{}
	var (
		tenant, feature, account, customer, currency string
		per                                          time.Time
		ids                                          []string
	)
	_, err = pgx.ForEachRow(rows, []any{&tenant, &feature, &per, &account, &customer, &ids, &currency}, func() error {
		key := [3]string{tenant, feature, per.UTC().Format(time.RFC3339)}
		i, ok := index[key]
		if !ok || seen[key] || len(ids) == 0 {
			return nil
		}
		seen[key] = true
		lp := &prices[i]
		lp.candidate = nil
		switch {
		case len(ids) > 1:
			lp.note = "the invoice billed the feature's meter with more than one price"
		case currency == "":
			lp.note = "the invoice has no currency"
		default:
			lp.note = ""
			lp.candidate = []priceOf{{account: account, customer: customer, price: ids[0], currency: currency}}
		}
		return nil
	})
	return err
}

// keptPrices reads the kept prices the lines name, decoded.
func keptPrices(ctx context.Context, q pgdb.Querier, prices []linePrice) (map[[2]string]*stripe.Price, error) {
	var keys [][2]string
	for _, lp := range prices {
		for _, p := range lp.candidate {
			keys = append(keys, [2]string{p.account, p.price})
		}
	}
	return KeptPrices(ctx, q, keys)
}

// KeptPrices reads the prices Tally keeps from Stripe (stripe_prices), by
// account and id, decoded; a price not kept is not in the map.
func KeptPrices(ctx context.Context, q pgdb.Querier, keys [][2]string) (map[[2]string]*stripe.Price, error) {
	var accounts, ids []string
	named := map[[2]string]bool{}
	for _, k := range keys {
		if !named[k] {
			named[k] = true
			accounts, ids = append(accounts, k[0]), append(ids, k[1])
		}
	}
	out := map[[2]string]*stripe.Price{}
	if len(ids) == 0 {
		return out, nil
	}
	rows, err := q.Query(ctx, sqlKeptPrices, pgx.NamedArgs{"accounts": accounts, "prices": ids})
	if err != nil {
		return nil, err
	}
	var (
		account, id string
		body        []byte
	)
	_, err = pgx.ForEachRow(rows, []any{&account, &id, &body}, func() error {
		p := &stripe.Price{}
		if err := json.Unmarshal(body, p); err != nil {
			return fmt.Errorf("decoding price %s: %w", id, err)
		}
		out[[2]string{account, id}] = p
		return nil
	})
	return out, err
}

// usageOf is a line's billable usage and the part of it Stripe has not
// accepted, by the meter's formula: value for sum, events for count.
func usageOf(l Line, formula string) (usage, risky *big.Int) {
	if formula == "count" {
		usage = big.NewInt(l.Ingested.Events - l.Cancelled.Events)
		risky = big.NewInt(l.Pending.Events + l.Quarantined.Events + l.Uncertain.Events + l.Rejected.Events)
	} else {
		usage = new(big.Int).Sub(l.Ingested.Value.Big(), l.Cancelled.Value.Big())
		risky = l.Pending.Value.Plus(l.Quarantined.Value).Plus(l.Uncertain.Value).Plus(l.Rejected.Value).Big()
	}
	if usage.Sign() < 0 {
		usage.SetInt64(0)
	}
	if risky.Sign() < 0 {
		risky.SetInt64(0)
	}
	if risky.Cmp(usage) > 0 {
		risky.Set(usage)
	}
	return usage, risky
}

// priceGroup prices the lines idx, billed together by price p: the
// group's amount is p on their total usage, and its amount at risk what
// the total would lose without their risky usage; each is shared among
// the lines in proportion to their usage (their risky usage), the cents
// left by the division going to the largest remainders.
func priceGroup(lines []Line, idx []int, p *stripe.Price, currency, formula string) {
	usages, risks := make([]*big.Int, len(idx)), make([]*big.Int, len(idx))
	total, risky := new(big.Int), new(big.Int)
	for k, i := range idx {
		usages[k], risks[k] = usageOf(lines[i], formula)
		total.Add(total, usages[k])
		risky.Add(risky, risks[k])
	}
	note := func(s string) {
		for _, i := range idx {
			lines[i].AmountNote = s
		}
	}
	if !total.IsInt64() {
		note("the usage does not fit in 64 bits")
		return
	}
	all, err := pricing.Evaluate(p, currency, total.Int64())
	if err != nil {
		note(redact.Message(err.Error()))
		return
	}
	safe, err := pricing.Evaluate(p, currency, new(big.Int).Sub(total, risky).Int64())
	if err != nil {
		note(redact.Message(err.Error()))
		return
	}
	amounts := share(all.Amount, usages)
	atRisk := share(max(all.Amount-safe.Amount, 0), risks)
	for k, i := range idx {
		lines[i].Amount, lines[i].AmountAtRisk = &amounts[k], &atRisk[k]
		lines[i].AmountNote = all.Note()
		if len(idx) > 1 {
			lines[i].AmountNote = strings.TrimPrefix(lines[i].AmountNote+", shared with the other lines of the customer's invoice line by usage", ", ")
		}
	}
}

// share divides amount among the weights in proportion, in whole minor
// units that add up to amount: each its floor, then one more unit to the
// largest remainders, the first line first on a tie. No weight, no share.
func share(amount int64, weights []*big.Int) []int64 {
	out := make([]int64, len(weights))
	total := new(big.Int)
	for _, w := range weights {
		total.Add(total, w)
	}
	if total.Sign() == 0 || amount == 0 {
		return out
	}
	rems := make([]*big.Int, len(weights))
	left := amount
	for k, w := range weights {
		q, r := new(big.Int).QuoRem(new(big.Int).Mul(big.NewInt(amount), w), total, new(big.Int))
		out[k], rems[k] = q.Int64(), r
		left -= out[k]
	}
	order := make([]int, len(weights))
	for k := range order {
		order[k] = k
	}
	slices.SortStableFunc(order, func(a, b int) int { return rems[b].Cmp(rems[a]) })
	for _, k := range order[:left] {
		out[k]++
	}
	return out
}

// sumAmounts sets the report's totals from its priced lines: per currency,
// and per customer and currency.
func (c *Completeness) sumAmounts() {
	c.Amounts, c.Customers, c.UnpricedLines = []Amount{}, []CustomerAmount{}, 0
	currencies, customers := map[string]*Amount{}, map[[2]string]*CustomerAmount{}
	for _, l := range c.Lines {
		if l.Amount == nil {
			c.UnpricedLines++
			continue
		}
		risk := int64(0)
		if l.AmountAtRisk != nil {
			risk = *l.AmountAtRisk
		}
		a := currencies[l.Currency]
		if a == nil {
			a = &Amount{Currency: l.Currency}
			currencies[l.Currency] = a
		}
		a.Amount, a.AtRisk, a.Lines = a.Amount+*l.Amount, a.AtRisk+risk, a.Lines+1
		k := [2]string{l.Customer, l.Currency}
		ca := customers[k]
		if ca == nil {
			ca = &CustomerAmount{Customer: l.Customer, Amount: Amount{Currency: l.Currency}}
			customers[k] = ca
		}
		ca.Amount.Amount, ca.AtRisk, ca.Lines = ca.Amount.Amount+*l.Amount, ca.AtRisk+risk, ca.Lines+1
	}
	for _, a := range currencies {
		c.Amounts = append(c.Amounts, *a)
	}
	for _, ca := range customers {
		c.Customers = append(c.Customers, *ca)
	}
	slices.SortFunc(c.Amounts, func(a, b Amount) int { return strings.Compare(a.Currency, b.Currency) })
	slices.SortFunc(c.Customers, func(a, b CustomerAmount) int {
		return cmp.Or(strings.Compare(a.Customer, b.Customer), strings.Compare(a.Currency, b.Currency))
	})
}
