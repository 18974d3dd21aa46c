package mappings_test

import (
	"context"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
)

// billingSim is the simulator with two meters, of which the feature
// mapping "api" names one, and a Store that checks and reads periods
// through stripe-go.
type billingSim struct {
	sim          *stripesim.Server
	sc           *stripe.Client
	client       *stripeapi.Client
	store        *mappings.Store
	pool         *pgxpool.Pool
	url          string
	mapped, free stripesim.Meter
}

func newBillingSim(t *testing.T) *billingSim {
	t.Helper()
	return newBillingSimOn(t, testdb.New(t))
}

func newBillingSimOn(t *testing.T, pool *pgxpool.Pool) *billingSim {
	t.Helper()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(srv.Close)
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	b := &billingSim{sim: sim, sc: c.Stripe(), client: c, pool: pool, url: srv.URL,
		mapped: sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "api_calls"}),
		free:   sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "other_calls"})}
	b.store = &mappings.Store{Checker: mappings.StripeMeters{Client: c}, Subscriptions: mappings.StripeMeters{Client: c}}
	ctx := context.Background()
	for _, m := range []stripesim.Meter{b.mapped, b.free} {
		_, err := b.pool.Exec(ctx, `INSERT INTO stripe_meters (account, mode, id, event_name, status, formula)
			VALUES ('acct_sim', 'test', $1, $2, 'active', 'sum')`, m.ID, m.EventName)
		require.NoError(t, err)
	}
	_, _, err = b.store.PutFeature(ctx, b.pool, "api", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum}, "alice")
	require.NoError(t, err)
	return b
}

// subscribe gives customer a subscription to a metered price of meter,
// billed every count interval, anchored at anchor.
func (b *billingSim) subscribe(t *testing.T, customer string, meter stripesim.Meter, interval string, count int64, anchor time.Time) *stripe.Subscription {
	t.Helper()
	ctx := context.Background()
	price, err := b.sc.V1Prices.Create(ctx, &stripe.PriceCreateParams{
		Currency: stripe.String("usd"), UnitAmount: stripe.Int64(2),
		ProductData: &stripe.PriceCreateProductDataParams{Name: stripe.String("API calls")},
		Recurring: &stripe.PriceCreateRecurringParams{Interval: stripe.String(interval), IntervalCount: stripe.Int64(count),
			UsageType: stripe.String("metered"), Meter: stripe.String(meter.ID)},
	})
	require.NoError(t, err)
	sub, err := b.sc.V1Subscriptions.Create(ctx, &stripe.SubscriptionCreateParams{
		Customer:           stripe.String(customer),
		Items:              []*stripe.SubscriptionCreateItemParams{{Price: stripe.String(price.ID)}},
		BillingCycleAnchor: stripe.Int64(anchor.Unix()),
	})
	require.NoError(t, err)
	return sub
}

// anchorIn is a time days from now, to the second, as a billing cycle
// anchor must be in the future.
func anchorIn(days int) time.Time {
	return time.Now().UTC().Add(time.Duration(days) * 24 * time.Hour).Truncate(time.Second)
}

