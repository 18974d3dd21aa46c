package mappings_test

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
)

// A tenant mapping's customer must exist, not deleted, in the account the
// node exports to: an unknown or a deleted customer is refused with its
// code and nothing is written, even when the mapping would be no change;
// a current customer is saved, with no warning.
func TestTenantCustomerMustExistInTheAccount(t *testing.T) {
	t.Parallel()
	sim, s := simMeters(t)
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_acme")
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_gone")
	sim.CreateCustomer("acct_other", "cus_elsewhere")
	ctx, pool := context.Background(), testdb.New(t)
	deleteCustomer(t, sim, "cus_gone")

	for _, tc := range []struct{ customer, code string }{
		{"cus_nobody", mappings.CodeCustomerNotFound},
		{"cus_elsewhere", mappings.CodeCustomerNotFound},
		{"cus_gone", mappings.CodeCustomerDeleted},
	} {
		_, _, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: tc.customer}, "x")
		var ce *mappings.CustomerError
		require.ErrorAs(t, err, &ce, tc.customer)
		require.Equal(t, tc.code, ce.Code, tc.customer)
		require.Contains(t, ce.Message, tc.customer)
	}
	_, err := s.GetTenant(ctx, pool, "acme")
	require.ErrorIs(t, err, mappings.ErrNotFound, "a refused mapping is not written")

	tn, changed, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_acme"}, "x")
	require.NoError(t, err)
	require.True(t, changed)
	require.Empty(t, s.Warning())
	entries, err := audit.List(ctx, pool, "tenant:acme", 10)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Empty(t, entries[0].Reason, "checked")

	// Deleted since: the same mapping again is refused, and the current
	// one stays.
	deleteCustomer(t, sim, "cus_acme")
	_, _, err = s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_acme"}, "x")
	refusal, ok := mappings.RefusalOf(err)
	require.True(t, ok, "%v", err)
	require.Equal(t, mappings.CodeCustomerDeleted, refusal.Code)
	got, err := s.GetTenant(ctx, pool, "acme")
	require.NoError(t, err)
	require.Equal(t, tn.Version, got.Version)
}

// Stripe unreachable or refusing the key: nothing is saved, and the
// refusal says to try again.
func TestTenantCustomerUncheckableIsNotSaved(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	bad, err := stripeapi.New(stripeapi.Config{Key: "sk_test_wrong", APIBase: srv.URL})
	require.NoError(t, err)
	s := &mappings.Store{Checker: mappings.StripeMeters{Client: bad}}
	ctx, pool := context.Background(), testdb.New(t)
	_, _, err = s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_acme"}, "x")
	refusal, ok := mappings.RefusalOf(err)
	require.True(t, ok, "%v", err)
	require.Equal(t, mappings.Refusal{Code: mappings.CodeStripeUnavailable, Unavailable: true,
		Message: "the mapping could not be checked against Stripe (invalid_request_error, status 401); nothing was saved: " +
			"check STRIPE_API_KEY and STRIPE_ACCOUNT; a restricted key needs meters and customers (read)"}, refusal)
	_, err = s.GetTenant(ctx, pool, "acme")
	require.ErrorIs(t, err, mappings.ErrNotFound)
}

// Without a Checker (no Stripe key) mappings are saved unchecked: the
// store's Warning says so, and so does each change's audit entry.
func TestUncheckedMappingsAreSavedWithAWarningRecorded(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	require.Equal(t, mappings.UncheckedWarning, s.Warning())
	_, _, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_typo"}, "x")
	require.NoError(t, err)
	_, _, err = s.PutFeature(ctx, pool, "api", mappings.FeatureInput{EventName: "api_callz", Aggregation: mappings.Sum}, "x")
	require.NoError(t, err)
	for _, subject := range []string{"tenant:acme", "feature:api"} {
		entries, err := audit.List(ctx, pool, subject, 10)
		require.NoError(t, err)
		require.Len(t, entries, 1, subject)
		require.Equal(t, mappings.UncheckedReason, entries[0].Reason, subject)
	}
}

// RefusalOf gives every door the same code and message for each refusal,
// and nothing for an error that is not one.
func TestRefusalOfEachRefusal(t *testing.T) {
	t.Parallel()
	fields := []mappings.FieldError{{Field: "stripe_customer_id", Reason: "a Stripe customer id (cus_…)"}}
	for _, tc := range []struct {
		err  error
		want mappings.Refusal
		ok   bool
	}{
		{&mappings.ValidationError{Fields: fields}, mappings.Refusal{Code: "invalid_mapping",
			Message: "invalid input: stripe_customer_id: a Stripe customer id (cus_…)", Fields: fields}, true},
		{fmt.Errorf("wrapped: %w", &mappings.MeterError{Code: "meter_not_found", Message: "m"}), mappings.Refusal{Code: "meter_not_found", Message: "m"}, true},
		{&mappings.CustomerError{Code: "customer_deleted", Message: "c"}, mappings.Refusal{Code: "customer_deleted", Message: "c"}, true},
		{&mappings.ErrProviderUnavailable{Code: "network_error"}, mappings.Refusal{Code: "stripe_unavailable", Unavailable: true,
			Message: "the mapping could not be checked against Stripe (network_error, status 0); nothing was saved: try again"}, true},
		{errors.New("database down"), mappings.Refusal{}, false},
	} {
		got, ok := mappings.RefusalOf(tc.err)
		require.Equal(t, tc.ok, ok, "%v", tc.err)
		require.Equal(t, tc.want, got, "%v", tc.err)
	}
}

// deleteCustomer deletes a customer of the simulator's default account
// through stripe-go, as Stripe's dashboard or API would.
func deleteCustomer(t *testing.T, sim *stripesim.Server, id string) {
	t.Helper()
	srv := httptest.NewServer(sim.Handler())
	defer srv.Close()
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	_, err = c.Stripe().V1Customers.Delete(context.Background(), id, nil)
	require.NoError(t, err)
}
