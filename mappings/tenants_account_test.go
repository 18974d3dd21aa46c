package mappings_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
)

// accountsOf lists each tenant's stripe_account, "-" for the node's.
func accountsOf(ts []mappings.Tenant) []string {
	out := make([]string, len(ts))
	for i, t := range ts {
		out[i] = "-"
		if t.StripeAccount != "" {
			out[i] = t.StripeAccount
		}
	}
	return out
}

// A tenant mapping's stripe_account is part of the mapping: stored, read
// back by every reader (staging's lookup too), a change of it alone is a
// new version, the same account again is no change, and "" goes back to
// the node's destination. The audit log and the history show it.
func TestTenantStripeAccount(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	put := func(account, by string) (mappings.Tenant, bool) {
		t.Helper()
		tn, changed, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_1", StripeAccount: account}, by)
		require.NoError(t, err)
		return tn, changed
	}

	v1, changed := put("acct_one", "alice")
	require.True(t, changed)
	require.Equal(t, "acct_one", v1.StripeAccount)
	got, err := s.GetTenant(ctx, pool, "acme")
	require.NoError(t, err)
	require.Equal(t, v1, got)
	list, err := s.Tenants(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, []mappings.Tenant{v1}, list)
	pair, err := s.Lookup(ctx, pool, "acme", "api")
	require.NoError(t, err)
	require.Equal(t, "acct_one", pair.Tenant.StripeAccount, "the stager reads it from the pair")

	same, changed := put("acct_one", "bob")
	require.False(t, changed, "the same account is no change")
	require.Equal(t, v1.Version, same.Version)
	require.Equal(t, "alice", same.UpdatedBy)

	v2, changed := put("acct_two", "carol")
	require.True(t, changed, "another account alone is a change")
	require.Greater(t, v2.Version, v1.Version)
	v3, changed := put("", "dan")
	require.True(t, changed, "back to the node's destination")
	require.Empty(t, v3.StripeAccount)
	_, changed = put("", "erin")
	require.False(t, changed)
	v4, changed := put("acct_one", "fay")
	require.True(t, changed)

	var stored *string
	require.NoError(t, pool.QueryRow(ctx, "SELECT stripe_account FROM tenant_mapping_versions WHERE version = $1", v3.Version).Scan(&stored))
	require.Nil(t, stored, "the node's destination is stored as NULL")

	hist, err := s.TenantHistory(ctx, pool, "acme")
	require.NoError(t, err)
	require.Equal(t, []string{"acct_one", "acct_two", "-", "acct_one"}, accountsOf(hist), "the history keeps each version's")
	require.Equal(t, v4.Version, hist[3].Version)

	entries, err := audit.List(ctx, pool, "tenant:acme", 10)
	require.NoError(t, err)
	require.Len(t, entries, 4, "one entry per change, none for the identical PUTs")
	require.Equal(t, fmt.Sprintf("v%d cus_1 account acct_one calendar months", v1.Version), entries[3].To)
	require.Equal(t, entries[3].To, entries[2].From)
	require.Equal(t, fmt.Sprintf("v%d cus_1 account acct_two calendar months", v2.Version), entries[2].To)
	require.Equal(t, fmt.Sprintf("v%d cus_1 calendar months", v3.Version), entries[1].To, "no account named: none shown")

	// Lookups of many pairs give each tenant its own account.
	_, _, err = s.PutTenant(ctx, pool, "globex", mappings.TenantInput{StripeCustomerID: "cus_2", StripeAccount: "acct_two"}, "x")
	require.NoError(t, err)
	_, _, err = s.PutTenant(ctx, pool, "initech", mappings.TenantInput{StripeCustomerID: "cus_3"}, "x")
	require.NoError(t, err)
	pairs, err := s.LookupMany(ctx, pool, map[[2]string]bool{{"acme", "api"}: true, {"globex", "api"}: true, {"initech", "api"}: true})
	require.NoError(t, err)
	require.Equal(t, "acct_one", pairs[[2]string{"acme", "api"}].Tenant.StripeAccount)
	require.Equal(t, "acct_two", pairs[[2]string{"globex", "api"}].Tenant.StripeAccount)
	require.Empty(t, pairs[[2]string{"initech", "api"}].Tenant.StripeAccount)
}

