package api_test

import (
	"bytes"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
)

// reportIn makes Stripe report a failed meter event in account (an
// unknown customer, validated asynchronously) and returns the report.
func reportIn(t *testing.T, h *harness, sim *stripesim.Server, client *stripeapi.Client, account string) stripesim.ErrorReport {
	t.Helper()
	p := &stripe.BillingMeterEventCreateParams{EventName: stripe.String("logins"), Identifier: stripe.String("ev-" + account),
		Payload:   map[string]string{"stripe_customer_id": "cus_ghost", "value": "1"},
		Timestamp: stripe.Int64(time.Now().Add(-time.Hour).Unix())}
	p.SetStripeAccount(account)
	_, err := client.Stripe().V1BillingMeterEvents.Create(h.ctx, p)
	require.NoError(t, err)
	reps := sim.ErrorReports(account)
	require.NotEmpty(t, reps)
	return reps[len(reps)-1]
}

// deliver posts report's thin event, signed now.
func deliver(t *testing.T, h *harness, rep stripesim.ErrorReport) response {
	t.Helper()
	body, sig := stripesim.SignedThinEvent(rep, webhookSecret, time.Now())
	return postSigned(t, h, body, sig)
}

// postSigned posts body to the event destination's route with sig as its
// Stripe-Signature.
func postSigned(t *testing.T, h *harness, body []byte, sig string) response {
	t.Helper()
	req, err := http.NewRequestWithContext(h.ctx, http.MethodPost, h.url+"/v1/stripe/events", bytes.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Stripe-Signature", sig)
	return h.send(req)
}

// eventRow is a stripe_events row's account, arrival, status and fetch
// refusal.
func eventRow(t *testing.T, h *harness, id string) (account, arrival, status, fetchCode string, tries int) {
	t.Helper()
	require.NoError(t, h.pool.QueryRow(h.ctx, `SELECT coalesce(account, ''), arrival, status, coalesce(fetch_code, ''), fetch_tries
		FROM stripe_events WHERE id = $1`, id).Scan(&account, &arrival, &status, &fetchCode, &tries))
	return
}

// fetchesOf counts the simulator's GET /v2/core/events/{id} of id, and
// says whether every one named its context in Stripe-Context and none
// sent Stripe-Account.
func fetchesOf(sim *stripesim.Server, id, context string) (n int, inContext bool) {
	inContext = true
	for _, r := range sim.Requests() {
		if r.Path == "/v2/core/events/"+id {
			n++
			inContext = inContext && r.StripeContext == context && r.StripeAccount == ""
		}
	}
	return n, inContext
}

// A report about a connected account a tenant mapping names is read in its
// context (Stripe-Context, no Stripe-Account) and recorded with its
// account; one about an account Tally does not export to is recorded as
// foreign, not read, and answered 2xx every time it is delivered — never a
// 502 that Stripe would retry for days.
func TestStripeEventsOfOtherAccounts(t *testing.T) {
	t.Parallel()
	sim, _, client, h := webhookHarness(t)

	conn := reportIn(t, h, sim, client, webhookConnected)
	require.Equal(t, webhookConnected, conn.Context)
	resp := deliver(t, h, conn)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.JSONEq(t, `{"status":"recorded","failed":0,"noted":0,"evidence_only":0,"unmatched":1}`, string(resp.body),
		"read in its context; no item of Tally's has the event")
	account, arrival, status, _, _ := eventRow(t, h, conn.ID)
	require.Equal(t, [3]string{webhookConnected, "destination", "recorded"}, [3]string{account, arrival, status})
	n, inContext := fetchesOf(sim, conn.ID, webhookConnected)
	require.Equal(t, 1, n)
	require.True(t, inContext, "fetched with Stripe-Context alone")

	foreign := reportIn(t, h, sim, client, webhookForeign)
	for range 2 {
		resp = deliver(t, h, foreign)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		require.JSONEq(t, `{"status":"foreign"}`, string(resp.body))
	}
	account, arrival, status, _, _ = eventRow(t, h, foreign.ID)
	require.Equal(t, [3]string{webhookForeign, "destination", "foreign"}, [3]string{account, arrival, status})
	n, _ = fetchesOf(sim, foreign.ID, webhookForeign)
	require.Zero(t, n, "an event about another account is not read")
	require.Zero(t, h.count(`SELECT count(*) FROM meter_error_evidence WHERE event_id = $1`, foreign.ID))

	// A context Tally could not send as a header names no account of its.
	odd := foreign
	odd.ID, odd.Context = "evt_test_odd", "acct_1 Conn\nX-Injected: 1"
	resp = deliver(t, h, odd)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.JSONEq(t, `{"status":"foreign"}`, string(resp.body))
}

// A report about an account Tally exports to that Stripe refuses to let it
// read (a 4xx: access revoked, an event it does not know) is recorded as
// unreadable and answered 2xx; delivered again once Stripe lets Tally read
// it, it is recorded. A read without a usable answer (5xx, 429) is a 502,
// recording nothing: Stripe delivers it again.
func TestStripeEventsUnreadable(t *testing.T) {
	t.Parallel()
	sim, _, client, h := webhookHarness(t)
	rep := reportIn(t, h, sim, client, webhookConnected)

	sim.RevokeAccess(webhookConnected)
	for i := range 2 {
		resp := deliver(t, h, rep)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		require.JSONEq(t, `{"status":"unreadable"}`, string(resp.body))
		account, _, status, code, tries := eventRow(t, h, rep.ID)
		require.Equal(t, [3]string{webhookConnected, "unreadable", "account_invalid"}, [3]string{account, status, code})
		require.Equal(t, i+1, tries)
	}
	sim.RestoreAccess(webhookConnected)
	resp := deliver(t, h, rep)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.True(t, strings.Contains(string(resp.body), `"status":"recorded"`), "%s", resp)
	_, arrival, status, code, _ := eventRow(t, h, rep.ID)
	require.Equal(t, [3]string{"destination", "recorded", ""}, [3]string{arrival, status, code})
	resp = deliver(t, h, rep)
	require.JSONEq(t, `{"status":"duplicate"}`, string(resp.body))

	// An event Stripe does not know in an account Tally exports to: 404.
	missing := rep
	missing.ID = "evt_test_missing"
	resp = deliver(t, h, missing)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.JSONEq(t, `{"status":"unreadable"}`, string(resp.body))
	_, _, _, code, _ = eventRow(t, h, missing.ID)
	require.Equal(t, "resource_missing", code)

	// Stripe answers 500 or 429 to every read: 502, nothing recorded.
	sim.Configure(webhookConnected, stripesim.Limits{AsyncValidation: true, Faults: stripesim.Faults{ReadFault: 1}})
	other := reportIn(t, h, sim, client, webhookConnected)
	resp = deliver(t, h, other)
	require.Equal(t, http.StatusBadGateway, resp.status, "%s", resp)
	require.Equal(t, "event_unavailable", resp.errorCode(t))
	require.Zero(t, h.count(`SELECT count(*) FROM stripe_events WHERE id = $1`, other.ID))
}
