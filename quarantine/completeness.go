package quarantine

import (
	"context"
	_ "embed"
	"encoding/csv"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/pricing"
	"github.com/tallymeter/tally/reconcile"
)

// Bucket is the usage of one state: how many ledger events, and their value.
type Bucket struct {
	Events int64 `json:"events"`
	Value  Value `json:"value"`
}

// Line is one tenant, feature and billing period of the completeness report.
type Line struct {
	Tenant  string `json:"tenant"`
	Feature string `json:"feature"`
	// Period is the start of the billing period (RFC 3339).
	Period string `json:"period"`
	// Accounts are the Stripe accounts the line's items were staged for,
	// sorted: the node's destination, or the tenant mapping's connected
	// account (Stripe Connect); two when the tenant moved during the
	// period, none while nothing is staged.
	Accounts []string `json:"destination_accounts"`
	// Ingested is every usage event of the period in the ledger.
	Ingested Bucket `json:"ingested"`
	// The buckets, by the state of the item that carries each event now
	// (after any re-addressing). Pending includes leased items and events
	// not yet staged.
	Confirmed   Bucket `json:"confirmed"`
	Accepted    Bucket `json:"accepted"`
	Pending     Bucket `json:"pending"`
	Quarantined Bucket `json:"quarantined"`
	Uncertain   Bucket `json:"uncertain"`
	Rejected    Bucket `json:"rejected"`
	// Cancelled is the usage whose event was cancelled (meter.Cancel),
	// whatever the outcome: withdrawn before any attempt could reach
	// Stripe (in no item that is or will be sent), taken back by an
	// adjustment or a supplement, or refused (a cancellation item
	// quarantined for finance). How each take-back stands is its own
	// item's state, not a part of this line.
	Cancelled Bucket `json:"cancelled"`
	// Unstaged is the part of Pending not yet staged into an item.
	Unstaged Bucket `json:"unstaged"`
	// PeriodClosed is the usage, whatever its state, of items staged after
	// their billing period's invoice closed (the period's end plus the
	// invoice grace): quarantined period_closed, or sent knowingly or under
	// TALLY_LATE_USAGE=send, when Stripe records it on no finalized invoice.
	// A part of the buckets above, not one more.
	PeriodClosed Bucket `json:"period_closed"`
	// InconsistentItems counts items whose value is not the reduction of the
	// events they carry (a sum, the last value, or the event's own value).
	InconsistentItems int64 `json:"inconsistent_items"`
	// Discrepancies counts the open discrepancies (of any reconcile run:
	// unresolved, and not cleared by a later run) that involve this line's
	// usage: hours where Stripe's numbers differ from Tally's, and keys
	// whose summaries Stripe refused. Their accepted items stay accepted
	// until finance resolves them.
	Discrepancies int64 `json:"discrepancies"`
	// DiscrepanciesStripeHasMore counts those where Stripe has more than
	// Tally: the customer may be billed too much.
	DiscrepanciesStripeHasMore int64 `json:"discrepancies_stripe_has_more"`
	// Invoiced is the quantity the period's finalized invoice billed for
	// the line's meter (invoices.Check); nil before it is compared, or when
	// no line of it bills the meter. When the invoice line bills the usage
	// of more than one tenant or feature of the customer, each of their
	// lines shows the whole quantity.
	Invoiced *Value `json:"invoiced"`
	// Invoice is the invoice Invoiced is from.
	Invoice string `json:"invoice,omitempty"`
	// InvoiceDiscrepancies are the kinds of difference the invoice check
	// found and finance has not resolved: invoiced_more, invoiced_less,
	// used_not_invoiced.
	InvoiceDiscrepancies []string `json:"invoice_discrepancies"`
	// Customer, Price and Currency name what bills the line: the price of
	// its period's finalized invoice, else of its customer's subscription
	// item for the feature's meter; empty when AmountNote says why none.
	Customer string `json:"customer,omitempty"`
	Price    string `json:"price,omitempty"`
	Currency string `json:"currency,omitempty"`
	// Amount is what the line's usage (ingested less cancelled) should
	// bill at Price, in Currency's minor units, before tax, discounts and
	// credits; AmountAtRisk is the part of it whose usage Stripe has not
	// accepted (pending, quarantined, uncertain, rejected). Lines billed
	// by one invoice line share its amount by usage. Both nil when the
	// line cannot be priced (AmountNote). Reports sets them.
	Amount       *int64 `json:"amount"`
	AmountAtRisk *int64 `json:"amount_at_risk"`
	// AmountNote says why the line has no amount, or what a reader of it
	// should know (a rounding Stripe leaves open, a shared invoice line).
	AmountNote string `json:"amount_note,omitempty"`
	// Holds is the conservation identity: ingested = confirmed + accepted +
	// pending + quarantined + uncertain + rejected + cancelled, in events
	// and in value, and every item consistent with its events.
	Holds bool `json:"holds"`
}