// An account that is not a Stripe account id is refused as a field
// problem, with every other problem of the input, and nothing is stored.
func TestTenantStripeAccountValidation(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	v1, _, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_1", StripeAccount: "acct_1"}, "x")
	require.NoError(t, err)
	const reason = "a Stripe account id (acct_…), or empty for this node's destination"
	for _, bad := range []string{"acct_", "acct", "acct1", "cus_1", "ACCT_1", " acct_1", "acct_1 ", "acct_a b", "acct_a-b", "acct_a.b",
		"acct_é", "acct_1\n", "acct_1\x00", "acct_" + strings.Repeat("a", 251)} {
		for _, tenant := range []string{"acme", "newco"} {
			_, _, err := s.PutTenant(ctx, pool, tenant, mappings.TenantInput{StripeCustomerID: "cus_1", StripeAccount: bad}, "x")
			var ve *mappings.ValidationError
			require.ErrorAs(t, err, &ve, "%q", bad)
			require.Equal(t, []mappings.FieldError{{Field: "stripe_account", Reason: reason}}, ve.Fields, "%q", bad)
		}
	}
	_, _, err = s.PutTenant(ctx, pool, "a b", mappings.TenantInput{StripeCustomerID: "acct_1", StripeAccount: "cus_1"}, "x")
	var ve *mappings.ValidationError
	require.ErrorAs(t, err, &ve)
	require.Equal(t, []string{"tenant", "stripe_customer_id", "stripe_account"},
		[]string{ve.Fields[0].Field, ve.Fields[1].Field, ve.Fields[2].Field}, "every problem is named")
	refusal, ok := mappings.RefusalOf(err)
	require.True(t, ok)
	require.Equal(t, mappings.CodeInvalidMapping, refusal.Code)

	got, err := s.GetTenant(ctx, pool, "acme")
	require.NoError(t, err)
	require.Equal(t, v1, got, "nothing stored")
	_, err = s.GetTenant(ctx, pool, "newco")
	require.ErrorIs(t, err, mappings.ErrNotFound, "nothing stored")
	hist, err := s.TenantHistory(ctx, pool, "acme")
	require.NoError(t, err)
	require.Len(t, hist, 1)

	longest := "acct_" + strings.Repeat("a", 250)
	_, _, err = s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_1", StripeAccount: longest}, "x")
	require.NoError(t, err, "255 characters")
	for _, good := range []string{"", "acct_1", "acct_1AbC_xyz", longest} {
		require.True(t, mappings.ValidStripeAccount(good), good)
	}
	require.False(t, mappings.ValidStripeAccount("acct_"))
}

// The database holds stripe_account to the migration's pattern and length
// in both tables, whoever writes it.
func TestTenantStripeAccountInTheDatabase(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	_, _, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_1"}, "x")
	require.NoError(t, err)
	for _, bad := range []string{"", "acct_", "cus_1", "acct_a-b", "acct_" + strings.Repeat("a", 251)} {
		_, err := pool.Exec(ctx, "UPDATE tenant_mappings SET stripe_account = $1", bad)
		require.ErrorContains(t, err, "tenant_mappings_stripe_account_check", bad)
		_, err = pool.Exec(ctx, `INSERT INTO tenant_mapping_versions (version, tenant, stripe_customer_id, stripe_account, changed_by)
			VALUES (nextval('mapping_version_seq'), 'acme', 'cus_1', $1, 'x')`, bad)
		require.ErrorContains(t, err, "tenant_mapping_versions_stripe_account_check", bad)
	}
	_, err = pool.Exec(ctx, "UPDATE tenant_mappings SET stripe_account = $1", "acct_"+strings.Repeat("a", 250))
	require.NoError(t, err)
}

