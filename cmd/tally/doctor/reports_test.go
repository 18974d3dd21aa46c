package doctor_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/cmd/tally/doctor"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// The error reports check says when Stripe's events were last listed,
// whether the event destination delivers, and which accounts cannot be
// listed: never listed is a warning, a report only the listing found a
// warning about the destination, an account whose listing keeps failing a
// problem.
func TestErrorReportsCheck(t *testing.T) {
	t.Parallel()
	s := healthy(t)
	rs := s.run(t, nil)
	require.Equal(t, doctor.Warning, rs["error reports"].Status, "%+v", rs["error reports"])
	require.Contains(t, rs["error reports"].Detail, "never listed")
	require.Contains(t, rs["error reports"].Detail, "has never delivered")

	// A report Stripe made that the destination never delivered: the
	// listing finds it.
	s.sim.Configure(stripesim.DefaultAccount, stripesim.Limits{AsyncValidation: true})
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: s.base})
	require.NoError(t, err)
	p := &stripe.BillingMeterEventCreateParams{EventName: stripe.String("api"), Identifier: stripe.String("x-1"),
		Payload: map[string]string{"stripe_customer_id": "cus_ghost", "value": "1"}, Timestamp: stripe.Int64(time.Now().Unix())}
	_, err = client.Stripe().V1BillingMeterEvents.Create(context.Background(), p)
	require.NoError(t, err)
	dest := func() (exporter.Destination, error) {
		return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: stripesim.DefaultAccount, Mode: outbox.ModeTest}, nil
	}
	accounts := []string{}
	connected := func(context.Context, pgdb.Querier) ([]string, error) { return accounts, nil }
	events, err := reconcile.NewEvents(reconcile.EventsConfig{Outbox: s.env.Outbox, Destination: dest, Connected: connected,
		Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	backfill, err := reconcile.NewBackfill(reconcile.BackfillConfig{Events: events, Key: stripesim.DefaultKey, APIBase: s.base,
		Destination: dest, Connected: connected, Limiter: exporter.NewLimiter(1000), Logger: slog.New(slog.DiscardHandler),
		RetryInitial: time.Millisecond, RetryMax: 10 * time.Millisecond})
	require.NoError(t, err)
	res, err := backfill.Run(context.Background(), s.env.Pool)
	require.NoError(t, err)
	require.Equal(t, 1, res.Recorded)
	rs = s.run(t, nil)
	r := rs["error reports"]
	require.Equal(t, doctor.Warning, r.Status, "%+v", r)
	require.Regexp(t, `listed \d+s ago \(GET /v2/core/events, every 1h\)`, r.Detail)
	require.Contains(t, r.Detail, "1 reports of the last 30 days reached Tally only by the listing")
	require.Contains(t, r.Fix, "check the event destination")

	// A connected account the key may not act for: its listing fails, and
	// it has never succeeded.
	accounts = []string{"acct_1Revoked"}
	res, err = backfill.Run(context.Background(), s.env.Pool)
	require.NoError(t, err)
	require.Equal(t, []string{"acct_1Revoked"}, res.Failed)
	r = s.run(t, nil)["error reports"]
	require.Equal(t, doctor.Problem, r.Status, "%+v", r)
	require.Contains(t, r.Detail, "the last listing failed for acct_1Revoked (account_invalid, status 403)")
	require.Contains(t, r.Detail, "not listed successfully for 3h or more: acct_1Revoked")

	// A restricted key lists nothing.
	s.cfg.StripeAPIKey = restrictedKey
	s.cfg.StripeWebhookSecret = ""
	r = s.run(t, nil)["error reports"]
	require.Equal(t, doctor.Warning, r.Status)
	require.Contains(t, r.Detail, "not listed")
}