// A tenant whose customer subscribes to a monthly price of a mapped meter
// bills by its periods from the moment it is mapped: its anchor is the
// subscription's, an operator's other anchor is refused, and leaving the
// anchor out keeps the subscription's.
func TestTenantTakesItsSubscriptionsAnchor(t *testing.T) {
	t.Parallel()
	ctx, b := context.Background(), newBillingSim(t)
	cus := b.sim.CreateCustomer(stripesim.DefaultAccount, "")
	anchor := anchorIn(11)
	sub := b.subscribe(t, cus, b.mapped, "month", 1, anchor)

	tn, changed, err := b.store.PutTenant(ctx, b.pool, "acme", mappings.TenantInput{StripeCustomerID: cus}, "alice")
	require.NoError(t, err)
	require.True(t, changed)
	require.NotNil(t, tn.PeriodAnchor)
	require.True(t, anchor.Equal(*tn.PeriodAnchor), "anchor %s, want %s", tn.PeriodAnchor, anchor)
	p, read, err := mappings.StoredPeriods(ctx, b.pool, "", cus)
	require.NoError(t, err)
	require.True(t, read)
	require.Equal(t, sub.ID, p.Subscription)
	require.Empty(t, p.Problem)

	var end time.Time
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT current_period_end FROM stripe_subscription_items WHERE customer = $1`, cus).Scan(&end))
	require.True(t, anchor.Equal(end), "the first period ends at the anchor")

	hand := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	_, _, err = b.store.PutTenant(ctx, b.pool, "acme", mappings.TenantInput{StripeCustomerID: cus, PeriodAnchor: &hand}, "bob")
	var ve *mappings.ValidationError
	require.ErrorAs(t, err, &ve)
	require.Equal(t, "period_anchor", ve.Fields[0].Field)
	require.Contains(t, ve.Fields[0].Reason, sub.ID)

	same, changed, err := b.store.PutTenant(ctx, b.pool, "acme", mappings.TenantInput{StripeCustomerID: cus}, "bob")
	require.NoError(t, err)
	require.False(t, changed, "the subscription's anchor again is no change")
	require.Equal(t, tn.Version, same.Version)
}

// What the subscriptions cannot give a monthly anchor leaves the tenant's
// own: a subscription of a meter no feature maps gives none, one billed
// quarterly or two subscriptions of different anchors are a problem kept
// with the read.
func TestSubscriptionsWithoutAMonthlyAnchor(t *testing.T) {
	t.Parallel()
	ctx, b := context.Background(), newBillingSim(t)
	hand := time.Date(2026, 1, 5, 0, 0, 0, 0, time.UTC)
	cases := []struct {
		name    string
		setup   func(cus string)
		problem string
	}{
		{"unmapped meter", func(cus string) { b.subscribe(t, cus, b.free, "month", 1, anchorIn(3)) }, ""},
		{"quarterly", func(cus string) { b.subscribe(t, cus, b.mapped, "month", 3, anchorIn(3)) }, "bills every 3 month"},
		{"two anchors", func(cus string) {
			b.subscribe(t, cus, b.mapped, "month", 1, anchorIn(3))
			b.subscribe(t, cus, b.mapped, "month", 1, anchorIn(4))
		}, "different billing cycle anchors"},
	}
	for i, tc := range cases {
		cus := b.sim.CreateCustomer(stripesim.DefaultAccount, "")
		tc.setup(cus)
		tenant := []string{"t0", "t1", "t2"}[i]
		tn, _, err := b.store.PutTenant(ctx, b.pool, tenant, mappings.TenantInput{StripeCustomerID: cus, PeriodAnchor: &hand}, "alice")
		require.NoError(t, err, tc.name)
		require.True(t, hand.Equal(*tn.PeriodAnchor), tc.name)
		p, read, err := mappings.StoredPeriods(ctx, b.pool, "", cus)
		require.NoError(t, err)
		require.True(t, read, tc.name)
		require.Nil(t, p.Anchor, tc.name)
		if tc.problem == "" {
			require.Empty(t, p.Problem, tc.name)
		} else {
			require.Contains(t, p.Problem, tc.problem, tc.name)
		}
	}
}

// A subscription that changes at Stripe moves the tenant's periods when
// its event arrives (SyncCustomer): a new mapping version by "stripe",
// audited. A canceled subscription leaves the last anchor; a customer no
// tenant maps reads nothing.
func TestSubscriptionChangeMovesTheAnchor(t *testing.T) {
	t.Parallel()
	subscriptionChangeMovesTheAnchor(t, newBillingSim(t))
}

// On a distributed database, where the mappings and the subscriptions are
// reference tables, the same.
func TestSubscriptionChangeMovesTheAnchorOnCitus(t *testing.T) {
	t.Parallel()
	subscriptionChangeMovesTheAnchor(t, newBillingSimOn(t, testdb.NewDistributed(t)))
}

func subscriptionChangeMovesTheAnchor(t *testing.T, b *billingSim) {
	ctx := context.Background()
	cus := b.sim.CreateCustomer(stripesim.DefaultAccount, "")
	first := anchorIn(5)
	sub := b.subscribe(t, cus, b.mapped, "month", 1, first)
	v1, _, err := b.store.PutTenant(ctx, b.pool, "acme", mappings.TenantInput{StripeCustomerID: cus}, "alice")
	require.NoError(t, err)

	_, err = b.sc.V1Subscriptions.Cancel(ctx, sub.ID, &stripe.SubscriptionCancelParams{})
	require.NoError(t, err)
	n, err := b.store.SyncCustomer(ctx, b.pool, b.store.Subscriptions, cus)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	kept, err := b.store.GetTenant(ctx, b.pool, "acme")
	require.NoError(t, err)
	require.Equal(t, v1.Version, kept.Version, "a canceled subscription leaves the anchor as it was")
	var ended int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM stripe_subscription_items WHERE customer = $1 AND ended_at IS NOT NULL`, cus).Scan(&ended))
	require.Equal(t, 1, ended)

	second := anchorIn(9)
	next := b.subscribe(t, cus, b.mapped, "month", 1, second)
	_, err = b.store.SyncCustomer(ctx, b.pool, b.store.Subscriptions, cus)
	require.NoError(t, err)
	v2, err := b.store.GetTenant(ctx, b.pool, "acme")
	require.NoError(t, err)
	require.Greater(t, v2.Version, v1.Version)
	require.True(t, second.Equal(*v2.PeriodAnchor))
	require.Equal(t, mappings.ActorStripe, v2.UpdatedBy)
	var reason string
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT reason FROM audit_log WHERE actor = 'stripe' AND subject = 'tenant:acme'`).Scan(&reason))
	require.Contains(t, reason, next.ID)

	// An item deleted from the subscription is kept, marked gone.
	extra, err := b.sc.V1Prices.Create(ctx, &stripe.PriceCreateParams{
		Currency: stripe.String("usd"), UnitAmount: stripe.Int64(1),
		ProductData: &stripe.PriceCreateProductDataParams{Name: stripe.String("Other calls")},
		Recurring: &stripe.PriceCreateRecurringParams{Interval: stripe.String("month"),
			UsageType: stripe.String("metered"), Meter: stripe.String(b.free.ID)},
	})
	require.NoError(t, err)
	up, err := b.sc.V1Subscriptions.Update(ctx, next.ID, &stripe.SubscriptionUpdateParams{
		Items: []*stripe.SubscriptionUpdateItemParams{{Price: stripe.String(extra.ID)}}})
	require.NoError(t, err)
	_, err = b.store.SyncCustomer(ctx, b.pool, b.store.Subscriptions, cus)
	require.NoError(t, err)
	var item string
	for _, it := range up.Items.Data {
		if it.Price.ID == extra.ID {
			item = it.ID
		}
	}
	require.NotEmpty(t, item)
	_, err = b.sc.V1SubscriptionItems.Delete(ctx, item, &stripe.SubscriptionItemDeleteParams{})
	require.NoError(t, err)
	_, err = b.store.SyncCustomer(ctx, b.pool, b.store.Subscriptions, cus)
	require.NoError(t, err)
	var gone bool
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT gone_at IS NOT NULL FROM stripe_subscription_items WHERE item = $1`, item).Scan(&gone))
	require.True(t, gone, "a deleted item is marked gone")
	v3, err := b.store.GetTenant(ctx, b.pool, "acme")
	require.NoError(t, err)
	require.Equal(t, v2.Version, v3.Version, "the mapped item's anchor stays")

	n, err = b.store.SyncCustomer(ctx, b.pool, b.store.Subscriptions, "cus_nobody")
	require.NoError(t, err)
	require.Zero(t, n)
}

