package doctor

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/mappings"
)

// sqlPeriods reads, per current tenant mapping, what the last read of its
// customer's subscriptions gave: whether it was read, the anchor's
// subscription, the problem. One row a tenant.
const sqlPeriods = `
SELECT t.tenant, t.stripe_customer_id, coalesce(t.stripe_account, ''), r.read_at IS NOT NULL,
       coalesce(r.subscription, ''), coalesce(r.problem, '')
FROM tenant_mappings t
LEFT JOIN stripe_subscription_reads r ON r.account = coalesce(t.stripe_account, '') AND r.customer = t.stripe_customer_id
ORDER BY t.tenant`

// periods checks the tenants' billing periods: that the key may read
// subscriptions (asked once, of the first tenant's customer), and which
// tenants bill by a subscription's periods, by their own anchor, or keep
// their own because their subscriptions cannot give one (a warning that
// names them).
func periods(ctx context.Context, d Deps) Result {
	rows, err := d.Pool.Query(ctx, sqlPeriods)
	if err != nil {
		return Result{Check: "billing periods", Status: Problem, Detail: "the periods could not be read: " + describe(err)}
	}
	type tenant struct {
		name, customer, account, subscription, problem string
		read                                           bool
	}
	var ts []tenant
	var t tenant
	if _, err := pgx.ForEachRow(rows, []any{&t.name, &t.customer, &t.account, &t.read, &t.subscription, &t.problem}, func() error {
		ts = append(ts, t)
		return nil
	}); err != nil {
		return Result{Check: "billing periods", Status: Problem, Detail: "the periods could not be read: " + describe(err)}
	}
	if len(ts) == 0 {
		return Result{Check: "billing periods", Status: OK, Detail: "no tenant is mapped"}
	}
	lister := mappings.StripeMeters{Client: d.Resolver.Client()}
	if _, err := lister.SubscriptionItems(ctx, ts[0].account, ts[0].customer); err != nil {
		var pu *mappings.ErrProviderUnavailable
		fix := "see the stripe check"
		if errors.As(err, &pu) && (pu.Status == 401 || pu.Status == 403) {
			fix = "a restricted key needs subscriptions (read) and invoices (read)"
		}
		return Result{Check: "billing periods", Status: Problem, Detail: "Stripe's subscriptions could not be read: " + describe(err),
			Fix: fix + "; until then tenants keep the periods last read"}
	}
	var bySubscription, unread int
	var kept []string
	for _, t := range ts {
		switch {
		case t.problem != "":
			kept = append(kept, fmt.Sprintf("%s (%s)", t.name, t.problem))
		case t.subscription != "":
			bySubscription++
		case !t.read:
			unread++
		}
	}
	detail := fmt.Sprintf("%d of %d mapped tenants bill by their subscription's periods, the others by their own anchor", bySubscription, len(ts))
	if unread > 0 {
		detail += fmt.Sprintf("; %d tenants' subscriptions not read yet (the hourly job reads them)", unread)
	}
	if len(kept) > 0 {
		return Result{Check: "billing periods", Status: Warning,
			Detail: detail + "; these keep their own anchor, as their subscriptions give none Tally can bill by: " + list(kept),
			Fix:    "Tally bills by monthly periods of one anchor: give each customer one monthly subscription on the mapped meters, or leave the tenant on its own anchor knowing its periods differ from its invoices'"}
	}
	return Result{Check: "billing periods", Status: OK, Detail: detail}
}
