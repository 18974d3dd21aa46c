package invoices_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
)

// refusing reads prices from Stripe, except one, which it cannot get.
type refusing struct {
	invoices.Reader
	price string
}

func (r refusing) Price(ctx context.Context, account, id string) (json.RawMessage, error) {
	if id == r.price {
		return nil, errors.New("stripe: 500")
	}
	return r.Reader.Price(ctx, account, id)
}

// A price Stripe does not give is skipped and tried again next run; the
// others are kept, and a kept price is not read again.
func TestKeepItemPricesSkipsAPriceItCannotRead(t *testing.T) {
	t.Parallel()
	b := newBilling(t)
	api := b.meterFor("api", mappings.Sum, "3")
	gpu := b.meterFor("gpu", mappings.Sum, "7")
	b.subscribe(api, gpu)
	_, err := b.env.Maps.SyncCustomer(b.ctx, b.env.Pool, mappings.StripeMeters{Client: b.client}, b.cus)
	require.NoError(t, err)

	read, err := invoices.KeepItemPrices(b.ctx, b.env.Pool, refusing{Reader: b.reader, price: api}, 100)
	require.ErrorContains(t, err, api)
	require.Equal(t, 1, read)
	read, err = invoices.KeepItemPrices(b.ctx, b.env.Pool, b.reader, 100)
	require.NoError(t, err)
	require.Equal(t, 1, read, "the price refused last time")
	read, err = invoices.KeepItemPrices(b.ctx, b.env.Pool, b.reader, 100)
	require.NoError(t, err)
	require.Zero(t, read)

	// A copy a day old of a price billed in its own currency is kept as it is.
	_, err = b.env.Pool.Exec(b.ctx, `UPDATE stripe_prices SET read_at = read_at - interval '2 days'`)
	require.NoError(t, err)
	read, err = invoices.KeepItemPrices(b.ctx, b.env.Pool, b.reader, 100)
	require.NoError(t, err)
	require.Zero(t, read)
	// Billed in another currency, it is read again: its currency options may have changed.
	_, err = b.env.Pool.Exec(b.ctx, `UPDATE stripe_subscription_items SET currency = 'eur' WHERE price = $1`, gpu)
	require.NoError(t, err)
	read, err = invoices.KeepItemPrices(b.ctx, b.env.Pool, b.reader, 100)
	require.NoError(t, err)
	require.Equal(t, 1, read)
	var fresh bool
	require.NoError(t, b.env.Pool.QueryRow(b.ctx, `SELECT read_at > clock_timestamp() - $2::interval FROM stripe_prices WHERE price = $1`,
		gpu, time.Hour).Scan(&fresh))
	require.True(t, fresh)
}
