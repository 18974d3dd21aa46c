package invoices

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/redact"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/mappings"
)

// EventLister lists an account's subscription and invoice events created
// at or after since, oldest first ("" is the node's destination).
type EventLister interface {
	BillingEvents(ctx context.Context, account string, since time.Time) ([]stripeapi.BillingEvent, error)
}

// BillingEvents implements EventLister.
func (s Stripe) BillingEvents(ctx context.Context, account string, since time.Time) ([]stripeapi.BillingEvent, error) {
	c, err := s.Client.For(account)
	if err != nil {
		return nil, err
	}
	return c.BillingEvents(ctx, since)
}

// Defaults of the listing.
const (
	// listingOverlap is how far before the previous listing's start the
	// next one lists again: an event made just before it may have been
	// listable only after it.
	listingOverlap = time.Hour
	// firstListing is how far back an account's first listing goes: the
	// three days Stripe retries a delivery.
	firstListing = 72 * time.Hour
)

// Listing reads again what Stripe's subscription and invoice events say,
// from GET /v1/events, for the events the destination did not deliver:
// an invoice is read (and its gate opened or checked, and it compared) as
// its event would have, and a customer's subscriptions too, unless Tally
// read them after the event.
type Listing struct {
	DB       pgdb.DB
	Lister   EventLister
	Receiver Receiver
	// Subscriptions reads a customer's subscriptions again
	// (mappings.Store.SyncCustomer); nil skips their events.
	Subscriptions func(ctx context.Context, db pgdb.Beginner, customer string) (int, error)
	Logger        *slog.Logger
}

// Listed says what one Run did.
type Listed struct {
	Accounts, Events, Read int
}

// DefaultPriceBatch is how many prices of subscription items one listing
// reads at most (KeepItemPrices).
const DefaultPriceBatch = 200

// sqlListingStart reads where an account's listing starts, and takes the
// database's clock as where this one will have reached.
const sqlListingStart = `
SELECT coalesce((SELECT listed_to FROM billing_event_listings WHERE account = @account) - @overlap::interval,
                clock_timestamp() - @first::interval),
       clock_timestamp()`

const sqlListingDone = `
INSERT INTO billing_event_listings AS l (account, listed_to, events, error) VALUES (@account, @to, @events, NULLIF(@error, ''))
ON CONFLICT (account) DO UPDATE SET listed_to = CASE WHEN EXCLUDED.error IS NULL THEN EXCLUDED.listed_to ELSE l.listed_to END,
    events = EXCLUDED.events, error = EXCLUDED.error`

// sqlInvoiceReadSince says whether the invoice was read (in any account)
// well after the event was made: five minutes, against the two clocks'
// skew (Stripe's made the event, the database's the read).
const sqlInvoiceReadSince = `SELECT EXISTS (SELECT 1 FROM stripe_invoices WHERE invoice = $1 AND read_at > $2::timestamptz + interval '5 minutes')`

// sqlSubscriptionsReadSince says the same of the customer's subscriptions.
const sqlSubscriptionsReadSince = `SELECT EXISTS (SELECT 1 FROM stripe_subscription_reads WHERE customer = $1 AND read_at > $2::timestamptz + interval '5 minutes')`

// Run lists every account tenant mappings name, and the node's
// destination, each from where its last listing began (less the overlap),
// and acts on each event Tally has not acted on since. An account whose
// listing fails keeps its place and is listed again next time. Then it
// keeps the prices of the subscription items (KeepItemPrices).
func (l *Listing) Run(ctx context.Context) (Listed, error) {
	accounts, err := mappings.Accounts(ctx, l.DB)
	if err != nil {
		return Listed{}, err
	}
	var (
		res  Listed
		errs []error
	)
	for _, account := range append([]string{""}, accounts...) {
		n, read, err := l.listAccount(ctx, account)
		res.Accounts++
		res.Events += n
		res.Read += read
		if err != nil {
			errs = append(errs, fmt.Errorf("invoices: listing the events of account %q: %w", account, err))
		}
	}
	if l.Receiver.Reader != nil {
		_, err := KeepItemPrices(ctx, l.DB, l.Receiver.Reader, DefaultPriceBatch)
		errs = append(errs, err)
	}
	return res, errors.Join(errs...)
}

func (l *Listing) listAccount(ctx context.Context, account string) (events, read int, err error) {
	var since, to time.Time
	if err := l.DB.QueryRow(ctx, sqlListingStart, pgx.NamedArgs{"account": account, "overlap": listingOverlap,
		"first": firstListing}).Scan(&since, &to); err != nil {
		return 0, 0, err
	}
	evs, err := l.Lister.BillingEvents(ctx, account, since)
	if err == nil {
		for _, ev := range evs {
			var done bool
			if done, err = l.act(ctx, ev); err != nil {
				break
			}
			if done {
				read++
			}
		}
	}
	problem := ""
	if err != nil {
		problem = redact.Message(err.Error())
	}
	if _, werr := l.DB.Exec(ctx, sqlListingDone, pgx.NamedArgs{"account": account, "to": to, "events": len(evs),
		"error": problem}); werr != nil && err == nil {
		err = werr
	}
	return len(evs), read, err
}

// act does what the event's delivery would have, unless Tally read what
// it is about after the event was made; done says it read.
func (l *Listing) act(ctx context.Context, ev stripeapi.BillingEvent) (done bool, err error) {
	if !stripeapi.ValidCustomerID(ev.Customer) {
		return false, nil
	}
	var fresh bool
	switch {
	case stripeapi.InvoiceEvent(ev.Type) && stripeapi.ValidInvoiceID(ev.Object):
		if err := l.DB.QueryRow(ctx, sqlInvoiceReadSince, ev.Object, ev.Created).Scan(&fresh); err != nil || fresh {
			return false, err
		}
		_, err = l.Receiver.Receive(ctx, l.DB, ev.Customer, ev.Object)
	case stripeapi.SubscriptionEvent(ev.Type) && l.Subscriptions != nil:
		if err := l.DB.QueryRow(ctx, sqlSubscriptionsReadSince, ev.Customer, ev.Created).Scan(&fresh); err != nil || fresh {
			return false, err
		}
		_, err = l.Subscriptions(ctx, l.DB, ev.Customer)
	default:
		return false, nil
	}
	return err == nil, err
}

// ListingArgs is the River job that runs a Listing.
type ListingArgs struct{}

// Kind names the job.
func (ListingArgs) Kind() string { return "tally_billing_event_listing" }

// ListingWorker runs ListingArgs.
type ListingWorker struct {
	river.WorkerDefaults[ListingArgs]
	Listing *Listing
}

// Work lists the accounts' billing events.
func (w *ListingWorker) Work(ctx context.Context, _ *river.Job[ListingArgs]) error {
	res, err := w.Listing.Run(ctx)
	if res.Read > 0 {
		w.Listing.Logger.WarnContext(ctx, "invoices: events the destination did not deliver were listed and acted on",
			"events", res.Events, "read", res.Read)
	}
	return err
}

// Timeout lets a listing wait for Stripe for up to 50 minutes.
func (w *ListingWorker) Timeout(*river.Job[ListingArgs]) time.Duration { return 50 * time.Minute }

// PeriodicListing is the listing every hour and when River's leader
// starts, unique in the cluster.
func PeriodicListing() *river.PeriodicJob { return periodic(time.Hour, ListingArgs{}) }