// Completeness is the completeness report of one month's periods.
type Completeness struct {
	Period string `json:"period"`
	Lines  []Line `json:"lines"`
	// ReconcileRun is the latest reconcile run that succeeded, for
	// reference (the lines count the open discrepancies of every run); nil
	// before the first.
	ReconcileRun *int64 `json:"reconcile_run"`
	// Holds is true when every line holds.
	Holds bool `json:"holds"`
	// AsOf is when the report's snapshot was taken, by the database's
	// clock (RFC 3339, UTC): it counts everything committed before then.
	// Reports sets it; CompletenessOf, which reads the ledger now, leaves
	// it empty.
	AsOf string `json:"as_of,omitempty"`
	// Archived is true when the month's ledger has left the database: the
	// report is its verified archive's manifest (Reports.Archived).
	Archived bool `json:"archived,omitempty"`
	// Amounts are the priced lines' amounts per currency, Customers per
	// customer and currency; UnpricedLines counts the lines with no
	// amount. Reports sets them.
	Amounts       []Amount         `json:"amounts,omitempty"`
	Customers     []CustomerAmount `json:"customers,omitempty"`
	UnpricedLines int              `json:"unpriced_lines,omitempty"`
}

// sqlCompleteness attributes every ledger event of the periods starting in
// [@from, @to) to the state of the item that carries it now, at a cost
// linear in the month's events and items; completeness.sql says how.
//
//go:embed completeness.sql
var sqlCompleteness string

// sqlNoNestedLoops keeps the planner from joining by nested loops for the
// rest of the (sub)transaction; see sqlCompleteness.
const sqlNoNestedLoops = `SET LOCAL enable_nestloop = off`

// sqlFullWorkMem lets the full computation group a month's events by item
// in memory (a hash of the month's items) rather than sort the month on
// disk. It is one statement a night or an operator's command, never a
// request's.
const sqlFullWorkMem = `SET LOCAL work_mem = '512MB'`

// LedgerCompletenessOf computes the completeness report for the billing
// periods that start in the month period ("YYYY-MM"), for one tenant or
// all, from the ledger and the outbox: the full computation, whose cost
// grows with the month's events. It is the auditor of the counters that
// CompletenessOf reads (Audit), never what a request is answered from.
func LedgerCompletenessOf(ctx context.Context, q pgdb.Beginner, period, tenant string) (Completeness, error) {
	from, to, err := ParsePeriod(period)
	if err != nil {
		return Completeness{}, err
	}
	c := Completeness{Period: period, Lines: []Line{}, Holds: true}
	index, err := c.readLines(ctx, q, from, to, tenant)
	if err != nil {
		return Completeness{}, fmt.Errorf("quarantine: reading completeness: %w", err)
	}
	return c.finish(ctx, q, from, to, tenant, index)
}

