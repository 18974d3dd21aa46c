package stripesim_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripesim"
)

// A connected account whose access was revoked answers account_invalid to
// every call made as it (with the status Options.AccountInvalidStatus
// sets), including a stream session created before; the other accounts
// go on; restored, it answers again with its state kept.
func TestRevokeAccess(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ status, want int }{{0, http.StatusForbidden}, {http.StatusBadRequest, http.StatusBadRequest}} {
		t.Run(http.StatusText(c.want), func(t *testing.T) {
			t.Parallel()
			sim := stripesim.New(stripesim.Options{Keys: map[string]string{testKey: acct}, AccountInvalidStatus: c.status})
			ts := httptest.NewServer(sim.Handler())
			t.Cleanup(ts.Close)
			ctx := context.Background()
			for _, a := range []string{"acct_one", "acct_two"} {
				sim.AddAccount(a)
				sim.CreateMeter(a, stripesim.MeterSpec{EventName: "api_calls"})
				sim.CreateCustomer(a, "cus_acme")
			}
			retrieve := func(account string) error {
				p := &stripe.AccountRetrieveParams{}
				p.SetStripeAccount(account)
				_, err := client(ts, testKey).V1Accounts.Retrieve(ctx, p)
				return err
			}
			session := newSession(t, ts, "acct_one")

			sim.RevokeAccess("acct_one")
			se := stripeErr(t, retrieve("acct_one"))
			assert.Equal(t, c.want, se.HTTPStatusCode)
			assert.Equal(t, stripe.ErrorCode("account_invalid"), se.Code)
			assert.Equal(t, stripe.ErrorTypeInvalidRequest, se.Type)
			require.NoError(t, retrieve("acct_two"), "only the revoked account is refused")
			require.NoError(t, retrieve(""), "and the platform's own calls go on")
			sc, _ := streamClient(ts, session)
			err := sc.V2BillingMeterEventStreams.Create(ctx, streamParams(validEvents("r", 1)...))
			require.Error(t, err, "a session created before the revocation stops working")
			assert.Contains(t, err.Error(), "account_invalid")
			assert.Empty(t, sim.Events("acct_one"))

			sim.RestoreAccess("acct_one")
			require.NoError(t, retrieve("acct_one"))
			require.NoError(t, sc.V2BillingMeterEventStreams.Create(ctx, streamParams(validEvents("r", 1)...)))
			assert.Len(t, sim.Meters("acct_one"), 1, "its meters were kept")
		})
	}
}
