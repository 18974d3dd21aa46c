package invoices

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/redact"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/pricing"
	"github.com/tallymeter/tally/quarantine"
)

// Status is how a check stands.
type Status string

// Statuses.
const (
	// Matches: the invoice bills exactly the period's usage, and no usage
	// came after it closed.
	Matches Status = "matches"
	// Differs: one or more Kinds; finance resolves it.
	Differs Status = "differs"
	// NotCompared: Tally cannot set the invoice beside the ledger; Reason
	// says why.
	NotCompared Status = "not_compared"
)

// Kinds of difference a check finds.
const (
	// KindInvoicedMore: the invoice bills more than the period's usage.
	KindInvoicedMore = "invoiced_more"
	// KindInvoicedLess: the invoice bills less than the period's usage
	// (usage quarantined, uncertain, rejected or still pending included).
	KindInvoicedLess = "invoiced_less"
	// KindUsedNotInvoiced: usage of the period is on no invoice: it came
	// after the invoice closed, or no line bills its meter.
	KindUsedNotInvoiced = "used_not_invoiced"
)

// Check is one finalized invoice's billing of one meter, beside the usage
// of its period by the customer's tenants.
type Check struct {
	ID          int64     `json:"id"`
	Account     string    `json:"destination_account"`
	Invoice     string    `json:"invoice"`
	Customer    string    `json:"customer"`
	EventName   string    `json:"event_name"`
	Formula     string    `json:"formula"`
	PeriodStart time.Time `json:"period_start"`
	PeriodEnd   time.Time `json:"period_end"`
	Tenants     []string  `json:"tenants"`
	Features    []string  `json:"features"`
	// Lines and Prices are the invoice lines that bill the meter.
	Lines  []string `json:"lines"`
	Prices []string `json:"prices"`
	// Invoiced is the lines' quantity; nil when no line bills the meter.
	Invoiced *quarantine.Value `json:"invoiced"`
	// Expected is the usage of the period that should be on the invoice,
	// per the meter's formula, after cancellations, less Unbilled; nil
	// when not compared.
	Expected *quarantine.Value `json:"expected"`
	// Unbilled is the usage of the period that came after the invoice
	// closed (period_closed): used, and on no invoice.
	Unbilled quarantine.Value `json:"unbilled"`
	Status   Status           `json:"status"`
	Kinds    []string         `json:"kinds"`
	// Currency is the lines' currency; InvoicedAmount the sum of their
	// amounts (minor units, before discounts and tax); ExpectedAmount what
	// the price bills for Expected (package pricing), nil when it cannot
	// be computed, AmountNote saying why or what to know of it.
	Currency       string `json:"currency"`
	InvoicedAmount *int64 `json:"invoiced_amount"`
	ExpectedAmount *int64 `json:"expected_amount"`
	AmountNote     string `json:"amount_note,omitempty"`
	Reason         string `json:"reason,omitempty"`
	// ComparedAt is when the numbers were last taken.
	ComparedAt time.Time   `json:"compared_at"`
	Resolution *Resolution `json:"resolution"`
}

// Resolution is finance's decision on a check that differs.
type Resolution struct {
	Reason ResolutionReason `json:"reason"`
	Note   string           `json:"note"`
	By     string           `json:"by"`
	At     time.Time        `json:"at"`
}

// sqlInvoiceOf reads what a comparison needs of a kept invoice.
const sqlInvoiceOf = `
SELECT customer, status, finalized_at IS NOT NULL FROM stripe_invoices WHERE account = @account AND invoice = @invoice`

// sqlLinesOf reads the invoice's current lines that name a price.
const sqlLinesOf = `
SELECT line, price, period_start, period_end, quantity, amount, currency FROM stripe_invoice_lines
WHERE account = @account AND invoice = @invoice AND gone_at IS NULL AND price IS NOT NULL
ORDER BY line`

// sqlTenantsOf reads the tenants mapped to the customer in the account,
// each with the start of its billing period that holds @start.
const sqlTenantsOf = `
SELECT tenant, tally_period_start(@start, coalesce(period_anchor, '1970-01-01T00:00:00Z'))
FROM tenant_mappings WHERE stripe_customer_id = @customer AND coalesce(stripe_account, '') = @account
ORDER BY tenant`

