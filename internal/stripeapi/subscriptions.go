package stripeapi

import (
	"context"
	"time"

	"github.com/stripe/stripe-go/v82"
)

// SubscriptionItem is one metered item of a customer's subscription, as
// Tally needs it to know the customer's billing periods.
type SubscriptionItem struct {
	ID           string // si_…
	Subscription string // sub_…
	// Status is the subscription's status (active, past_due, canceled, …).
	Status   string
	Currency string
	Price    string // price_…
	// Meter is the meter the item's price bills (price.recurring.meter).
	Meter string
	// Interval and IntervalCount are the price's billing frequency
	// (month and 1 for a monthly price).
	Interval      string
	IntervalCount int64
	// BillingCycleAnchor is the subscription's: it sets the day of the
	// month (and the time) each period starts on.
	BillingCycleAnchor time.Time
	// CurrentPeriodStart and CurrentPeriodEnd are the item's current
	// period.
	CurrentPeriodStart, CurrentPeriodEnd time.Time
	StartDate                            time.Time
	// EndedAt is when the subscription ended; zero while it has not.
	EndedAt time.Time
}

// unixTime is a Unix time of Stripe's; zero for 0 (Stripe's null).
func unixTime(s int64) time.Time {
	if s == 0 {
		return time.Time{}
	}
	return time.Unix(s, 0).UTC()
}

// SubscriptionItems lists the metered items (a price with
// recurring.usage_type metered) of every subscription of the customer in
// the client's account, whatever their status (status=all, which includes
// canceled ones), reading every page; a subscription whose embedded item
// list has more pages is read through the subscription items list. Each
// item embeds its price ("Subscription items ... each with an attached
// price", the subscription object's reference).
func (c *Client) SubscriptionItems(ctx context.Context, customer string) ([]SubscriptionItem, error) {
	p := &stripe.SubscriptionListParams{Customer: stripe.String(customer), Status: stripe.String("all")}
	p.Limit = stripe.Int64(100)
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	var out []SubscriptionItem
	for s, err := range c.sc.V1Subscriptions.List(ctx, p) {
		if err != nil {
			return nil, WrapError(err)
		}
		items, err := c.itemsOf(ctx, s)
		if err != nil {
			return nil, err
		}
		for _, it := range items {
			pr := it.Price
			if pr == nil || pr.Recurring == nil || pr.Recurring.UsageType != stripe.PriceRecurringUsageTypeMetered {
				continue
			}
			out = append(out, SubscriptionItem{
				ID: it.ID, Subscription: s.ID, Status: string(s.Status), Currency: string(pr.Currency),
				Price: pr.ID, Meter: pr.Recurring.Meter,
				Interval: string(pr.Recurring.Interval), IntervalCount: pr.Recurring.IntervalCount,
				BillingCycleAnchor: unixTime(s.BillingCycleAnchor),
				CurrentPeriodStart: unixTime(it.CurrentPeriodStart), CurrentPeriodEnd: unixTime(it.CurrentPeriodEnd),
				StartDate: unixTime(s.StartDate), EndedAt: unixTime(s.EndedAt),
			})
		}
	}
	return out, nil
}

// itemsOf is a subscription's items: the embedded list, or all of them
// from the subscription items list when the embedded one has more.
func (c *Client) itemsOf(ctx context.Context, s *stripe.Subscription) ([]*stripe.SubscriptionItem, error) {
	if s.Items != nil && !s.Items.HasMore {
		return s.Items.Data, nil
	}
	p := &stripe.SubscriptionItemListParams{Subscription: stripe.String(s.ID)}
	p.Limit = stripe.Int64(100)
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	var out []*stripe.SubscriptionItem
	for it, err := range c.sc.V1SubscriptionItems.List(ctx, p) {
		if err != nil {
			return nil, WrapError(err)
		}
		out = append(out, it)
	}
	return out, nil
}
