package exporter_test

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/testkit/stripemock"
	"github.com/tallymeter/tally/outbox"
)

// The contract tests send every v1 request Tally makes to Stripe's
// stripe-mock, which validates each request against Stripe's OpenAPI
// specification and answers 400 when a parameter is missing, misnamed or
// of the wrong type. Behaviour is the simulator's business; these pin the
// shapes.

const mockKey = "sk_test_123" // stripe-mock takes any sk_test_ key

func lastRequest(t *testing.T, m *stripemock.Mock, method, path string) stripemock.Request {
	t.Helper()
	reqs := m.Requests()
	for i := len(reqs) - 1; i >= 0; i-- {
		if reqs[i].Method == method && reqs[i].Path == path {
			return reqs[i]
		}
	}
	t.Fatalf("no %s %s reached stripe-mock; saw %v", method, path, reqs)
	return stripemock.Request{}
}

// requireCommonHeaders: every call is authenticated with the key, pins
// stripe-go's API version and carries no retry or telemetry header (retrying
// is the outbox's business).
func requireCommonHeaders(t *testing.T, r stripemock.Request) {
	t.Helper()
	require.Equal(t, "Bearer "+mockKey, r.Header.Get("Authorization"))
	require.Equal(t, stripe.APIVersion, r.Header.Get("Stripe-Version"))
	require.Empty(t, r.Header.Get("X-Stripe-Client-Telemetry"))
}

// The account behind the key: GET /v1/account.
func TestContractAccount(t *testing.T) {
	t.Parallel()
	m := stripemock.Start(t)
	res, err := exporter.NewResolver(exporter.Settings{Key: mockKey, APIBase: m.URL})
	require.NoError(t, err)
	d, err := res.Resolve(context.Background())
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(d.Account, "acct_"), "%+v", d)
	require.Equal(t, outbox.ModeTest, d.Mode)

	r := lastRequest(t, m, http.MethodGet, "/v1/account")
	require.Equal(t, http.StatusOK, r.Status, r.Body)
	requireCommonHeaders(t, r)
	require.Empty(t, r.Header.Get("Stripe-Account"))
}

// The meters: GET /v1/billing/meters, all and active only, for the key's
// account and for a connected account.
func TestContractMeters(t *testing.T) {
	t.Parallel()
	m := stripemock.Start(t)
	for _, account := range []string{"", "acct_1Connected"} {
		t.Run("account="+account, func(t *testing.T) {
			c, err := stripeapi.New(stripeapi.Config{Key: mockKey, APIBase: m.URL, Account: account})
			require.NoError(t, err)
			meters, err := c.Meters(context.Background())
			require.NoError(t, err)
			require.NotEmpty(t, meters)
			require.NotEmpty(t, meters[0].EventName)
			require.Contains(t, []string{"sum", "count", "last"}, meters[0].Formula)

			r := lastRequest(t, m, http.MethodGet, "/v1/billing/meters")
			require.Equal(t, http.StatusOK, r.Status, r.Body)
			requireCommonHeaders(t, r)
			require.Equal(t, "100", r.Query.Get("limit"))
			require.Equal(t, account, r.Header.Get("Stripe-Account"))

			_, _, err = c.MeterByEventName(context.Background(), meters[0].EventName)
			require.NoError(t, err)
			r = lastRequest(t, m, http.MethodGet, "/v1/billing/meters")
			require.Equal(t, http.StatusOK, r.Status, r.Body)
			require.Equal(t, "active", r.Query.Get("status"))
		})
	}
}