// sqlCheckStore keeps a comparison. A resolution stays while the numbers
// it was given for stay; new numbers reopen the check.
var sqlCheckStore = strings.ReplaceAll(`
INSERT INTO invoice_checks AS c (account, invoice, customer, event_name, formula, period_start, period_end,
    tenants, features, lines, prices, invoiced, expected, unbilled, status, kinds, reason,
    currency, invoiced_amount, expected_amount, amount_note)
VALUES (@account, @invoice, @customer, @event_name, @formula, @start, @end,
    @tenants, @features, @lines, @prices, @invoiced::numeric, @expected::numeric, @unbilled::numeric, @status, @kinds, @reason,
    @currency, @invoiced_amount, @expected_amount, @amount_note)
ON CONFLICT (account, invoice, event_name) DO UPDATE SET customer = EXCLUDED.customer, formula = EXCLUDED.formula,
    period_start = EXCLUDED.period_start, period_end = EXCLUDED.period_end, tenants = EXCLUDED.tenants,
    features = EXCLUDED.features, lines = EXCLUDED.lines, prices = EXCLUDED.prices, invoiced = EXCLUDED.invoiced,
    expected = EXCLUDED.expected, unbilled = EXCLUDED.unbilled, status = EXCLUDED.status, kinds = EXCLUDED.kinds,
    reason = EXCLUDED.reason, compared_at = EXCLUDED.compared_at, currency = EXCLUDED.currency,
    invoiced_amount = EXCLUDED.invoiced_amount, expected_amount = EXCLUDED.expected_amount, amount_note = EXCLUDED.amount_note,
    resolution = CASE WHEN {same} THEN c.resolution END, resolution_note = CASE WHEN {same} THEN c.resolution_note END,
    resolved_by = CASE WHEN {same} THEN c.resolved_by END, resolved_at = CASE WHEN {same} THEN c.resolved_at END
RETURNING id, compared_at, resolution, resolution_note, resolved_by, resolved_at`, "{same}", `(c.invoiced, c.expected, c.unbilled, c.kinds)
    IS NOT DISTINCT FROM (EXCLUDED.invoiced, EXCLUDED.expected, EXCLUDED.unbilled, EXCLUDED.kinds)`)

// meterLine is the invoice's billing of one meter.
type meterLine struct {
	formula       string
	lines, prices []string
	quantity      int64
	amount        int64
	currency      string
	start, end    time.Time
	transforms    []*stripe.PriceTransformQuantity
	priceObjs     []*stripe.Price
	mixedPeriods  bool
}

// Compare sets a kept, finalized invoice beside the ledger: for each meter
// event name a line bills (through its price's recurring.meter) or a
// feature of the customer's tenants used in the lines' period, it keeps a
// Check. A draft or void invoice, or one with no line on a known metered
// price, is not compared (nil, nil).
func Compare(ctx context.Context, db pgdb.Beginner, maps *mappings.Store, account, invoice string) ([]Check, error) {
	checks, err := compare(ctx, db, maps, account, invoice)
	if err != nil {
		return nil, fmt.Errorf("invoices: comparing invoice %s: %w", invoice, err)
	}
	return checks, nil
}

