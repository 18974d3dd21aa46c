package mappings_test

import (
	"context"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
)

// unreachable is a CustomerNamer that cannot ask Stripe.
type unreachable struct{}

func (unreachable) CustomerName(context.Context, string, string) (string, error) {
	return "", &mappings.ErrProviderUnavailable{Code: "api_connection_error", Status: 0}
}

// Stripe cannot be asked: nothing is kept, and the name read before stays.
func TestRefreshNamesKeepsTheLastNameWhenStripeCannotBeAsked(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	var plain mappings.Store // no checker: saved unchecked, no name read
	_, _, err := plain.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_acme"}, "x")
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO stripe_customer_names (account, customer, name, read_at) VALUES ('', 'cus_acme', 'Acme Corp', '2000-01-01')`)
	require.NoError(t, err)

	res, err := mappings.RefreshNames(ctx, pool, unreachable{}, time.Hour, 10)
	require.NoError(t, err)
	require.Equal(t, mappings.NamesRead{Unreadable: 1}, res)
	got, err := mappings.TenantCustomers(ctx, pool, []string{"acme"})
	require.NoError(t, err)
	require.Equal(t, "Acme Corp", got["acme"].Name)
}

// Saving a tenant mapping keeps its customer's name, read in the same
// request as the check; the job reads again the names older than its TTL
// (a rename in Stripe appears), a customer without a name or deleted since
// has none, and a mapping saved without a check is read on the next run.
func TestCustomerNamesKeptOnSaveAndRefreshed(t *testing.T) {
	t.Parallel()
	sim, s := simMeters(t)
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(srv.Close)
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	sc := c.Stripe()
	ctx, pool := context.Background(), testdb.New(t)
	rename := func(id, name string) {
		t.Helper()
		_, err := sc.V1Customers.Update(ctx, id, &stripe.CustomerUpdateParams{Name: stripe.String(name)})
		require.NoError(t, err)
	}
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_acme")
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_plain")
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_late")
	rename("cus_acme", "Acme Corp")
	rename("cus_late", "Late Ltd")

	_, _, err = s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_acme"}, "x")
	require.NoError(t, err)
	_, _, err = s.PutTenant(ctx, pool, "plain", mappings.TenantInput{StripeCustomerID: "cus_plain"}, "x")
	require.NoError(t, err)
	var unchecked mappings.Store
	_, _, err = unchecked.PutTenant(ctx, pool, "late", mappings.TenantInput{StripeCustomerID: "cus_late"}, "x")
	require.NoError(t, err)

	got, err := mappings.TenantCustomers(ctx, pool, []string{"acme", "plain", "late", "nobody"})
	require.NoError(t, err)
	require.Equal(t, map[string]mappings.TenantCustomer{
		"acme":  {Customer: "cus_acme", Name: "Acme Corp"},
		"plain": {Customer: "cus_plain"},
		"late":  {Customer: "cus_late"},
	}, got, "read when saved; never read yet; no mapping: absent")

	namer := mappings.StripeMeters{Client: c}
	res, err := mappings.RefreshNames(ctx, pool, namer, time.Hour, 10)
	require.NoError(t, err)
	require.Equal(t, mappings.NamesRead{Read: 1}, res, "only the name never read")

	rename("cus_acme", "Acme Corporation")
	deleteCustomer(t, sim, "cus_late")
	res, err = mappings.RefreshNames(ctx, pool, namer, time.Hour, 10)
	require.NoError(t, err)
	require.Equal(t, mappings.NamesRead{}, res, "younger than the TTL: not read again")
	got, err = mappings.TenantCustomers(ctx, pool, []string{"acme", "late"})
	require.NoError(t, err)
	require.Equal(t, "Acme Corp", got["acme"].Name)
	require.Equal(t, "Late Ltd", got["late"].Name)

	res, err = mappings.RefreshNames(ctx, pool, namer, 0, 10)
	require.NoError(t, err)
	require.Equal(t, mappings.NamesRead{Read: 3}, res)
	got, err = mappings.TenantCustomers(ctx, pool, []string{"acme", "plain", "late"})
	require.NoError(t, err)
	require.Equal(t, "Acme Corporation", got["acme"].Name, "renamed in Stripe")
	require.Empty(t, got["plain"].Name)
	require.Empty(t, got["late"].Name, "deleted since: no name")
}
