package invoices

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/mappings"
)

// Reader reads one invoice, with its lines, and one price, as Stripe
// sent it, from an account ("" for the node's destination).
type Reader interface {
	Invoice(ctx context.Context, account, id string) (stripeapi.Invoice, error)
	Price(ctx context.Context, account, id string) (json.RawMessage, error)
}

// Stripe is the Reader of a Stripe client: the node's destination, or a
// connected account through Stripe-Account.
type Stripe struct {
	Client *stripeapi.Client
}

// Invoice implements Reader.
func (s Stripe) Invoice(ctx context.Context, account, id string) (stripeapi.Invoice, error) {
	c, err := s.Client.For(account)
	if err != nil {
		return stripeapi.Invoice{}, err
	}
	return c.Invoice(ctx, id)
}

// Price implements Reader.
func (s Stripe) Price(ctx context.Context, account, id string) (json.RawMessage, error) {
	c, err := s.Client.For(account)
	if err != nil {
		return nil, err
	}
	_, body, err := c.Price(ctx, id)
	return body, err
}

// sqlInvoiceStore keeps an invoice as Stripe last gave it; read_at takes
// the new row's default (the database's clock).
const sqlInvoiceStore = `
INSERT INTO stripe_invoices AS i (account, invoice, customer, subscription, status, billing_reason, auto_advance,
    finalizes_at, created, finalized_at, currency)
VALUES (@account, @invoice, @customer, NULLIF(@subscription, ''), @status, @reason, @auto_advance,
    @finalizes_at, @created, @finalized_at, @currency)
ON CONFLICT (account, invoice) DO UPDATE SET customer = EXCLUDED.customer, subscription = EXCLUDED.subscription,
    status = EXCLUDED.status, billing_reason = EXCLUDED.billing_reason, auto_advance = EXCLUDED.auto_advance,
    finalizes_at = EXCLUDED.finalizes_at, created = EXCLUDED.created, finalized_at = EXCLUDED.finalized_at,
    currency = EXCLUDED.currency, read_at = EXCLUDED.read_at`

// sqlLineStore keeps one line.
const sqlLineStore = `
INSERT INTO stripe_invoice_lines (account, invoice, line, subscription_item, proration, price,
    period_start, period_end, quantity, amount, currency)
VALUES (@account, @invoice, @line, NULLIF(@item, ''), @proration, NULLIF(@price, ''),
    @start, @end, @quantity, @amount, @currency)
ON CONFLICT (account, invoice, line) DO UPDATE SET subscription_item = EXCLUDED.subscription_item,
    proration = EXCLUDED.proration, price = EXCLUDED.price, period_start = EXCLUDED.period_start,
    period_end = EXCLUDED.period_end, quantity = EXCLUDED.quantity, amount = EXCLUDED.amount,
    currency = EXCLUDED.currency, gone_at = NULL`

// sqlLinesGone marks the invoice's lines this read no longer lists.
const sqlLinesGone = `
UPDATE stripe_invoice_lines SET gone_at = clock_timestamp()
WHERE account = @account AND invoice = @invoice AND gone_at IS NULL AND NOT line = ANY(@listed::text[])`

// optionalTime is t for the database: NULL for zero.
func optionalTime(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// Record keeps inv, read from account, and its lines, in one transaction.
func Record(ctx context.Context, db pgdb.Beginner, account string, inv stripeapi.Invoice) error {
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlInvoiceStore, pgx.NamedArgs{"account": account, "invoice": inv.ID, "customer": inv.Customer,
			"subscription": inv.Subscription, "status": inv.Status, "reason": inv.BillingReason, "auto_advance": inv.AutoAdvance,
			"finalizes_at": optionalTime(inv.AutomaticallyFinalizesAt), "created": inv.Created,
			"finalized_at": optionalTime(inv.FinalizedAt), "currency": inv.Currency}); err != nil {
			return err
		}
		listed := make([]string, 0, len(inv.Lines))
		for _, l := range inv.Lines {
			if _, err := tx.Exec(ctx, sqlLineStore, pgx.NamedArgs{"account": account, "invoice": inv.ID, "line": l.ID,
				"item": l.SubscriptionItem, "proration": l.Proration, "price": l.Price, "start": l.PeriodStart, "end": l.PeriodEnd,
				"quantity": l.Quantity, "amount": l.Amount, "currency": l.Currency}); err != nil {
				return err
			}
			listed = append(listed, l.ID)
		}
		_, err := tx.Exec(ctx, sqlLinesGone, pgx.NamedArgs{"account": account, "invoice": inv.ID, "listed": listed})
		return err
	})
	if err != nil {
		return fmt.Errorf("invoices: keeping invoice %s: %w", inv.ID, err)
	}
	return nil
}

