package stripesim_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"net/url"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

// Set moves the clock to t.
func (c *clock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

// newBillingSim starts a simulator whose clock starts at start, with a
// test and a live key for acct and the connected account connected
// (events_test.go).
func newBillingSim(t *testing.T, start time.Time) (*stripesim.Server, *httptest.Server, *clock) {
	t.Helper()
	clk := &clock{t: start}
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{testKey: acct, liveKey: acct}, Now: clk.Now})
	sim.AddAccount(connected)
	ts := httptest.NewServer(sim.Handler())
	t.Cleanup(func() {
		sim.Close()
		ts.Close()
	})
	return sim, ts, clk
}

// day is the date of the tests' billing calendars, at h:m UTC.
func day(y int, m time.Month, d, h, mi int) time.Time {
	return time.Date(y, m, d, h, mi, 0, 0, time.UTC)
}

var usageSeq atomic.Int64

// usage records value for customer on the meter of eventName with the
// timestamp at, through stripe-go, on account (empty: the key's own).
func usage(t *testing.T, sc *stripe.Client, account, eventName, customer string, value int64, at time.Time) {
	t.Helper()
	p := &stripe.BillingMeterEventCreateParams{
		EventName:  stripe.String(eventName),
		Identifier: stripe.String(fmt.Sprintf("u%d", usageSeq.Add(1))),
		Payload:    map[string]string{"stripe_customer_id": customer, "value": strconv.FormatInt(value, 10)},
		Timestamp:  stripe.Int64(at.Unix()),
	}
	if account != "" {
		p.SetStripeAccount(account)
	}
	_, err := sc.V1BillingMeterEvents.Create(context.Background(), p)
	require.NoError(t, err)
}

// invoicesOf lists, through stripe-go, every invoice of the subscription.
func invoicesOf(t *testing.T, sc *stripe.Client, sub string) []*stripe.Invoice {
	t.Helper()
	var out []*stripe.Invoice
	for inv, err := range sc.V1Invoices.List(context.Background(), &stripe.InvoiceListParams{Subscription: stripe.String(sub)}) {
		require.NoError(t, err)
		out = append(out, inv)
	}
	return out
}

// linesOf lists, through stripe-go, every line of the invoice.
func linesOf(t *testing.T, sc *stripe.Client, invoice string) []*stripe.InvoiceLineItem {
	t.Helper()
	var out []*stripe.InvoiceLineItem
	for l, err := range sc.V1Invoices.ListLines(context.Background(), &stripe.InvoiceListLinesParams{Invoice: stripe.String(invoice)}) {
		require.NoError(t, err)
		out = append(out, l)
	}
	return out
}

// subscribe creates, through stripe-go, a subscription of customer to
// prices; anchor and backdate are sent when not zero.
func subscribe(t *testing.T, sc *stripe.Client, customer string, anchor, backdate time.Time, prices ...string) *stripe.Subscription {
	t.Helper()
	p := &stripe.SubscriptionCreateParams{Customer: stripe.String(customer)}
	for _, pr := range prices {
		p.Items = append(p.Items, &stripe.SubscriptionCreateItemParams{Price: stripe.String(pr)})
	}
	if !anchor.IsZero() {
		p.BillingCycleAnchor = stripe.Int64(anchor.Unix())
	}
	if !backdate.IsZero() {
		p.BackdateStartDate = stripe.Int64(backdate.Unix())
	}
	sub, err := sc.V1Subscriptions.Create(context.Background(), p)
	require.NoError(t, err)
	return sub
}

// without is form with the keys removed and the pairs kv set.
func without(form url.Values, remove []string, kv ...string) url.Values {
	out := url.Values{}
	for k, v := range form {
		out[k] = append([]string(nil), v...)
	}
	for _, k := range remove {
		out.Del(k)
	}
	for i := 0; i+1 < len(kv); i += 2 {
		out.Set(kv[i], kv[i+1])
	}
	return out
}

// unix is t in seconds, for comparing with stripe-go's timestamps.
func unix(t time.Time) int64 { return t.Unix() }

// zeroTime is a time not sent.
var zeroTime time.Time
