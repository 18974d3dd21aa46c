package invoices_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
)

// Events the destination never delivered are listed: the invoice is read
// and compared, and the customer's subscriptions read again, as their
// deliveries would have; a second listing reads nothing Tally read since.
// A listing Stripe fails keeps its place and says why.
func TestListingActsOnUndeliveredEvents(t *testing.T) {
	t.Parallel()
	b := newBilling(t)
	calls := b.meterFor("api_calls", mappings.Sum, "2")
	b.subscribe(calls)
	b.ledger("c1", "api_calls", 5, 3*24*time.Hour)
	b.stripeGets("api_calls", 5, 3*24*time.Hour)
	synced := 0
	l := &invoices.Listing{DB: b.env.Pool, Lister: b.reader, Receiver: invoices.Receiver{Reader: b.reader, Maps: b.env.Maps},
		Subscriptions: func(ctx context.Context, db pgdb.Beginner, customer string) (int, error) {
			synced++
			return b.env.Maps.SyncCustomer(ctx, db, mappings.StripeMeters{Client: b.client}, customer)
		}}
	final := b.simInvoice(b.anchor.Sub(b.clock.Now()) + time.Hour + time.Minute)
	require.Equal(t, "open", final.Status)

	res, err := l.Run(b.ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Accounts)
	require.Positive(t, res.Events)
	require.Equal(t, 1, synced, "the renewal's subscription event")
	checks, err := invoices.List(b.ctx, b.env.Pool, invoices.Filter{Status: invoices.ListAll})
	require.NoError(t, err)
	require.Len(t, checks, 1)
	require.Equal(t, invoices.Matches, checks[0].Status)
	require.Equal(t, final.ID, checks[0].Invoice)

	again, err := l.Run(b.ctx)
	require.NoError(t, err)
	require.Zero(t, again.Read, "read since the events were made")

	b.sim.Configure(stripesim.DefaultAccount, stripesim.Limits{Faults: stripesim.Faults{ReadFault: 1}})
	_, err = l.Run(b.ctx)
	require.Error(t, err)
	var problem *string
	require.NoError(t, b.env.Pool.QueryRow(b.ctx, `SELECT error FROM billing_event_listings WHERE account = ''`).Scan(&problem))
	require.NotNil(t, problem)
}
