package invoices_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// billing is a ledger and a simulated Stripe whose clock is 20 days
// behind, so that a billing period ends two hours ago: usage of the whole
// period is within what both take, and its invoice finalizes in the past.
type billing struct {
	t        *testing.T
	ctx      context.Context
	env      *stagetest.Env
	sim      *stripesim.Server
	clock    *stripesim.MovedClock
	sc       *stripe.Client
	reader   invoices.Stripe
	client   *stripeapi.Client
	resolver *exporter.Resolver
	anchor   time.Time // the end of the period compared
	cus      string
}

func newBilling(t *testing.T) *billing {
	t.Helper()
	b := &billing{t: t, ctx: context.Background(), env: stagetest.New(t, outbox.Config{}), clock: &stripesim.MovedClock{}}
	b.clock.Add(-20 * 24 * time.Hour)
	b.sim = stripesim.New(stripesim.Options{Now: b.clock.Now})
	srv := httptest.NewServer(b.sim.Handler())
	t.Cleanup(srv.Close)
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	b.sc, b.reader, b.client = c.Stripe(), invoices.Stripe{Client: c}, c
	b.resolver, err = exporter.NewResolver(exporter.Settings{Key: stripesim.DefaultKey, APIBase: srv.URL, MeterEventsBase: srv.URL})
	require.NoError(t, err)
	d, err := b.resolver.Resolve(b.ctx)
	require.NoError(t, err)
	b.env.Target.Account, b.env.Target.Mode = d.Account, d.Mode
	b.anchor = time.Now().UTC().Add(-2 * time.Hour).Truncate(time.Second)
	b.cus = b.sim.CreateCustomer(stripesim.DefaultAccount, "")
	return b
}

// meterFor makes a Stripe meter, its price and the feature mapped to it,
// and puts the meter in Tally's directory; no price when unit is "".
func (b *billing) meterFor(name string, agg mappings.Aggregation, unit string) string {
	m := b.sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: name, Formula: string(agg)})
	_, err := b.env.Pool.Exec(b.ctx, `INSERT INTO stripe_meters (account, mode, id, event_name, status, formula)
		VALUES ('', 'test', $1, $2, 'active', $3)`, m.ID, name, string(agg))
	require.NoError(b.t, err)
	b.env.Feature(b.t, name, agg, time.Hour)
	if unit == "" {
		return ""
	}
	return b.sim.CreatePrice(stripesim.DefaultAccount, stripesim.PriceSpec{UnitAmountDecimal: unit, Meter: m.ID})
}

// subscribe subscribes the customer to prices for the month that ends at
// the anchor, and maps tenant acme to it by that anchor.
func (b *billing) subscribe(prices ...string) {
	b.sim.CreateSubscription(stripesim.DefaultAccount, stripesim.SubscriptionSpec{Customer: b.cus, Prices: prices,
		BillingCycleAnchor: b.anchor, BackdateStartDate: stagetest.AddMonths(b.anchor, -1)})
	_, _, err := b.env.Maps.PutTenant(b.ctx, b.env.Pool, "acme", mappings.TenantInput{StripeCustomerID: b.cus, PeriodAnchor: &b.anchor}, "alice")
	require.NoError(b.t, err)
}

// ledger ingests and stages usage of the period, d before its end.
func (b *billing) ledger(id, feature string, value int64, d time.Duration) {
	at := b.anchor.Add(-d)
	b.env.MustIngest(b.t, stagetest.Ev(id, "acme", feature, value, &at))
	b.env.Pass(b.t)
}

// stripeGets reports usage to Stripe directly, d before the period's end.
func (b *billing) stripeGets(name string, value int64, d time.Duration) {
	at := b.anchor.Add(-d)
	if ahead := at.Sub(b.clock.Now()); ahead > 0 {
		b.clock.Add(ahead + time.Second)
	}
	_, err := b.sc.V1BillingMeterEvents.Create(b.ctx, &stripe.BillingMeterEventCreateParams{EventName: stripe.String(name),
		Timestamp: stripe.Int64(at.Unix()), Payload: map[string]string{"stripe_customer_id": b.cus, "value": fmt.Sprint(value)}})
	require.NoError(b.t, err)
}