// Migration 28 goes down and up again: the column and its CHECK are gone,
// then back, empty.
func TestMigrationOfTheStripeAccount(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS("../migrations"), goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	columns := func() int {
		t.Helper()
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.columns
			WHERE column_name = 'stripe_account' AND table_name IN ('tenant_mappings', 'tenant_mapping_versions')`).Scan(&n))
		return n
	}
	require.Equal(t, 2, columns())
	_, err = p.ApplyVersion(ctx, 28, false)
	require.NoError(t, err)
	require.Zero(t, columns())
	_, err = p.ApplyVersion(ctx, 28, true)
	require.NoError(t, err)
	require.Equal(t, 2, columns())
}

// Accounts lists every account any version of any tenant mapping named,
// once each, sorted; CurrentAccounts counts the tenants of each account
// current mappings name. Neither counts the node's destination.
func TestAccounts(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	accounts, err := mappings.Accounts(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, accounts)
	current, err := mappings.CurrentAccounts(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, current)

	for _, m := range []struct{ tenant, account string }{
		{"acme", "acct_b"}, {"acme", "acct_a"}, {"globex", "acct_a"}, {"initech", ""}, {"umbrella", "acct_Z"},
		{"umbrella", "acct_c"}, {"hooli", "acct_c"}, {"hooli", ""}, {"piper", "acct_c"},
	} {
		_, _, err := s.PutTenant(ctx, pool, m.tenant, mappings.TenantInput{StripeCustomerID: "cus_1", StripeAccount: m.account}, "x")
		require.NoError(t, err)
	}
	accounts, err = mappings.Accounts(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, []string{"acct_Z", "acct_a", "acct_b", "acct_c"}, accounts, "every account ever named, in byte order")
	current, err = mappings.CurrentAccounts(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, map[string]int{"acct_a": 2, "acct_c": 2}, current, "the current mappings' only")
}

// checkedStore is a Store checked against a simulator whose connected
// accounts' refusals answer status (account_invalid): the platform account
// stripesim.DefaultAccount has the customer cus_platform; the connected
// account acct_one has cus_one and cus_gone (deleted); acct_two has none;
// acct_revoked has cus_r, and the platform's access to it is revoked.
func checkedStore(t *testing.T, status int) (*mappings.Store, *stripesim.Server) {
	t.Helper()
	sim := stripesim.New(stripesim.Options{AccountInvalidStatus: status})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.AddAccount("acct_two")
	sim.CreateCustomer("acct_one", "cus_one")
	sim.CreateCustomer("acct_one", "cus_gone")
	sim.CreateCustomer("acct_revoked", "cus_r")
	sim.RevokeAccess("acct_revoked")
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_platform")
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	p := &stripe.CustomerDeleteParams{}
	p.SetStripeAccount("acct_one")
	_, err = c.Stripe().V1Customers.Delete(context.Background(), "cus_gone", p)
	require.NoError(t, err)
	return &mappings.Store{Checker: mappings.StripeMeters{Client: c}}, sim
}

// With a Checker, a tenant mapping that names a connected account is
// saved only when the platform's key may act for the account and the
// customer is a current one of that account — not of the platform's: an
// unknown or revoked account is refused account_unreachable (whatever 4xx
// Stripe gives account_invalid), a customer the account lacks or deleted
// customer_not_found or customer_deleted naming the account, and nothing
// is saved. Restored, the account is accepted; cleared, the mapping goes
// back to the node's account, whose customer it must then be.
func TestTenantStripeAccountChecks(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusForbidden, http.StatusBadRequest} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			t.Parallel()
			ctx, pool := context.Background(), testdb.New(t)
			s, sim := checkedStore(t, status)
			put := func(customer, account string) (mappings.Tenant, error) {
				t.Helper()
				tn, _, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: customer, StripeAccount: account}, "x")
				return tn, err
			}
			refused := func(customer, account, code string, says ...string) {
				t.Helper()
				_, err := put(customer, account)
				refusal, ok := mappings.RefusalOf(err)
				require.True(t, ok, "%s in %s: %v", customer, account, err)
				require.Equal(t, code, refusal.Code, "%s in %s: %s", customer, account, refusal.Message)
				require.False(t, refusal.Unavailable)
				for _, w := range says {
					require.Contains(t, refusal.Message, w, "%s in %s", customer, account)
				}
			}

			refused("cus_r", "acct_revoked", mappings.CodeAccountUnreachable,
				"the platform's key may not act for Stripe account acct_revoked (not connected, or access revoked); connect it first or leave stripe_account empty")
			var ae *mappings.AccountError
			_, err := put("cus_r", "acct_revoked")
			require.ErrorAs(t, err, &ae)
			require.Equal(t, "acct_revoked", ae.Account)
			refused("cus_one", "acct_unknown", mappings.CodeAccountUnreachable, "acct_unknown")
			refused("cus_platform", "acct_one", mappings.CodeCustomerNotFound,
				"Stripe has no customer cus_platform in Stripe account acct_one (the tenant mapping's stripe_account")
			refused("cus_gone", "acct_one", mappings.CodeCustomerDeleted, "cus_gone is deleted in Stripe account acct_one")
			refused("cus_one", "acct_two", mappings.CodeCustomerNotFound, "acct_two")
			refused("cus_one", "", mappings.CodeCustomerNotFound, "in the account this node exports to")
			_, err = s.GetTenant(ctx, pool, "acme")
			require.ErrorIs(t, err, mappings.ErrNotFound, "nothing saved")

			v1, err := put("cus_one", "acct_one")
			require.NoError(t, err)
			require.Equal(t, "acct_one", v1.StripeAccount)

			sim.RestoreAccess("acct_revoked")
			v2, err := put("cus_r", "acct_revoked")
			require.NoError(t, err, "restored")
			require.Greater(t, v2.Version, v1.Version)

			sim.RevokeAccess("acct_revoked")
			refused("cus_r", "acct_revoked", mappings.CodeAccountUnreachable)
			_, err = put("cus_r", "")
			require.Error(t, err, "cleared, the customer must be the node's account's")
			v3, err := put("cus_platform", "")
			require.NoError(t, err, "cleared: the node's account again")
			require.Empty(t, v3.StripeAccount)
			hist, err := s.TenantHistory(ctx, pool, "acme")
			require.NoError(t, err)
			require.Equal(t, []string{"acct_one", "acct_revoked", "-"}, accountsOf(hist))
		})
	}
}

// CheckAccount and CheckCustomer of a connected account against a Stripe
// that answers otherwise: 401 or 403 to the account call is
// account_unreachable; any other failure is ErrProviderUnavailable (try
// again), as for the node's own account. The calls carry Stripe-Account.
func TestStripeAccountCheckFailures(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		status int
		body   string
		want   string // a refusal code, or "" for ErrProviderUnavailable
	}{
		{http.StatusUnauthorized, `{"error":{"type":"invalid_request_error","message":"no"}}`, mappings.CodeAccountUnreachable},
		{http.StatusForbidden, `{"error":{"type":"invalid_request_error","message":"no"}}`, mappings.CodeAccountUnreachable},
		{http.StatusBadRequest, `{"error":{"type":"invalid_request_error","code":"account_invalid","message":"no"}}`, mappings.CodeAccountUnreachable},
		{http.StatusNotFound, `{"error":{"type":"invalid_request_error","code":"account_invalid","message":"no"}}`, mappings.CodeAccountUnreachable},
		{http.StatusInternalServerError, `{"error":{"type":"api_error","message":"boom"}}`, ""},
		{http.StatusTooManyRequests, `{"error":{"type":"invalid_request_error","code":"rate_limit","message":"slow down"}}`, ""},
		{http.StatusBadRequest, `{"error":{"type":"invalid_request_error","code":"parameter_unknown","message":"no"}}`, ""},
	} {
		var headers []string
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			headers = append(headers, r.Header.Get("Stripe-Account"))
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(tc.status)
			_, _ = w.Write([]byte(tc.body))
		}))
		c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
		require.NoError(t, err)
		checker := mappings.StripeMeters{Client: c}
		err = checker.CheckAccount(context.Background(), "acct_one")
		srv.Close()
		require.Equal(t, []string{"acct_one"}, headers)
		refusal, ok := mappings.RefusalOf(err)
		require.True(t, ok, "%d %s: %v", tc.status, tc.body, err)
		if tc.want == "" {
			var pu *mappings.ErrProviderUnavailable
			require.ErrorAs(t, err, &pu, "%d %s", tc.status, tc.body)
			require.Equal(t, tc.status, pu.Status)
			require.Equal(t, mappings.CodeStripeUnavailable, refusal.Code)
			require.True(t, refusal.Unavailable)
			continue
		}
		require.Equal(t, tc.want, refusal.Code, "%d %s", tc.status, tc.body)
		require.False(t, refusal.Unavailable)
	}

	// The customer call of a connected account: account_invalid is the
	// account's refusal; a 403 without it is the key's (a restricted key
	// without customers (read)), as for the node's account.
	for _, tc := range []struct {
		status int
		body   string
		want   string
	}{
		{http.StatusForbidden, `{"error":{"type":"invalid_request_error","code":"account_invalid","message":"no"}}`, mappings.CodeAccountUnreachable},
		{http.StatusForbidden, `{"error":{"type":"invalid_request_error","message":"restricted"}}`, mappings.CodeStripeUnavailable},
		{http.StatusInternalServerError, `{"error":{"type":"api_error","message":"boom"}}`, mappings.CodeStripeUnavailable},
	} {
		var headers []string
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			headers = append(headers, r.Header.Get("Stripe-Account"))
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(tc.status)
			_, _ = w.Write([]byte(tc.body))
		}))
		c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
		require.NoError(t, err)
		err = mappings.StripeMeters{Client: c}.CheckCustomer(context.Background(), "acct_one", "cus_1")
		srv.Close()
		require.Equal(t, []string{"acct_one"}, headers)
		refusal, ok := mappings.RefusalOf(err)
		require.True(t, ok, "%v", err)
		require.Equal(t, tc.want, refusal.Code, "%d %s", tc.status, tc.body)
	}
}
