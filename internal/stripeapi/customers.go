package stripeapi

import (
	"context"
	"errors"
	"net/http"

	"github.com/stripe/stripe-go/v82"
)

// CustomerState is what the account says of a customer id.
type CustomerState int

// The states of a customer id.
const (
	// CustomerMissing: the account has no customer with the id (Stripe
	// answers 404 resource_missing).
	CustomerMissing CustomerState = iota
	// CustomerActive: the account has the customer.
	CustomerActive
	// CustomerDeleted: the account deleted the customer; Stripe still
	// answers its id, with deleted: true.
	CustomerDeleted
)

// Customer retrieves a customer of the client's account (GET
// /v1/customers/{id}) and says whether it exists, was deleted, or is
// unknown there. "Returns the Customer object for a valid identifier. If
// it's for a deleted Customer, a subset of the customer's information is
// returned, including a deleted property that's set to true"
// (https://docs.stripe.com/api/customers/retrieve); an unknown id is 404
// resource_missing. Any other failure is an *Error.
func (c *Client) Customer(ctx context.Context, id string) (CustomerState, error) {
	cu, err := c.CustomerOf(ctx, id)
	return cu.State, err
}

// CustomerInfo is what the account says of a customer id: its state and,
// while active, its name ("The customer's full name or business name",
// nullable: "" when it has none).
type CustomerInfo struct {
	State CustomerState
	Name  string
}

// CustomerOf is Customer with the customer's name: one request.
func (c *Client) CustomerOf(ctx context.Context, id string) (CustomerInfo, error) {
	p := &stripe.CustomerRetrieveParams{}
	if c.account != "" {
		p.SetStripeAccount(c.account)
	}
	cu, err := c.sc.V1Customers.Retrieve(ctx, id, p)
	if err != nil {
		var se *stripe.Error
		if errors.As(err, &se) && se.HTTPStatusCode == http.StatusNotFound && se.Code == stripe.ErrorCodeResourceMissing {
			return CustomerInfo{State: CustomerMissing}, nil
		}
		return CustomerInfo{State: CustomerMissing}, WrapError(err)
	}
	if cu.Deleted {
		return CustomerInfo{State: CustomerDeleted}, nil
	}
	if cu.ID != id {
		return CustomerInfo{State: CustomerMissing}, &Error{Code: CodeBadResponse, HTTPStatus: http.StatusOK, message: "Stripe answered another customer than the one asked for"}
	}
	return CustomerInfo{State: CustomerActive, Name: cu.Name}, nil
}