// invoice moves Stripe's clock by d and reads the customer's only
// invoice as its events would.
func (b *billing) invoice(d time.Duration) (stripesim.Invoice, invoices.Received) {
	b.t.Helper()
	inv := b.simInvoice(d)
	r, err := invoices.Receive(b.ctx, b.env.Pool, b.reader, b.env.Maps, b.cus, inv.ID)
	require.NoError(b.t, err)
	return inv, r
}

// simInvoice moves Stripe's clock by d and gives the customer's only
// invoice, unread.
func (b *billing) simInvoice(d time.Duration) stripesim.Invoice {
	b.t.Helper()
	b.clock.Add(d)
	var mine []stripesim.Invoice
	for _, inv := range b.sim.Invoices(stripesim.DefaultAccount) {
		if inv.Customer == b.cus {
			mine = append(mine, inv)
		}
	}
	require.Len(b.t, mine, 1)
	return mine[0]
}

func byName(checks []invoices.Check) map[string]invoices.Check {
	out := map[string]invoices.Check{}
	for _, c := range checks {
		out[c.EventName] = c
	}
	return out
}

func value(n int64) *quarantine.Value { v := quarantine.ValueOf(n); return &v }

// A finalized invoice beside the ledger: a sum meter billed exactly
// matches; a count meter billed for an event Tally never had is invoiced
// more; a feature whose meter no price bills is used but on no invoice.
// A draft is not compared. Usage that comes after the invoice closed is
// quarantined period_closed and turns the matching check into used but
// on no invoice, never confirmed; finance resolves each with a reason
// that fits, audited, and a comparison with the same numbers keeps the
// resolution.
func TestCompareSetsTheInvoiceBesideTheLedger(t *testing.T) {
	t.Parallel()
	b := newBilling(t)
	calls := b.meterFor("api_calls", mappings.Sum, "2")
	logins := b.meterFor("logins", mappings.Count, "10")
	b.meterFor("exports", mappings.Sum, "")
	b.subscribe(calls, logins)

	b.ledger("c1", "api_calls", 5, 10*24*time.Hour)
	b.ledger("c2", "api_calls", 7, 5*24*time.Hour)
	b.ledger("l1", "logins", 1, 9*24*time.Hour)
	b.ledger("l2", "logins", 1, 3*24*time.Hour)
	b.ledger("x1", "exports", 4, 4*24*time.Hour)
	b.stripeGets("api_calls", 5, 10*24*time.Hour)
	b.stripeGets("logins", 1, 9*24*time.Hour)
	b.stripeGets("api_calls", 7, 5*24*time.Hour)
	b.stripeGets("logins", 1, 3*24*time.Hour)
	b.stripeGets("logins", 1, 2*24*time.Hour) // another sender

	draft, r := b.invoice(b.anchor.Sub(b.clock.Now()) + time.Minute)
	require.Equal(t, "draft", draft.Status)
	require.Empty(t, r.Checks, "a draft is not compared")

	final, r := b.invoice(time.Hour)
	require.Equal(t, "open", final.Status)
	checks := byName(r.Checks)
	require.Len(t, checks, 3)
	c := checks["api_calls"]
	require.Equal(t, invoices.Matches, c.Status, "%+v", c)
	require.Equal(t, value(12), c.Invoiced)
	require.Equal(t, value(12), c.Expected)
	require.Equal(t, []string{"acme"}, c.Tenants)
	require.Equal(t, []string{"api_calls"}, c.Features)
	require.True(t, b.anchor.Equal(c.PeriodEnd))
	require.True(t, stagetest.AddMonths(b.anchor, -1).Equal(c.PeriodStart))
	c = checks["logins"]
	require.Equal(t, invoices.Differs, c.Status)
	require.Equal(t, []string{invoices.KindInvoicedMore}, c.Kinds)
	require.Equal(t, value(3), c.Invoiced)
	require.Equal(t, value(2), c.Expected, "a count meter counts events")
	c = checks["exports"]
	require.Equal(t, invoices.Differs, c.Status)
	require.Equal(t, []string{invoices.KindUsedNotInvoiced}, c.Kinds)
	require.Nil(t, c.Invoiced, "no line bills the meter")
	require.Equal(t, value(4), c.Expected)

	// Usage of the period that comes after its invoice closed.
	b.env.Target.InvoiceGrace, b.env.Target.LateUsage = time.Hour, meter.LateQuarantine
	b.ledger("c3", "api_calls", 2, 24*time.Hour)
	var reason string
	require.NoError(t, b.env.Pool.QueryRow(b.ctx, `SELECT quarantine_reason FROM outbox_items WHERE state = 'quarantined'`).Scan(&reason))
	require.Contains(t, reason, "period_closed")
	res, err := invoices.Recompare(b.ctx, b.env.Pool, b.env.Maps, invoices.DefaultRecompareWithin, time.Hour, 10)
	require.NoError(t, err)
	require.Equal(t, invoices.Recompared{}, res, "compared within the hour")
	res, err = invoices.Recompare(b.ctx, b.env.Pool, b.env.Maps, invoices.DefaultRecompareWithin, 0, 10)
	require.NoError(t, err)
	require.Equal(t, invoices.Recompared{Invoices: 1, Differs: 3}, res)
	again, err := invoices.List(b.ctx, b.env.Pool, invoices.Filter{Tenant: "acme"})
	require.NoError(t, err)
	c = byName(again)["api_calls"]
	require.Equal(t, invoices.Differs, c.Status)
	require.Equal(t, []string{invoices.KindUsedNotInvoiced}, c.Kinds)
	require.Equal(t, value(12), c.Expected, "what should be on the invoice")
	require.Equal(t, quarantine.ValueOf(2), c.Unbilled)

	// The completeness report shows what was invoiced.
	rep, err := quarantine.CompletenessOf(b.ctx, b.env.Pool, stagetest.AddMonths(b.anchor, -1).Format("2006-01"), "acme")
	require.NoError(t, err)
	invoiced := map[string]*quarantine.Value{}
	for _, l := range rep.Lines {
		invoiced[l.Feature] = l.Invoiced
	}
	require.Equal(t, map[string]*quarantine.Value{"api_calls": value(12), "logins": value(3), "exports": nil}, invoiced)

	// Finance resolves each with a reason that fits.
	open, err := invoices.List(b.ctx, b.env.Pool, invoices.Filter{Tenant: "acme"})
	require.NoError(t, err)
	require.Len(t, open, 3)
	_, err = invoices.Resolve(b.ctx, b.env.Pool, c.ID, invoices.Decision{Reason: invoices.ResolvedCreditedInStripe, Note: "n", By: "fin"})
	require.ErrorIs(t, err, invoices.ErrReasonDoesNotFit, "nothing was billed more")
	_, err = invoices.Resolve(b.ctx, b.env.Pool, checks["api_calls"].ID+1000, invoices.Decision{Reason: invoices.ResolvedAcceptTally, Note: "n", By: "fin"})
	require.ErrorIs(t, err, invoices.ErrCheckNotFound)
	done, err := invoices.Resolve(b.ctx, b.env.Pool, c.ID, invoices.Decision{Reason: invoices.ResolvedInvoicedSeparately, Note: "on the next invoice", By: "fin"})
	require.NoError(t, err)
	require.Equal(t, invoices.ResolvedInvoicedSeparately, done.Resolution.Reason)
	_, err = invoices.Resolve(b.ctx, b.env.Pool, c.ID, invoices.Decision{Reason: invoices.ResolvedAcceptStripe, Note: "n", By: "fin"})
	require.ErrorIs(t, err, invoices.ErrResolved)
	_, err = invoices.Resolve(b.ctx, b.env.Pool, checks["logins"].ID, invoices.Decision{Reason: invoices.ResolvedCreditedInStripe, Note: "credit note", By: "fin"})
	require.NoError(t, err)
	var audited int
	require.NoError(t, b.env.Pool.QueryRow(b.ctx, `SELECT count(*) FROM audit_log WHERE action = 'invoice.resolve'`).Scan(&audited))
	require.Equal(t, 2, audited)

	// The same numbers keep the resolution; new ones reopen the check.
	again, err = invoices.Compare(b.ctx, b.env.Pool, b.env.Maps, "", final.ID)
	require.NoError(t, err)
	require.NotNil(t, byName(again)["api_calls"].Resolution)
	b.ledger("c4", "api_calls", 1, 24*time.Hour)
	_, err = invoices.Compare(b.ctx, b.env.Pool, b.env.Maps, "", final.ID)
	require.NoError(t, err)
	reopened, err := invoices.Get(b.ctx, b.env.Pool, c.ID)
	require.NoError(t, err)
	require.Nil(t, reopened.Resolution)
	require.Equal(t, quarantine.ValueOf(3), reopened.Unbilled)
	open, err = invoices.List(b.ctx, b.env.Pool, invoices.Filter{Period: c.PeriodStart.Format("2006-01")})
	require.NoError(t, err)
	names := []string{}
	for _, o := range open {
		names = append(names, o.EventName)
	}
	require.ElementsMatch(t, []string{"api_calls", "exports"}, names)
	_, err = invoices.List(b.ctx, b.env.Pool, invoices.Filter{Status: "closed"})
	require.ErrorIs(t, err, invoices.ErrInvalidStatus)
}

