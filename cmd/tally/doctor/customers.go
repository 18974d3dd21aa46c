package doctor

import (
	"context"
	"errors"
	"fmt"

	"github.com/tallymeter/tally/mappings"
)

// MaxCustomersChecked is the most distinct customers one doctor run asks
// Stripe about by default (Deps.MaxCustomers), one GET each: beyond it the
// check warns how many tenants it left out, rather than spend the
// account's rate limit (25 calls a second in test mode) on a diagnosis.
const MaxCustomersChecked = 200

// customers checks, at Stripe, that every mapped tenant's customer exists,
// not deleted, in the account the node exports to, or in the connected
// account the tenant's mapping names (stripe_account): the check every door
// makes when a tenant mapping is set (mappings.StripeMeters.CheckCustomer),
// again for the mappings saved before, without a key, or whose customer
// was deleted since. Each distinct customer (of each account) is asked once, at most
// Deps.MaxCustomers of them; it stops at the first that cannot be asked.
func customers(ctx context.Context, d Deps) Result {
	var st mappings.Store
	ts, err := st.Tenants(ctx, d.Pool)
	if err != nil {
		return Result{Check: "customers", Status: Problem, Detail: "the mappings could not be read: " + describe(err)}
	}
	checker := mappings.StripeMeters{Client: d.Resolver.Client()}
	verdict := map[[2]string]error{} // (account, customer)
	var bad []string
	skipped := 0
	for _, t := range ts {
		key := [2]string{t.StripeAccount, t.StripeCustomerID}
		err, asked := verdict[key]
		if !asked && len(verdict) >= d.MaxCustomers {
			skipped++
			continue
		}
		if !asked {
			err = checker.CheckCustomer(ctx, t.StripeAccount, t.StripeCustomerID)
			verdict[key] = err
		}
		var (
			ce *mappings.CustomerError
			ae *mappings.AccountError
		)
		switch {
		case errors.As(err, &ce) && t.StripeAccount != "":
			bad = append(bad, fmt.Sprintf("%s (%s in %s: %s)", t.Tenant, t.StripeCustomerID, t.StripeAccount, ce.Code))
		case errors.As(err, &ce):
			bad = append(bad, fmt.Sprintf("%s (%s: %s)", t.Tenant, t.StripeCustomerID, ce.Code))
		case errors.As(err, &ae):
			bad = append(bad, fmt.Sprintf("%s (%s: %s)", t.Tenant, t.StripeAccount, ae.Code))
		case err != nil:
			return Result{Check: "customers", Status: Problem, Detail: "Stripe's customers could not be read: " + describe(err),
				Fix: "see the stripe check; a restricted key needs customers (read)"}
		}
	}
	if len(bad) > 0 {
		return Result{Check: "customers", Status: Problem,
			Detail: "mapped tenants whose Stripe customer the account does not have, or deleted, or whose connected account the key may not act for (account_unreachable): " + list(bad),
			Fix:    "map each to a current customer of its account (tally mappings tenants set T --customer cus_… [--stripe-account acct_…]), or connect the account again; until then their usage is quarantined customer_not_found, or waits for the account"}
	}
	if skipped > 0 {
		return Result{Check: "customers", Status: Warning,
			Detail: fmt.Sprintf("the customers of %d mapped tenants exist in the account (the first %d distinct, by tenant); %d tenants not checked",
				len(ts)-skipped, d.MaxCustomers, skipped),
			Fix: "the mapping checks refuse a customer the account does not have when a tenant is set; to check the rest, set each again"}
	}
	return Result{Check: "customers", Status: OK,
		Detail: fmt.Sprintf("all %d mapped tenants' customers exist in the account (%d distinct)", len(ts), len(verdict))}
}