// A customer's subscriptions: GET /v1/subscriptions with the customer and
// status=all, for the key's account and for a connected account.
func TestContractSubscriptions(t *testing.T) {
	t.Parallel()
	m := stripemock.Start(t)
	for _, account := range []string{"", "acct_1Connected"} {
		t.Run("account="+account, func(t *testing.T) {
			c, err := stripeapi.New(stripeapi.Config{Key: mockKey, APIBase: m.URL, Account: account})
			require.NoError(t, err)
			_, err = c.SubscriptionItems(context.Background(), "cus_1")
			require.NoError(t, err)

			r := lastRequest(t, m, http.MethodGet, "/v1/subscriptions")
			require.Equal(t, http.StatusOK, r.Status, r.Body)
			requireCommonHeaders(t, r)
			require.Equal(t, "cus_1", r.Query.Get("customer"))
			require.Equal(t, "all", r.Query.Get("status"))
			require.Equal(t, "100", r.Query.Get("limit"))
			require.Equal(t, account, r.Header.Get("Stripe-Account"))
		})
	}
}

// The export itself: POST /v1/billing/meter_events with the item's
// identifier as the event's identifier and an Idempotency-Key of the
// attempt's own, for the key's account and for a connected account, for a
// usage and for a correction, under Stripe's default payload keys and under
// a meter's own.
func TestContractMeterEvent(t *testing.T) {
	t.Parallel()
	m := stripemock.Start(t)
	for _, tc := range []struct {
		account               string
		value                 int64
		attempt               int
		customerKey, valueKey string
	}{
		{"", 42, 1, "", ""},
		{"acct_1Connected", 7, 2, "", ""},
		{"", -3, 17, "", ""},
		{"", 5, 1, "account_ref", "units"},
	} {
		t.Run(fmt.Sprintf("account=%s,value=%d,keys=%s/%s", tc.account, tc.value, tc.customerKey, tc.valueKey), func(t *testing.T) {
			c, err := stripeapi.New(stripeapi.Config{Key: mockKey, APIBase: m.URL, Account: tc.account})
			require.NoError(t, err)
			ts := time.Now().Add(-time.Hour).Unix()
			id := "tly_" + strings.Repeat(strconv.FormatInt(tc.value&0xf, 16), 64)
			item := outbox.Lease{Item: outbox.Item{Attempts: tc.attempt, Payload: outbox.Payload{
				Customer: "cus_Contract", EventName: "api_calls", Value: tc.value, Timestamp: ts, Identifier: id,
				Feature: "api_calls", Period: "2026-11-01T00:00:00Z", CustomerKey: tc.customerKey, ValueKey: tc.valueKey,
			}}}
			o := exporter.NewStripeV1(c, 5*time.Second).Send(context.Background(), item)
			require.Equal(t, outbox.Accepted, o.Kind, "%+v", o.Error)

			r := lastRequest(t, m, http.MethodPost, "/v1/billing/meter_events")
			require.Equal(t, http.StatusOK, r.Status, r.Body)
			requireCommonHeaders(t, r)
			require.Equal(t, fmt.Sprintf("%s-a%d", id, tc.attempt), r.Header.Get("Idempotency-Key"),
				"a key per attempt: Stripe replays a key's first answer, 500s included, for 24 hours")
			require.Equal(t, tc.account, r.Header.Get("Stripe-Account"))
			customerKey, valueKey := cmp.Or(tc.customerKey, "stripe_customer_id"), cmp.Or(tc.valueKey, "value")
			require.Equal(t, map[string][]string{
				"event_name":                   {"api_calls"},
				"identifier":                   {id},
				"timestamp":                    {strconv.FormatInt(ts, 10)},
				"payload[" + customerKey + "]": {"cus_Contract"},
				"payload[" + valueKey + "]":    {strconv.FormatInt(tc.value, 10)},
			}, map[string][]string(r.Form), "exactly these parameters: Tally's feature and period never reach Stripe")
		})
	}
}