func compare(ctx context.Context, db pgdb.Beginner, maps *mappings.Store, account, invoice string) ([]Check, error) {
	args := pgx.NamedArgs{"account": account, "invoice": invoice}
	var (
		customer, status string
		finalized        bool
	)
	if err := db.QueryRow(ctx, sqlInvoiceOf, args).Scan(&customer, &status, &finalized); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, nil
		}
		return nil, err
	}
	if !finalized || status == "draft" || status == "void" {
		return nil, nil
	}
	byName, start, end, err := meterLines(ctx, db, account, invoice)
	if err != nil {
		return nil, err
	}
	if len(byName) == 0 {
		_, err := db.Exec(ctx, `UPDATE stripe_invoices SET compared_at = clock_timestamp() WHERE account = @account AND invoice = @invoice`, args)
		return nil, err
	}
	features, err := maps.Features(ctx, db)
	if err != nil {
		return nil, err
	}
	tenants, usage, mismatch, err := periodUsage(ctx, db, account, customer, start)
	if err != nil {
		return nil, err
	}
	// Every event name billed, and every one the tenants used.
	names := map[string]*meterLine{}
	for n, ml := range byName {
		names[n] = ml
	}
	for _, f := range features {
		for _, t := range tenants {
			if l, ok := usage[[2]string{t, f.Feature}]; ok && l.Ingested.Events > 0 && names[f.EventName] == nil {
				names[f.EventName] = &meterLine{formula: string(f.Aggregation), start: start, end: end}
			}
		}
	}
	var checks []Check
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		checks = checks[:0]
		for _, name := range sortedKeys(names) {
			ml := names[name]
			c := Check{Account: account, Invoice: invoice, Customer: customer, EventName: name, Formula: ml.formula,
				PeriodStart: ml.start, PeriodEnd: ml.end, Tenants: tenants, Features: []string{}, Lines: ml.lines, Prices: ml.prices}
			if c.Lines == nil {
				c.Lines, c.Prices = []string{}, []string{}
			} else {
				q, amount := quarantine.ValueOf(ml.quantity), ml.amount
				c.Invoiced, c.InvoicedAmount, c.Currency = &q, &amount, ml.currency
			}
			judge(&c, ml, features, usage, mismatch)
			price(&c, ml)
			if err := store(ctx, tx, &c); err != nil {
				return err
			}
			checks = append(checks, c)
		}
		_, err := tx.Exec(ctx, `UPDATE stripe_invoices SET compared_at = clock_timestamp() WHERE account = @account AND invoice = @invoice`, args)
		return err
	})
	return checks, err
}

// meterLines groups the invoice's lines by the event name of their price's
// meter (prices Tally has kept; a line of another price is no meter's),
// and gives the period of the first.
func meterLines(ctx context.Context, q pgdb.Querier, account, invoice string) (map[string]*meterLine, time.Time, time.Time, error) {
	rows, err := q.Query(ctx, sqlLinesOf, pgx.NamedArgs{"account": account, "invoice": invoice})
	if err != nil {
		return nil, time.Time{}, time.Time{}, err
	}
	type line struct {
		id, price        string
		start, end       time.Time
		quantity, amount int64
		currency         string
	}
	var lines []line
	var l line
	if _, err := pgx.ForEachRow(rows, []any{&l.id, &l.price, &l.start, &l.end, &l.quantity, &l.amount, &l.currency}, func() error {
		lines = append(lines, l)
		return nil
	}); err != nil {
		return nil, time.Time{}, time.Time{}, err
	}
	prices, err := storedPrices(ctx, q, account, lines, func(l line) string { return l.price })
	if err != nil {
		return nil, time.Time{}, time.Time{}, err
	}
	meters, err := meterNames(ctx, q, prices)
	if err != nil {
		return nil, time.Time{}, time.Time{}, err
	}
	out := map[string]*meterLine{}
	var start, end time.Time
	for _, l := range lines {
		p := prices[l.price]
		if p == nil || p.Recurring == nil || p.Recurring.Meter == "" {
			continue
		}
		m, ok := meters[p.Recurring.Meter]
		if !ok {
			continue
		}
		if start.IsZero() {
			start, end = l.start.UTC(), l.end.UTC()
		}
		ml := out[m.eventName]
		if ml == nil {
			ml = &meterLine{formula: m.formula, start: l.start.UTC(), end: l.end.UTC(), lines: []string{}, prices: []string{}, currency: l.currency}
			out[m.eventName] = ml
		}
		if !ml.start.Equal(l.start) || !ml.end.Equal(l.end) {
			ml.mixedPeriods = true
		}
		ml.lines = append(ml.lines, l.id)
		if !slices.Contains(ml.prices, l.price) {
			ml.prices = append(ml.prices, l.price)
			ml.transforms = append(ml.transforms, p.TransformQuantity)
			ml.priceObjs = append(ml.priceObjs, p)
		}
		ml.quantity += l.quantity
		ml.amount += l.amount
	}
	return out, start, end, nil
}