// finish counts each line's discrepancies and decides whether each line,
// and the report, holds.
func (c Completeness) finish(ctx context.Context, q pgdb.Querier, from, to time.Time, tenant string, index map[[3]string]int) (Completeness, error) {
	if err := c.addDiscrepancies(ctx, q, from, to, tenant, index); err != nil {
		return Completeness{}, err
	}
	if err := c.addInvoiced(ctx, q, from, to, tenant, index); err != nil {
		return Completeness{}, err
	}
	for i := range c.Lines {
		l := &c.Lines[i]
		sum := Bucket{}
		for _, b := range []Bucket{l.Confirmed, l.Accepted, l.Pending, l.Quarantined, l.Uncertain, l.Rejected, l.Cancelled} {
			sum = add(sum, b)
		}
		l.Holds = sum.Events == l.Ingested.Events && sum.Value.Cmp(l.Ingested.Value) == 0 && l.InconsistentItems == 0
		c.Holds = c.Holds && l.Holds
	}
	return c, nil
}

// readLines runs sqlCompleteness and adds its rows to c's lines, which it
// indexes by tenant, feature and period. The statement runs in a
// transaction of its own, or a savepoint of the caller's, that turns
// nested loops off and is always rolled back: rolling back is what undoes
// SET LOCAL in a savepoint (releasing it would keep the setting for the
// rest of the caller's transaction), and the report writes nothing.
func (c *Completeness) readLines(ctx context.Context, q pgdb.Beginner, from, to time.Time, tenant string) (map[[3]string]int, error) {
	tx, err := q.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for _, set := range []string{sqlNoNestedLoops, sqlFullWorkMem} {
		if _, err := tx.Exec(ctx, set); err != nil {
			return nil, err
		}
	}
	// Planned for this month's bounds every time (an unnamed statement), not
	// by a cached generic plan: a month is 400 events or 40 million, and
	// only the bounds tell the planner which (see sqlCompleteness).
	rows, err := tx.Query(ctx, sqlCompleteness, pgx.QueryExecModeExec, pgx.NamedArgs{"from": from, "to": to, "tenant": tenant})
	if err != nil {
		return nil, err
	}
	var (
		tenantName, feature, state string
		ingN, n, bad, lateN        int64
		ingV, v, lateV             Value
		per                        time.Time
		accounts                   []string
	)
	index := map[[3]string]int{}
	if _, err := pgx.ForEachRow(rows, []any{&tenantName, &feature, &per, &ingN, &ingV, &state, &n, &v, &bad, &lateN, &lateV, &accounts}, func() error {
		perText := per.UTC().Format(time.RFC3339)
		key := [3]string{tenantName, feature, perText}
		i, ok := index[key]
		if !ok {
			i = len(c.Lines)
			index[key] = i
			c.Lines = append(c.Lines, Line{Tenant: tenantName, Feature: feature, Period: perText, Accounts: []string{},
				Ingested: Bucket{Events: ingN, Value: ingV}})
		}
		l := &c.Lines[i]
		for _, a := range accounts {
			if !slices.Contains(l.Accounts, a) {
				l.Accounts = append(l.Accounts, a)
			}
		}
		slices.Sort(l.Accounts)
		b := Bucket{Events: n, Value: v}
		switch state {
		case "confirmed":
			l.Confirmed = add(l.Confirmed, b)
		case "accepted":
			l.Accepted = add(l.Accepted, b)
		case "pending", "leased":
			l.Pending = add(l.Pending, b)
		case "unstaged":
			l.Pending, l.Unstaged = add(l.Pending, b), add(l.Unstaged, b)
		case "quarantined":
			l.Quarantined = add(l.Quarantined, b)
		case "uncertain":
			l.Uncertain = add(l.Uncertain, b)
		case "rejected":
			l.Rejected = add(l.Rejected, b)
		case "cancelled":
			l.Cancelled = add(l.Cancelled, b)
		default:
			// superseded cannot be live; anything else breaks the identity below
		}
		l.InconsistentItems += bad
		l.PeriodClosed = add(l.PeriodClosed, Bucket{Events: lateN, Value: lateV})
		return nil
	}); err != nil {
		return nil, err
	}
	return index, nil
}