// Stripe not answering the read of subscriptions does not stop a mapping:
// it is saved with the periods last read, and the hourly job reads them
// when Stripe answers again.
func TestPeriodsUnreadSaveTheMapping(t *testing.T) {
	t.Parallel()
	ctx, b := context.Background(), newBillingSim(t)
	cus := b.sim.CreateCustomer(stripesim.DefaultAccount, "")
	anchor := anchorIn(7)
	b.subscribe(t, cus, b.mapped, "month", 1, anchor)

	good := b.store.Subscriptions
	revoked, err := stripeapi.New(stripeapi.Config{Key: "sk_test_revoked", APIBase: b.url})
	require.NoError(t, err)
	b.store.Subscriptions = mappings.StripeMeters{Client: revoked}
	tn, _, err := b.store.PutTenant(ctx, b.pool, "acme", mappings.TenantInput{StripeCustomerID: cus}, "alice")
	require.NoError(t, err)
	require.Nil(t, tn.PeriodAnchor, "nothing read yet: calendar months")

	res, err := b.store.RefreshSubscriptions(ctx, b.pool, good, time.Hour, 100)
	require.NoError(t, err)
	require.Equal(t, 1, res.Read)
	require.Equal(t, []string{"acme"}, res.Anchored)
	tn, err = b.store.GetTenant(ctx, b.pool, "acme")
	require.NoError(t, err)
	require.True(t, anchor.Equal(*tn.PeriodAnchor))

	res, err = b.store.RefreshSubscriptions(ctx, b.pool, good, time.Hour, 100)
	require.NoError(t, err)
	require.Zero(t, res.Read, "read less than an hour ago")
	require.Empty(t, res.Anchored)
}

// A subscription read before Tally knew its meter gives no anchor; once the
// meter directory has the meter, the hourly job derives the anchor from
// what it stored, without asking Stripe again.
func TestAnchorDerivedOnceTheMeterIsKnown(t *testing.T) {
	t.Parallel()
	ctx, b := context.Background(), newBillingSim(t)
	late := b.sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "late_calls"})
	_, _, err := b.store.PutFeature(ctx, b.pool, "late", mappings.FeatureInput{EventName: "late_calls", Aggregation: mappings.Sum}, "alice")
	require.NoError(t, err)
	cus := b.sim.CreateCustomer(stripesim.DefaultAccount, "")
	anchor := anchorIn(6)
	b.subscribe(t, cus, late, "month", 1, anchor)
	tn, _, err := b.store.PutTenant(ctx, b.pool, "acme", mappings.TenantInput{StripeCustomerID: cus}, "alice")
	require.NoError(t, err)
	require.Nil(t, tn.PeriodAnchor, "the meter is not in the directory yet")

	_, err = b.pool.Exec(ctx, `INSERT INTO stripe_meters (account, mode, id, event_name, status, formula)
		VALUES ('acct_sim', 'test', $1, 'late_calls', 'active', 'sum')`, late.ID)
	require.NoError(t, err)
	res, err := b.store.RefreshSubscriptions(ctx, b.pool, b.store.Subscriptions, time.Hour, 100)
	require.NoError(t, err)
	require.Zero(t, res.Read, "read less than an hour ago: Stripe is not asked")
	require.Equal(t, []string{"acme"}, res.Anchored)
	tn, err = b.store.GetTenant(ctx, b.pool, "acme")
	require.NoError(t, err)
	require.True(t, anchor.Equal(*tn.PeriodAnchor))
}
