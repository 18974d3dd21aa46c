package stripesim_test

import (
	"context"
	"errors"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

// Retrieving a customer, as Stripe answers it: an unknown id is 404
// resource_missing ("No such customer"); a deleted customer still answers,
// as {id, object: "customer", deleted: true} — "If it's for a deleted
// Customer, a subset of the customer's information is returned, including a
// deleted property that's set to true"
// (https://docs.stripe.com/api/customers/retrieve), the deleted_customer
// object of https://docs.stripe.com/api/customers/delete; stripe-go v82
// decodes both into stripe.Customer (customer.go, Deleted).
func TestCustomerRetrieveUnknownDeletedAndActive(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	sc := client(ts, testKey)
	ctx := context.Background()

	_, err := sc.V1Customers.Retrieve(ctx, "cus_nobody", nil)
	var se *stripe.Error
	require.True(t, errors.As(err, &se), "%v", err)
	require.Equal(t, http.StatusNotFound, se.HTTPStatusCode)
	require.Equal(t, stripe.ErrorCodeResourceMissing, se.Code)
	require.Equal(t, "id", se.Param)
	require.Equal(t, "No such customer: 'cus_nobody'", se.Msg)

	sim.CreateCustomer(acct, "cus_gone")
	cu, err := sc.V1Customers.Retrieve(ctx, "cus_gone", nil)
	require.NoError(t, err)
	require.Equal(t, "cus_gone", cu.ID)
	require.False(t, cu.Deleted)

	del, err := sc.V1Customers.Delete(ctx, "cus_gone", nil)
	require.NoError(t, err)
	require.Equal(t, "cus_gone", del.ID)
	require.True(t, del.Deleted)

	r := do(t, ts, http.MethodGet, "/v1/customers/cus_gone", testKey, nil, nil)
	require.Equal(t, http.StatusOK, r.status)
	require.Equal(t, map[string]any{"id": "cus_gone", "object": "customer", "deleted": true}, r.body, "only the deleted subset")
	cu, err = sc.V1Customers.Retrieve(ctx, "cus_gone", nil)
	require.NoError(t, err)
	require.True(t, cu.Deleted)

	_, err = sc.V1Customers.Delete(ctx, "cus_gone", nil)
	require.True(t, errors.As(err, &se), "deleting twice: %v", err)
	require.Equal(t, http.StatusNotFound, se.HTTPStatusCode)

	// A customer of one mode or account is unknown to the other.
	_, err = client(ts, liveKey).V1Customers.Retrieve(ctx, "cus_nobody", nil)
	require.True(t, errors.As(err, &se))
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_elsewhere")
	_, err = sc.V1Customers.Retrieve(ctx, "cus_elsewhere", nil)
	require.True(t, errors.As(err, &se), "another account's customer")
	require.Equal(t, http.StatusNotFound, se.HTTPStatusCode)
}

// A customer's name, "The customer's full name or business name" (nullable,
// https://docs.stripe.com/api/customers/object), is answered as created and
// as last updated ("Any parameters not provided will be left unchanged",
// https://docs.stripe.com/api/customers/update); a customer made without
// one answers name null, which stripe-go v82 decodes as "".
func TestCustomerNameCreatedUpdatedAndRetrieved(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	sc := client(ts, testKey)
	ctx := context.Background()

	cu, err := sc.V1Customers.Create(ctx, &stripe.CustomerCreateParams{Name: stripe.String("Acme Corp"), Email: stripe.String("billing@acme.test")})
	require.NoError(t, err)
	got, err := sc.V1Customers.Retrieve(ctx, cu.ID, nil)
	require.NoError(t, err)
	require.Equal(t, "Acme Corp", got.Name)

	_, err = sc.V1Customers.Update(ctx, cu.ID, &stripe.CustomerUpdateParams{Name: stripe.String("Acme Corporation")})
	require.NoError(t, err)
	got, err = sc.V1Customers.Retrieve(ctx, cu.ID, nil)
	require.NoError(t, err)
	require.Equal(t, "Acme Corporation", got.Name)
	require.Equal(t, "billing@acme.test", got.Email, "what the update did not name is left unchanged")

	sim.CreateCustomer(acct, "cus_plain")
	r := do(t, ts, http.MethodGet, "/v1/customers/cus_plain", testKey, nil, nil)
	require.Equal(t, http.StatusOK, r.status)
	require.Contains(t, r.body, "name")
	require.Nil(t, r.body["name"], "no name: null")

	_, err = sc.V1Customers.Update(ctx, "cus_nobody", &stripe.CustomerUpdateParams{Name: stripe.String("x")})
	var se *stripe.Error
	require.True(t, errors.As(err, &se), "%v", err)
	require.Equal(t, http.StatusNotFound, se.HTTPStatusCode)
	require.Equal(t, stripe.ErrorCodeResourceMissing, se.Code)
}