// addDiscrepancies counts on each line the open discrepancies that involve
// its usage, and names the latest succeeded reconcile run.
func (c *Completeness) addDiscrepancies(ctx context.Context, q pgdb.Querier, from, to time.Time, tenant string, index map[[3]string]int) error {
	run, ok, err := reconcile.LatestSucceeded(ctx, q)
	if err != nil {
		return err
	}
	if ok {
		c.ReconcileRun = &run
	}
	per, err := reconcile.DiscrepanciesByPeriod(ctx, q, from, to, tenant)
	if err != nil {
		return err
	}
	for _, d := range per {
		if i, ok := index[[3]string{d.Tenant, d.Feature, d.Period.UTC().Format(time.RFC3339)}]; ok {
			c.Lines[i].Discrepancies += d.Hours
			c.Lines[i].DiscrepanciesStripeHasMore += d.StripeHasMore
		}
	}
	return nil
}

// sqlInvoiced reads the invoice checks of the periods starting in [@from,
// @to), one row per tenant and feature each covers, the latest compared
// first: an index range of the month's checks (customers × meters).
const sqlInvoiced = `
SELECT t.tenant, f.feature, c.period_start, c.invoice, c.invoiced::text,
       CASE WHEN c.status = 'differs' AND c.resolved_at IS NULL THEN c.kinds ELSE '{}' END
FROM invoice_checks c, unnest(c.tenants) AS t (tenant), unnest(c.features) AS f (feature)
WHERE c.period_start >= @from AND c.period_start < @to AND (@tenant = '' OR t.tenant = @tenant)
ORDER BY c.compared_at DESC`

// addInvoiced sets each line's invoiced quantity and open invoice
// discrepancies from the invoice checks; a checked line the counters do
// not have (invoiced, with no usage) is added.
func (c *Completeness) addInvoiced(ctx context.Context, q pgdb.Querier, from, to time.Time, tenant string, index map[[3]string]int) error {
	rows, err := q.Query(ctx, sqlInvoiced, pgx.NamedArgs{"from": from, "to": to, "tenant": tenant})
	if err != nil {
		return err
	}
	var (
		tenantName, feature, invoice string
		per                          time.Time
		invoiced                     *string
		kinds                        []string
	)
	seen := map[[3]string]bool{}
	_, err = pgx.ForEachRow(rows, []any{&tenantName, &feature, &per, &invoice, &invoiced, &kinds}, func() error {
		key := [3]string{tenantName, feature, per.UTC().Format(time.RFC3339)}
		if seen[key] {
			return nil
		}
		seen[key] = true
		i, ok := index[key]
		if !ok {
			i = len(c.Lines)
			index[key] = i
			c.Lines = append(c.Lines, Line{Tenant: tenantName, Feature: feature, Period: key[2], Accounts: []string{}})
		}
		l := &c.Lines[i]
		l.Invoice, l.InvoiceDiscrepancies = invoice, kinds
		if invoiced != nil {
			var v Value
			if err := v.ScanText(pgtype.Text{String: *invoiced, Valid: true}); err != nil {
				return err
			}
			l.Invoiced = &v
		}
		return nil
	})
	for i := range c.Lines {
		if c.Lines[i].InvoiceDiscrepancies == nil {
			c.Lines[i].InvoiceDiscrepancies = []string{}
		}
	}
	return err
}

// major is an amount in its currency's major units for the CSV, empty
// when there is none.
func major(amount *int64, currency string) string {
	if amount == nil {
		return ""
	}
	return pricing.Major(*amount, currency)
}

func add(a, b Bucket) Bucket {
	return Bucket{Events: a.Events + b.Events, Value: a.Value.Plus(b.Value)}
}

// completenessColumns are the CSV's columns: each bucket as events and
// value.
var completenessColumns = []string{"tenant", "feature", "period", "destination_accounts",
	"ingested_events", "ingested_value", "confirmed_events", "confirmed_value", "accepted_events", "accepted_value",
	"pending_events", "pending_value", "quarantined_events", "quarantined_value", "uncertain_events", "uncertain_value",
	"rejected_events", "rejected_value", "cancelled_events", "cancelled_value", "unstaged_events", "unstaged_value",
	"period_closed_events", "period_closed_value", "inconsistent_items", "discrepancies", "discrepancies_stripe_has_more",
	"invoiced", "invoice", "invoice_discrepancies", "customer", "price", "currency", "amount", "amount_at_risk",
	"amount_note", "holds", "as_of"}

