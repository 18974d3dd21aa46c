package stripeapi

import (
	"context"
	"time"

	"github.com/stripe/stripe-go/v82"
)

// Invoice is one of a customer's invoices, as Tally needs it to compare
// what it bills with the usage of its period.
type Invoice struct {
	ID       string // in_…
	Customer string
	// Subscription is the subscription that made the invoice
	// (parent.subscription_details); "" for another invoice.
	Subscription  string
	Status        string // draft, open, paid, uncollectible, void
	BillingReason string // subscription_cycle, subscription_update, …
	AutoAdvance   bool
	// AutomaticallyFinalizesAt is when Stripe finalizes a draft; zero
	// when it will not (auto_advance false, or not a draft).
	AutomaticallyFinalizesAt time.Time
	Created                  time.Time
	// FinalizedAt is when the invoice was finalized; zero for a draft.
	FinalizedAt time.Time
	Currency    string
	Lines       []InvoiceLine
}

// InvoiceLine is one line of an invoice.
type InvoiceLine struct {
	ID string // il_…
	// SubscriptionItem is the item the line bills
	// (parent.subscription_item_details); "" for another line.
	SubscriptionItem string
	Proration        bool
	Price            string // pricing.price_details.price
	// PeriodStart and PeriodEnd bound the usage the line bills.
	PeriodStart, PeriodEnd time.Time
	Quantity               int64
	Amount                 int64 // minor units, before discounts and tax
	Currency               string
}

func invoiceOf(in *stripe.Invoice) Invoice {
	out := Invoice{ID: in.ID, Status: string(in.Status), BillingReason: string(in.BillingReason), AutoAdvance: in.AutoAdvance,
		AutomaticallyFinalizesAt: unixTime(in.AutomaticallyFinalizesAt), Created: unixTime(in.Created), Currency: string(in.Currency)}
	if in.Customer != nil {
		out.Customer = in.Customer.ID
	}
	if in.Parent != nil && in.Parent.SubscriptionDetails != nil && in.Parent.SubscriptionDetails.Subscription != nil {
		out.Subscription = in.Parent.SubscriptionDetails.Subscription.ID
	}
	if in.StatusTransitions != nil {
		out.FinalizedAt = unixTime(in.StatusTransitions.FinalizedAt)
	}
	return out
}

func lineOf(l *stripe.InvoiceLineItem) InvoiceLine {
	out := InvoiceLine{ID: l.ID, Quantity: l.Quantity, Amount: l.Amount, Currency: string(l.Currency)}
	if l.Parent != nil && l.Parent.SubscriptionItemDetails != nil {
		out.SubscriptionItem = l.Parent.SubscriptionItemDetails.SubscriptionItem
		out.Proration = l.Parent.SubscriptionItemDetails.Proration
	}
	if l.Pricing != nil && l.Pricing.PriceDetails != nil {
		out.Price = l.Pricing.PriceDetails.Price
	}
	if l.Period != nil {
		out.PeriodStart, out.PeriodEnd = unixTime(l.Period.Start), unixTime(l.Period.End)
	}
	return out
}

// Invoice reads an invoice of the client's account with every line (the
// invoice's embedded lines, or GET /v1/invoices/{id}/lines when they have
// more pages).
func (c *Client) Invoice(ctx context.Context, id string) (Invoice, error) {
	p := &stripe.InvoiceRetrieveParams{}
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	in, err := c.sc.V1Invoices.Retrieve(ctx, id, p)
	if err != nil {
		return Invoice{}, WrapError(err)
	}
	return c.withLines(ctx, in)
}

// withLines is in with all its lines.
func (c *Client) withLines(ctx context.Context, in *stripe.Invoice) (Invoice, error) {
	out := invoiceOf(in)
	if in.Lines != nil && !in.Lines.HasMore {
		for _, l := range in.Lines.Data {
			out.Lines = append(out.Lines, lineOf(l))
		}
		return out, nil
	}
	p := &stripe.InvoiceListLinesParams{Invoice: stripe.String(in.ID)}
	p.Limit = stripe.Int64(100)
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	for l, err := range c.sc.V1Invoices.ListLines(ctx, p) {
		if err != nil {
			return Invoice{}, WrapError(err)
		}
		out.Lines = append(out.Lines, lineOf(l))
	}
	return out, nil
}

// Invoices lists the customer's invoices created at or after since,
// newest first, each with every line.
func (c *Client) Invoices(ctx context.Context, customer string, since time.Time) ([]Invoice, error) {
	p := &stripe.InvoiceListParams{Customer: stripe.String(customer),
		CreatedRange: &stripe.RangeQueryParams{GreaterThanOrEqual: since.Unix()}}
	p.Limit = stripe.Int64(100)
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	var out []Invoice
	for in, err := range c.sc.V1Invoices.List(ctx, p) {
		if err != nil {
			return nil, WrapError(err)
		}
		inv, err := c.withLines(ctx, in)
		if err != nil {
			return nil, err
		}
		out = append(out, inv)
	}
	return out, nil
}

// SetAutoAdvance sets a draft's auto_advance: false holds it past its
// automatic finalization, true puts it back on Stripe's schedule. key is
// the request's idempotency key.
func (c *Client) SetAutoAdvance(ctx context.Context, id string, auto bool, key string) (Invoice, error) {
	p := &stripe.InvoiceUpdateParams{AutoAdvance: stripe.Bool(auto)}
	p.SetIdempotencyKey(key)
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	in, err := c.sc.V1Invoices.Update(ctx, id, p)
	if err != nil {
		return Invoice{}, WrapError(err)
	}
	return c.withLines(ctx, in)
}

// Finalize finalizes a draft now, with auto_advance true (Stripe then
// collects it as it would have). key is the request's idempotency key.
func (c *Client) Finalize(ctx context.Context, id string, key string) (Invoice, error) {
	p := &stripe.InvoiceFinalizeInvoiceParams{AutoAdvance: stripe.Bool(true)}
	p.SetIdempotencyKey(key)
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	in, err := c.sc.V1Invoices.FinalizeInvoice(ctx, id, p)
	if err != nil {
		return Invoice{}, WrapError(err)
	}
	return c.withLines(ctx, in)
}