// storedPrices reads the kept prices of the given lines, decoded, by id.
func storedPrices[L any](ctx context.Context, q pgdb.Querier, account string, lines []L, price func(L) string) (map[string]*stripe.Price, error) {
	keys := make([][2]string, len(lines))
	for i, l := range lines {
		keys[i] = [2]string{account, price(l)}
	}
	kept, err := quarantine.KeptPrices(ctx, q, keys)
	if err != nil {
		return nil, err
	}
	out := make(map[string]*stripe.Price, len(kept))
	for k, p := range kept {
		out[k[1]] = p
	}
	return out, nil
}

type meterName struct{ eventName, formula string }

// meterNames reads the event name and formula of the prices' meters from
// the meter directory.
func meterNames(ctx context.Context, q pgdb.Querier, prices map[string]*stripe.Price) (map[string]meterName, error) {
	ids := []string{}
	for _, p := range prices {
		if p.Recurring != nil && p.Recurring.Meter != "" {
			ids = append(ids, p.Recurring.Meter)
		}
	}
	rows, err := q.Query(ctx, `SELECT DISTINCT ON (id) id, event_name, formula FROM stripe_meters WHERE id = ANY($1) ORDER BY id, seen_at DESC`, ids)
	if err != nil {
		return nil, err
	}
	out := map[string]meterName{}
	var id string
	var m meterName
	_, err = pgx.ForEachRow(rows, []any{&id, &m.eventName, &m.formula}, func() error {
		out[id] = m
		return nil
	})
	return out, err
}

// periodUsage reads the customer's tenants in the account and, for each
// whose billing period starts at start, its completeness lines of that
// period by tenant and feature (the counters: a tenant's keys of the
// month, never the ledger). mismatch names the tenants whose period
// starts elsewhere, with where.
func periodUsage(ctx context.Context, db pgdb.Beginner, account, customer string, start time.Time) ([]string, map[[2]string]quarantine.Line, map[string]time.Time, error) {
	rows, err := db.Query(ctx, sqlTenantsOf, pgx.NamedArgs{"account": account, "customer": customer, "start": start})
	if err != nil {
		return nil, nil, nil, err
	}
	tenants := []string{}
	starts := map[string]time.Time{}
	var (
		t   string
		per time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&t, &per}, func() error {
		tenants = append(tenants, t)
		starts[t] = per.UTC()
		return nil
	}); err != nil {
		return nil, nil, nil, err
	}
	usage := map[[2]string]quarantine.Line{}
	mismatch := map[string]time.Time{}
	want := start.UTC().Format(time.RFC3339)
	for _, t := range tenants {
		if !starts[t].Equal(start) {
			mismatch[t] = starts[t]
			continue
		}
		rep, err := quarantine.CompletenessOf(ctx, db, start.UTC().Format("2006-01"), t)
		if err != nil {
			return nil, nil, nil, err
		}
		for _, l := range rep.Lines {
			if l.Period == want {
				usage[[2]string{t, l.Feature}] = l
			}
		}
	}
	return tenants, usage, mismatch, nil
}