// CSV writes the report's lines as CSV, one row a tenant, feature and
// period with its destination accounts (space-separated), every bucket as
// events and value, the amounts in the currency's major units, and the
// snapshot's as_of on every row (a spreadsheet keeps it beside the
// numbers); every text cell is safe against spreadsheet formula injection.
func (c Completeness) CSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	_ = cw.Write(completenessColumns)
	for _, l := range c.Lines {
		row := []string{SafeCell(l.Tenant), SafeCell(l.Feature), SafeCell(l.Period), SafeCell(strings.Join(l.Accounts, " "))}
		for _, b := range []Bucket{l.Ingested, l.Confirmed, l.Accepted, l.Pending, l.Quarantined, l.Uncertain, l.Rejected, l.Cancelled, l.Unstaged, l.PeriodClosed} {
			row = append(row, strconv.FormatInt(b.Events, 10), b.Value.String())
		}
		invoiced := ""
		if l.Invoiced != nil {
			invoiced = l.Invoiced.String()
		}
		row = append(row, strconv.FormatInt(l.InconsistentItems, 10), strconv.FormatInt(l.Discrepancies, 10),
			strconv.FormatInt(l.DiscrepanciesStripeHasMore, 10), invoiced, SafeCell(l.Invoice),
			SafeCell(strings.Join(l.InvoiceDiscrepancies, " ")), SafeCell(l.Customer), SafeCell(l.Price), SafeCell(l.Currency),
			major(l.Amount, l.Currency), major(l.AmountAtRisk, l.Currency), SafeCell(l.AmountNote),
			strconv.FormatBool(l.Holds), SafeCell(c.AsOf))
		_ = cw.Write(row)
	}
	cw.Flush()
	return cw.Error()
}

// Table writes the report for a terminal.
func (c Completeness) Table(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "TENANT\tFEATURE\tPERIOD\tINGESTED\tCONFIRMED\tACCEPTED\tPENDING\tQUARANTINED\tUNCERTAIN\tREJECTED\tCANCELLED\tPERIOD CLOSED\tDISCREPANCIES\tSTRIPE HAS MORE\tINVOICED\tAMOUNT\tAT RISK\tHOLDS\t")
	for _, l := range c.Lines {
		invoiced := "-"
		if l.Invoiced != nil {
			invoiced = l.Invoiced.String()
		}
		if len(l.InvoiceDiscrepancies) > 0 {
			invoiced += " (" + strings.Join(l.InvoiceDiscrepancies, ", ") + ")"
		}
		amount, risk := "-", "-"
		if l.Amount != nil {
			amount, risk = pricing.Format(*l.Amount, l.Currency), pricing.Format(*l.AmountAtRisk, l.Currency)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%s\t%s\t%s\t%v\t\n", l.Tenant, l.Feature, l.Period,
			l.Ingested.Value, l.Confirmed.Value, l.Accepted.Value, l.Pending.Value, l.Quarantined.Value,
			l.Uncertain.Value, l.Rejected.Value, l.Cancelled.Value, l.PeriodClosed.Value, l.Discrepancies,
			l.DiscrepanciesStripeHasMore, invoiced, amount, risk, l.Holds)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, a := range c.Amounts {
		fmt.Fprintf(w, "total %s, at risk %s (%d lines)\n", pricing.Format(a.Amount, a.Currency), pricing.Format(a.AtRisk, a.Currency), a.Lines)
	}
	if c.UnpricedLines > 0 {
		fmt.Fprintf(w, "%d lines without an amount (see amount_note in the JSON or CSV)\n", c.UnpricedLines)
	}
	if c.AsOf != "" {
		_, err := fmt.Fprintf(w, "as of %s\n", c.AsOf)
		return err
	}
	return nil
}
