package stripeapi

import (
	"context"
	"encoding/json"
	"errors"

	"github.com/stripe/stripe-go/v82"
)

// Price reads a price of the client's account with its tiers and currency
// options expanded (neither is in the response otherwise), and returns it
// with the JSON Stripe sent, for keeping.
func (c *Client) Price(ctx context.Context, id string) (*stripe.Price, json.RawMessage, error) {
	p := &stripe.PriceRetrieveParams{}
	p.AddExpand("tiers")
	p.AddExpand("currency_options")
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	pr, err := c.sc.V1Prices.Retrieve(ctx, id, p)
	if err != nil {
		return nil, nil, WrapError(err)
	}
	if pr.LastResponse == nil || !json.Valid(pr.LastResponse.RawJSON) {
		return nil, nil, errors.New("stripeapi: the price came without its JSON")
	}
	return pr, json.RawMessage(pr.LastResponse.RawJSON), nil
}