// What Tally cannot set beside the ledger is said, never guessed: a
// tenant whose billing period is not the invoice's (its anchor is the
// calendar month), and a meter of the last value.
func TestCompareSaysWhatItCannotCompare(t *testing.T) {
	t.Parallel()
	b := newBilling(t)
	calls := b.meterFor("api_calls", mappings.Sum, "2")
	seats := b.meterFor("seats", mappings.Last, "100")
	b.sim.CreateSubscription(stripesim.DefaultAccount, stripesim.SubscriptionSpec{Customer: b.cus, Prices: []string{calls, seats},
		BillingCycleAnchor: b.anchor, BackdateStartDate: stagetest.AddMonths(b.anchor, -1)})
	first := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	_, _, err := b.env.Maps.PutTenant(b.ctx, b.env.Pool, "acme", mappings.TenantInput{StripeCustomerID: b.cus, PeriodAnchor: &first}, "alice")
	require.NoError(t, err)
	b.stripeGets("api_calls", 5, 24*time.Hour)
	b.stripeGets("seats", 3, 24*time.Hour)

	b.invoice(b.anchor.Sub(b.clock.Now()) + time.Minute)
	_, r := b.invoice(time.Hour)
	checks := byName(r.Checks)
	require.Len(t, checks, 2)
	for name, want := range map[string]string{"api_calls": "tenant acme's billing period starts at", "seats": "the meter's formula is last"} {
		c := checks[name]
		require.Equal(t, invoices.NotCompared, c.Status, name)
		require.Contains(t, c.Reason, want, name)
		require.Nil(t, c.Expected, name)
		require.Empty(t, c.Kinds, name)
		require.NotNil(t, c.Invoiced, name)
	}
	_, err = invoices.Resolve(b.ctx, b.env.Pool, checks["seats"].ID, invoices.Decision{Reason: invoices.ResolvedAcceptStripe, Note: "n", By: "fin"})
	require.ErrorIs(t, err, invoices.ErrNotADiscrepancy)
}