// Received says what reading an invoice an event named did.
type Received struct {
	// Accounts is how many accounts a tenant maps the invoice's customer
	// in: 0 when none (the invoice is not read).
	Accounts int
	// Recorded is how many of them had the invoice.
	Recorded int
	// Checks are the comparisons of a finalized invoice with the ledger.
	Checks []Check
}

// Receive reads the invoice id of customer from every account a current
// tenant mapping names the customer in, and records it where Stripe has
// it (customer and invoice ids are Stripe's, unique across accounts), with
// the prices its lines name that Tally has not kept yet; a finalized
// invoice is then compared with the ledger (Compare). An error from Stripe
// other than not-found is returned, for the event to be delivered again.
func Receive(ctx context.Context, db pgdb.Beginner, r Reader, maps *mappings.Store, customer, id string) (Received, error) {
	return Receiver{Reader: r, Maps: maps}.Receive(ctx, db, customer, id)
}

// Receiver receives the invoices invoice.* events name.
type Receiver struct {
	Reader Reader
	Maps   *mappings.Store
	// Gate, when set, opens the gate of a draft subscription invoice and
	// checks it again at each later read.
	Gate *Gate
}

// Receive is the package's Receive, with the gate.
func (rc Receiver) Receive(ctx context.Context, db pgdb.Beginner, customer, id string) (Received, error) {
	r, maps := rc.Reader, rc.Maps
	accounts, err := mappings.CustomerAccounts(ctx, db, customer)
	if err != nil {
		return Received{}, err
	}
	res := Received{Accounts: len(accounts)}
	for _, account := range accounts {
		inv, err := r.Invoice(ctx, account, id)
		switch {
		case stripeapi.NotFound(err):
			continue
		case err != nil:
			return res, fmt.Errorf("invoices: reading invoice %s: %w", id, err)
		case inv.Customer != customer:
			continue
		}
		if err := Record(ctx, db, account, inv); err != nil {
			return res, err
		}
		res.Recorded++
		if err := keepPrices(ctx, db, r, account, inv.Lines); err != nil {
			return res, err
		}
		if rc.Gate != nil {
			if err := rc.Gate.Open(ctx, account, inv); err != nil {
				return res, err
			}
			if err := rc.Gate.Check(ctx, account, inv.ID); err != nil {
				return res, err
			}
		}
		checks, err := Compare(ctx, db, maps, account, inv.ID)
		if err != nil {
			return res, err
		}
		res.Checks = append(res.Checks, checks...)
	}
	return res, nil
}

// keepPrices reads from Stripe the prices of lines that Tally has not
// kept, and keeps them. A price's amounts do not change once it is made,
// so a kept price is never read again.
func keepPrices(ctx context.Context, db pgdb.Querier, r Reader, account string, lines []stripeapi.InvoiceLine) error {
	var ids []string
	for _, l := range lines {
		if l.Price != "" && !slices.Contains(ids, l.Price) {
			ids = append(ids, l.Price)
		}
	}
	rows, err := db.Query(ctx, `SELECT price FROM stripe_prices WHERE account = $1 AND price = ANY($2)`, account, ids)
	if err != nil {
		return fmt.Errorf("invoices: reading kept prices: %w", err)
	}
	kept, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("invoices: reading kept prices: %w", err)
	}
	for _, id := range ids {
		if slices.Contains(kept, id) {
			continue
		}
		body, err := r.Price(ctx, account, id)
		if err != nil {
			return fmt.Errorf("invoices: reading price %s: %w", id, err)
		}
		if _, err := db.Exec(ctx, `INSERT INTO stripe_prices (account, price, body) VALUES ($1, $2, $3)
			ON CONFLICT (account, price) DO NOTHING`, account, id, []byte(body)); err != nil {
			return fmt.Errorf("invoices: keeping price %s: %w", id, err)
		}
	}
	return nil
}