// judge fills c's features, expected and unbilled usage, status and kinds.
func judge(c *Check, ml *meterLine, features []mappings.Feature, usage map[[2]string]quarantine.Line, mismatch map[string]time.Time) {
	c.Kinds = []string{}
	total, unbilled := new(big.Int), new(big.Int)
	for _, f := range features {
		if f.EventName != c.EventName {
			continue
		}
		c.Features = append(c.Features, f.Feature)
		for _, t := range c.Tenants {
			l, ok := usage[[2]string{t, f.Feature}]
			if !ok {
				continue
			}
			switch c.Formula {
			case "count":
				total.Add(total, big.NewInt(l.Ingested.Events-l.Cancelled.Events))
				unbilled.Add(unbilled, big.NewInt(l.PeriodClosed.Events))
			default:
				total.Add(total, l.Ingested.Value.Big())
				total.Sub(total, l.Cancelled.Value.Big())
				unbilled.Add(unbilled, l.PeriodClosed.Value.Big())
			}
		}
	}
	c.Unbilled = quarantine.ValueOfBig(unbilled)
	switch {
	case c.Formula != "sum" && c.Formula != "count":
		c.Status, c.Reason = NotCompared, "the meter's formula is "+c.Formula+": Tally compares sum and count meters at the invoice (reconcile compares last values hourly)"
		return
	case ml.mixedPeriods:
		c.Status, c.Reason = NotCompared, "the meter's lines bill different periods"
		return
	case len(c.Tenants) == 0:
		c.Status, c.Reason = NotCompared, "no tenant is mapped to the customer in this account"
		return
	}
	for _, t := range c.Tenants {
		if at, ok := mismatch[t]; ok {
			c.Status = NotCompared
			c.Reason = fmt.Sprintf("tenant %s's billing period starts at %s, the invoice's at %s", t, at.Format(time.RFC3339), c.PeriodStart.Format(time.RFC3339))
			if len(c.Reason) > 300 {
				c.Reason = c.Reason[:297] + "..."
			}
			return
		}
	}
	expected := new(big.Int).Sub(total, unbilled)
	if expected.Sign() < 0 {
		expected.SetInt64(0) // Stripe bills a negative period as quantity 0
	}
	e := quarantine.ValueOfBig(expected)
	c.Expected = &e
	if unbilled.Sign() != 0 {
		c.Kinds = append(c.Kinds, KindUsedNotInvoiced)
	}
	if c.Invoiced == nil {
		if expected.Sign() > 0 && !slices.Contains(c.Kinds, KindUsedNotInvoiced) {
			c.Kinds = append(c.Kinds, KindUsedNotInvoiced)
		}
	} else if got := c.Invoiced.Big(); got.Cmp(expected) != 0 && !transformed(ml.transforms, expected, got) {
		if got.Cmp(expected) > 0 {
			c.Kinds = append(c.Kinds, KindInvoicedMore)
		} else {
			c.Kinds = append(c.Kinds, KindInvoicedLess)
		}
	}
	c.Status = Matches
	if len(c.Kinds) > 0 {
		c.Status = Differs
	}
}

// transformed reports whether got is usage after the one price's
// transform_quantity: Stripe's documentation does not say whether a line
// shows the usage or the transformed quantity, so either is accepted.
func transformed(ts []*stripe.PriceTransformQuantity, usage, got *big.Int) bool {
	if len(ts) != 1 || ts[0] == nil || ts[0].DivideBy <= 0 {
		return false
	}
	q, r := new(big.Int).QuoRem(usage, big.NewInt(ts[0].DivideBy), new(big.Int))
	if ts[0].Round == stripe.PriceTransformQuantityRoundUp && r.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	return q.Cmp(got) == 0
}

// store keeps c and sets its id and the time of the comparison.
func store(ctx context.Context, tx pgx.Tx, c *Check) error {
	text := func(v *quarantine.Value) *string {
		if v == nil {
			return nil
		}
		s := v.String()
		return &s
	}
	var (
		reason, note, by *string
		at               *time.Time
	)
	err := tx.QueryRow(ctx, sqlCheckStore, pgx.NamedArgs{"account": c.Account, "invoice": c.Invoice, "customer": c.Customer,
		"event_name": c.EventName, "formula": c.Formula, "start": c.PeriodStart, "end": c.PeriodEnd, "tenants": c.Tenants,
		"features": c.Features, "lines": c.Lines, "prices": c.Prices, "invoiced": text(c.Invoiced), "expected": text(c.Expected),
		"unbilled": c.Unbilled.String(), "status": string(c.Status), "kinds": c.Kinds, "reason": c.Reason,
		"currency": c.Currency, "invoiced_amount": c.InvoicedAmount, "expected_amount": c.ExpectedAmount, "amount_note": c.AmountNote}).Scan(&c.ID, &c.ComparedAt, &reason, &note, &by, &at)
	c.Resolution = resolutionOf(reason, note, by, at)
	return err
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// price sets what the check's one price bills for its expected usage.
func price(c *Check, ml *meterLine) {
	switch {
	case c.Expected == nil:
		return
	case len(ml.priceObjs) != 1:
		if len(ml.priceObjs) > 1 {
			c.AmountNote = "the meter is billed by more than one price"
		}
		return
	case !c.Expected.Big().IsInt64():
		c.AmountNote = "the expected usage does not fit in 64 bits"
		return
	}
	q, err := pricing.Evaluate(ml.priceObjs[0], c.Currency, c.Expected.Big().Int64())
	if err != nil {
		c.AmountNote = redact.Message(err.Error())
		return
	}
	c.ExpectedAmount = &q.Amount
	c.AmountNote = redact.Message(q.Note())
}