// stripe-mock does validate: a meter event without its event name is
// answered 400, and what Tally keeps of it is a code, the status and at
// most 200 characters of the message. Without this the tests above could
// not fail.
func TestContractValidationIsLive(t *testing.T) {
	t.Parallel()
	m := stripemock.Start(t)
	c, err := stripeapi.New(stripeapi.Config{Key: mockKey, APIBase: m.URL})
	require.NoError(t, err)
	params := exporter.Params(outbox.Payload{Customer: "cus_Contract", EventName: "api_calls", Value: 1,
		Timestamp: time.Now().Unix(), Identifier: "tly_" + strings.Repeat("0", 64)}, 1)
	params.EventName = nil
	_, err = c.Stripe().V1BillingMeterEvents.Create(context.Background(), params)
	require.Error(t, err)

	r := lastRequest(t, m, http.MethodPost, "/v1/billing/meter_events")
	require.Equal(t, http.StatusBadRequest, r.Status, r.Body)
	require.Contains(t, r.Body, "event_name")
	code, status, msg := stripeapi.Describe(err)
	require.Equal(t, http.StatusBadRequest, status)
	require.NotEmpty(t, code)
	require.LessOrEqual(t, len(msg), 200)
	require.NotContains(t, msg, "{", "Stripe's message at most, never the body")
}

// A cancellation item: POST /v1/billing/meter_event_adjustments with
// type=cancel, the event name and the identifier to cancel, nothing else,
// an Idempotency-Key per attempt, and a tenant's connected account as
// Stripe-Account (ForAccounts) on a client that has none of its own.
func TestContractMeterEventAdjustment(t *testing.T) {
	t.Parallel()
	m := stripemock.Start(t)
	c, err := stripeapi.New(stripeapi.Config{Key: mockKey, APIBase: m.URL})
	require.NoError(t, err)
	self, target := "tly_"+strings.Repeat("c", 64), "tly_"+strings.Repeat("e", 64)
	for _, account := range []string{"", "acct_1Tenant"} {
		item := outbox.Lease{Item: outbox.Item{Identity: outbox.Identity{SubjectKind: outbox.SubjectUsageCancellation, DestinationAccount: account},
			Attempts: 3, Payload: outbox.Payload{Customer: "cus_Contract", EventName: "logins", Identifier: self, Cancels: target}}}
		v1 := exporter.NewStripeV1(c, 5*time.Second).ForAccounts(func(a string) string { return a })
		o := v1.Send(context.Background(), item)
		require.Equal(t, outbox.Accepted, o.Kind, "%+v", o.Error)
		r := lastRequest(t, m, http.MethodPost, "/v1/billing/meter_event_adjustments")
		require.Equal(t, http.StatusOK, r.Status, r.Body)
		requireCommonHeaders(t, r)
		require.Equal(t, self+"-a3", r.Header.Get("Idempotency-Key"))
		require.Equal(t, account, r.Header.Get("Stripe-Account"))
		require.Equal(t, map[string][]string{
			"event_name":         {"logins"},
			"type":               {"cancel"},
			"cancel[identifier]": {target},
		}, map[string][]string(r.Form))
	}
}

// A tenant's connected account goes on the meter event of its item
// (ForAccounts), and the node's own destination goes without one.
func TestContractMeterEventForATenantsAccount(t *testing.T) {
	t.Parallel()
	m := stripemock.Start(t)
	c, err := stripeapi.New(stripeapi.Config{Key: mockKey, APIBase: m.URL})
	require.NoError(t, err)
	const home = "acct_1Home"
	v1 := exporter.NewStripeV1(c, 5*time.Second).ForAccounts(func(a string) string {
		if a == home {
			return ""
		}
		return a
	})
	for account, want := range map[string]string{home: "", "acct_1Tenant": "acct_1Tenant"} {
		item := outbox.Lease{Item: outbox.Item{Identity: outbox.Identity{SubjectKind: outbox.SubjectUsageEvent, DestinationAccount: account},
			Attempts: 1, Payload: outbox.Payload{Customer: "cus_Contract", EventName: "api_calls", Value: 3,
				Timestamp: time.Now().Add(-time.Hour).Unix(), Identifier: "tly_" + strings.Repeat("f", 64)}}}
		require.Equal(t, outbox.Accepted, v1.Send(context.Background(), item).Kind)
		r := lastRequest(t, m, http.MethodPost, "/v1/billing/meter_events")
		require.Equal(t, want, r.Header.Get("Stripe-Account"), account)
	}
}