// sqlItemPriceIDs lists the prices of the subscription items Tally keeps
// that are live or ended in the last 40 days, with the currency each is
// billed in: a reference table's rows, one per customer and item.
const sqlItemPriceIDs = `
SELECT DISTINCT account, price, currency FROM stripe_subscription_items
WHERE gone_at IS NULL AND (ended_at IS NULL OR ended_at > clock_timestamp() - interval '40 days')
ORDER BY account, price, currency`

// sqlKeptOf reads which of the prices are kept, in which currency, and
// whether the copy is more than a day old.
const sqlKeptOf = `
SELECT account, price, coalesce(body ->> 'currency', ''), read_at < clock_timestamp() - interval '1 day' FROM stripe_prices
WHERE (account, price) IN (SELECT * FROM unnest(@accounts::text[], @prices::text[]))`

// sqlPriceKeep keeps a price as Stripe gave it, replacing an older copy.
const sqlPriceKeep = `
INSERT INTO stripe_prices (account, price, body) VALUES (@account, @price, @body)
ON CONFLICT (account, price) DO UPDATE SET body = EXCLUDED.body, read_at = EXCLUDED.read_at`

// KeepItemPrices reads from Stripe, up to batch a run, the prices of the
// subscription items Tally keeps that it has not kept yet, so that the
// completeness report can price the usage of a period before its invoice;
// and again, when their copy is a day old, those billed in a currency
// other than the price's own: a price's currency_options can be changed,
// its own amounts cannot. A price Stripe does not give is skipped, and
// tried again next run; it returns how many it read.
func KeepItemPrices(ctx context.Context, db pgdb.Querier, r Reader, batch int) (int, error) {
	rows, err := db.Query(ctx, sqlItemPriceIDs)
	if err != nil {
		return 0, fmt.Errorf("invoices: listing the items' prices: %w", err)
	}
	type billed struct{ account, price, currency string }
	items, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (billed, error) {
		var b billed
		return b, row.Scan(&b.account, &b.price, &b.currency)
	})
	if err != nil || len(items) == 0 {
		return 0, err
	}
	var accounts, ids []string
	for _, b := range items {
		accounts, ids = append(accounts, b.account), append(ids, b.price)
	}
	rows, err = db.Query(ctx, sqlKeptOf, pgx.NamedArgs{"accounts": accounts, "prices": ids})
	if err != nil {
		return 0, fmt.Errorf("invoices: reading kept prices: %w", err)
	}
	type copyOf struct {
		currency string
		old      bool
	}
	kept := map[[2]string]copyOf{}
	var (
		account, id string
		c           copyOf
	)
	if _, err := pgx.ForEachRow(rows, []any{&account, &id, &c.currency, &c.old}, func() error {
		kept[[2]string{account, id}] = c
		return nil
	}); err != nil {
		return 0, fmt.Errorf("invoices: reading kept prices: %w", err)
	}
	read, tried := 0, 0
	done := map[[2]string]bool{}
	var errs []error
	for _, b := range items {
		key := [2]string{b.account, b.price}
		k, ok := kept[key]
		if done[key] || (ok && !(k.old && !strings.EqualFold(k.currency, b.currency))) {
			continue
		}
		if tried == batch {
			break
		}
		done[key] = true
		tried++
		body, err := r.Price(ctx, b.account, b.price)
		if err != nil {
			errs = append(errs, fmt.Errorf("invoices: reading price %s: %w", b.price, err))
			continue
		}
		if _, err := db.Exec(ctx, sqlPriceKeep, pgx.NamedArgs{"account": b.account, "price": b.price, "body": []byte(body)}); err != nil {
			return read, fmt.Errorf("invoices: keeping price %s: %w", b.price, err)
		}
		read++
	}
	return read, errors.Join(errs...)
}
