package stripeapi_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
)

const (
	testKey = "sk_test_51TallyTestKeySECRETPARTwxyz"
	acct    = "acct_platform"
)

func newSim(t *testing.T) (*stripesim.Server, *httptest.Server) {
	t.Helper()
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{testKey: acct}})
	ts := httptest.NewServer(sim.Handler())
	t.Cleanup(ts.Close)
	return sim, ts
}

func newClient(t *testing.T, ts *httptest.Server, cfg stripeapi.Config) *stripeapi.Client {
	t.Helper()
	if cfg.Key == "" {
		cfg.Key = testKey
	}
	cfg.APIBase = ts.URL
	cfg.HTTPClient = ts.Client()
	c, err := stripeapi.New(cfg)
	require.NoError(t, err)
	return c
}

func TestModeOfKey(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		key  string
		mode stripeapi.Mode
	}{
		{"sk_live_abc", stripeapi.ModeLive},
		{"rk_live_abc", stripeapi.ModeLive},
		{"sk_test_abc", stripeapi.ModeTest},
		{"rk_test_abc", stripeapi.ModeTest},
		{"pk_live_secretish", ""},
		{"pk_test_secretish", ""},
		{"sk_test_", ""},
		{"SK_TEST_secretish", ""},
		{"whsec_secretish", ""},
		{"secretish", ""},
		{"", ""},
	} {
		mode, err := stripeapi.ModeOfKey(c.key)
		assert.Equal(t, c.mode, mode, c.key)
		if c.mode != "" {
			assert.NoError(t, err, c.key)
			continue
		}
		require.Error(t, err, c.key)
		assert.Contains(t, err.Error(), "sk_live_, rk_live_, sk_test_ or rk_test_")
		assert.NotContains(t, err.Error(), "secretish")
	}
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]stripeapi.Config{
		"no key":        {},
		"bad prefix":    {Key: "pk_test_secretish"},
		"whitespace":    {Key: "sk_test_secretish\n"},
		"relative base": {Key: "sk_test_secretish", APIBase: "localhost:12111"},
		"ftp base":      {Key: "sk_test_secretish", APIBase: "ftp://example.com"},
		"creds in base": {Key: "sk_test_secretish", APIBase: "https://user:secretish@example.com"},
		"bad account":   {Key: "sk_test_secretish", Account: "cus_123"},
	} {
		_, err := stripeapi.New(cfg)
		require.Error(t, err, name)
		assert.NotContains(t, err.Error(), "secretish", name)
		code, status, msg := stripeapi.Describe(err)
		assert.Equal(t, stripeapi.CodeInvalidConfig, code, name)
		assert.Zero(t, status)
		assert.NotContains(t, msg, "secretish", name)
	}

	c, err := stripeapi.New(stripeapi.Config{Key: "rk_live_abc"})
	require.NoError(t, err)
	assert.Equal(t, stripeapi.ModeLive, c.Mode())
	assert.NotNil(t, c.Stripe())
}

func TestAccountID(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	sim.AddAccount("acct_connected")
	ctx := context.Background()

	c := newClient(t, ts, stripeapi.Config{})
	assert.Equal(t, stripeapi.ModeTest, c.Mode())
	id, err := c.AccountID(ctx)
	require.NoError(t, err)
	assert.Equal(t, acct, id)
	reqs := sim.Requests()
	require.Len(t, reqs, 1)
	assert.Equal(t, "/v1/account", reqs[0].Path)
	assert.Empty(t, reqs[0].StripeAccount)

	cc := newClient(t, ts, stripeapi.Config{Account: "acct_connected"})
	id, err = cc.AccountID(ctx)
	require.NoError(t, err)
	assert.Equal(t, "acct_connected", id)
	assert.Len(t, sim.Requests(), 1, "Config.Account needs no request")

	// With Config.Account every request carries Stripe-Account, including
	// those made through Stripe().
	_, err = cc.Meters(ctx)
	require.NoError(t, err)
	a, err := cc.Stripe().V1Accounts.Retrieve(ctx, nil)
	require.NoError(t, err)
	assert.Equal(t, "acct_connected", a.ID)
	reqs = sim.Requests()
	require.Len(t, reqs, 3)
	for _, r := range reqs[1:] {
		assert.Equal(t, "acct_connected", r.StripeAccount, r.Path)
		assert.Equal(t, "acct_connected", r.Account, r.Path)
	}

	// An account the key cannot reach.
	bad := newClient(t, ts, stripeapi.Config{Account: "acct_elsewhere"})
	_, err = bad.Meters(ctx)
	var se *stripeapi.Error
	require.ErrorAs(t, err, &se)
	assert.Equal(t, http.StatusForbidden, se.HTTPStatus)
	assert.Equal(t, "account_invalid", se.Code)
}

func TestMetersAcrossPages(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	want := map[string]stripesim.Meter{}
	for i := range 250 {
		m := sim.CreateMeter(acct, stripesim.MeterSpec{
			EventName: fmt.Sprintf("ev_%03d", i), Formula: []string{"sum", "count", "last"}[i%3],
			CustomerPayloadKey: "cust", ValuePayloadKey: "qty",
		})
		if i%10 == 0 {
			require.NoError(t, sim.DeactivateMeter(acct, m.ID))
			m.Status = stripesim.MeterInactive
		}
		want[m.ID] = m
	}
	c := newClient(t, ts, stripeapi.Config{})
	got, err := c.Meters(context.Background())
	require.NoError(t, err)
	require.Len(t, got, 250)
	inactive := 0
	for _, m := range got {
		w, ok := want[m.ID]
		require.True(t, ok, m.ID)
		assert.Equal(t, stripeapi.Meter{
			ID: w.ID, DisplayName: w.DisplayName, EventName: w.EventName, Formula: w.Formula,
			Status: w.Status, CustomerPayloadKey: "cust", ValuePayloadKey: "qty",
		}, m)
		if m.Status == "inactive" {
			inactive++
		}
	}
	assert.Equal(t, 25, inactive)
	reqs := sim.Requests()
	require.Len(t, reqs, 3, "pages of 100")
	for _, r := range reqs {
		assert.Equal(t, "100", r.Form.Get("limit"))
		assert.Empty(t, r.Form.Get("status"))
	}
	assert.Equal(t, got[99].ID, reqs[1].Form.Get("starting_after"))

	none, err := newClient(t, ts, stripeapi.Config{Key: "sk_test_other"}).Meters(context.Background())
	require.Error(t, err) // unknown key
	assert.Nil(t, none)
}

func TestMeterByEventName(t *testing.T) {
	t.Parallel()
	sim, ts := newSim(t)
	old := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls", Formula: "count"})
	require.NoError(t, sim.DeactivateMeter(acct, old.ID))
	only := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "only_inactive"})
	require.NoError(t, sim.DeactivateMeter(acct, only.ID))
	cur := sim.CreateMeter(acct, stripesim.MeterSpec{EventName: "api_calls"})
	for i := range 120 { // push the match past the first page
		sim.CreateMeter(acct, stripesim.MeterSpec{EventName: fmt.Sprintf("filler_%d", i)})
	}
	c := newClient(t, ts, stripeapi.Config{})
	ctx := context.Background()

	m, ok, err := c.MeterByEventName(ctx, "api_calls")
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, cur.ID, m.ID)
	assert.Equal(t, "active", m.Status)
	assert.Equal(t, "sum", m.Formula)

	_, ok, err = c.MeterByEventName(ctx, "only_inactive")
	require.NoError(t, err)
	assert.False(t, ok)
	_, ok, err = c.MeterByEventName(ctx, "never_created")
	require.NoError(t, err)
	assert.False(t, ok)
	for _, r := range sim.Requests() {
		assert.Equal(t, "active", r.Form.Get("status"))
	}
}

func TestInvalidKeyErrorIsContentFree(t *testing.T) {
	t.Parallel()
	_, ts := newSim(t)
	const bad = "sk_test_51WrongKeyTOPSECRETvalue9876"
	c := newClient(t, ts, stripeapi.Config{Key: bad})

	_, err := c.AccountID(context.Background())
	require.Error(t, err)
	var se *stripeapi.Error
	require.ErrorAs(t, err, &se)
	assert.Equal(t, http.StatusUnauthorized, se.HTTPStatus)
	assert.Equal(t, "invalid_request_error", se.Type)
	assert.Regexp(t, `^req_`, se.RequestID)

	code, status, msg := stripeapi.Describe(fmt.Errorf("startup: %w", err))
	assert.Equal(t, http.StatusUnauthorized, status)
	assert.Equal(t, "invalid_request_error", code)
	assert.Equal(t, "Invalid API Key provided: sk_test_****9876", msg)

	// Stripe's own message shows the prefix and the last four characters;
	// nothing else of the key may appear anywhere.
	secret := strings.TrimSuffix(strings.TrimPrefix(bad, "sk_test_"), "9876")
	for _, text := range []string{err.Error(), fmt.Sprintf("%+v", err), fmt.Sprintf("%#v", err), msg} {
		for i := 0; i+4 <= len(secret); i++ {
			require.NotContains(t, text, secret[i:i+4], text)
		}
	}
	assert.Equal(t, "stripe: error, HTTP 401, type invalid_request_error, request "+se.RequestID, err.Error())
}

func TestErrorsOfStripeCalls(t *testing.T) {
	t.Parallel()
	_, ts := newSim(t)
	c := newClient(t, ts, stripeapi.Config{})
	ctx := context.Background()

	// A Stripe error made through Stripe(), wrapped by WrapError.
	_, err := c.Stripe().V1BillingMeters.Retrieve(ctx, "mtr_missing", nil)
	err = stripeapi.WrapError(err)
	var se *stripeapi.Error
	require.ErrorAs(t, err, &se)
	assert.Equal(t, http.StatusNotFound, se.HTTPStatus)
	assert.Equal(t, "resource_missing", se.Code)
	assert.Equal(t, "id", se.Param)
	assert.Equal(t, "stripe: error, HTTP 404, type invalid_request_error, code resource_missing, param id, request "+se.RequestID, err.Error())
	code, status, msg := stripeapi.Describe(err)
	assert.Equal(t, "resource_missing", code)
	assert.Equal(t, 404, status)
	assert.Equal(t, "No such billing meter: 'mtr_missing'", msg)
	assert.Same(t, err, stripeapi.WrapError(err))
	assert.NoError(t, stripeapi.WrapError(nil))

	// A canceled context.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err = c.Meters(cctx)
	assert.ErrorIs(t, err, context.Canceled)
	code, status, _ = stripeapi.Describe(err)
	assert.Equal(t, stripeapi.CodeCanceled, code)
	assert.Zero(t, status)

	// No server at all.
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close()
	dc, err := stripeapi.New(stripeapi.Config{Key: testKey, APIBase: dead.URL, HTTPClient: &http.Client{Timeout: 2 * time.Second}})
	require.NoError(t, err)
	_, err = dc.AccountID(ctx)
	require.ErrorAs(t, err, &se)
	assert.Equal(t, stripeapi.CodeNetwork, se.Code)
	assert.Equal(t, "stripe: network error, no response", err.Error())
}

func TestUnreadableResponsesKeepNoBody(t *testing.T) {
	t.Parallel()
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/account": // not JSON
			w.WriteHeader(http.StatusBadGateway)
			_, _ = w.Write([]byte("<html>upstream BODYCONTENT sk_live_51LeakedKey1234567</html>"))
		default: // JSON without an error object
			w.WriteHeader(http.StatusBadRequest)
			_, _ = w.Write([]byte(`{"detail":"BODYCONTENT"}`))
		}
	}))
	t.Cleanup(ts.Close)
	c := newClient(t, ts, stripeapi.Config{})

	_, err := c.AccountID(context.Background())
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "BODYCONTENT")
	code, status, msg := stripeapi.Describe(err)
	assert.Equal(t, stripeapi.CodeBadResponse, code)
	assert.Equal(t, http.StatusBadGateway, status)
	assert.NotContains(t, msg, "BODYCONTENT")

	_, err = c.Meters(context.Background())
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "BODYCONTENT")
	code, _, msg = stripeapi.Describe(err)
	assert.Equal(t, stripeapi.CodeFailed, code)
	assert.NotContains(t, msg, "BODYCONTENT")
}

func TestDescribe(t *testing.T) {
	t.Parallel()
	code, status, msg := stripeapi.Describe(nil)
	assert.Empty(t, code)
	assert.Zero(t, status)
	assert.Empty(t, msg)

	code, _, msg = stripeapi.Describe(errors.New("some BODYCONTENT"))
	assert.Equal(t, "unknown_error", code)
	assert.NotContains(t, msg, "BODYCONTENT")

	long := "Bad thing\n\twith sk_live_51AbcdefghijklmnopQRST and rk_test_short, Bearer tok_123 and whsec_abcdef " + strings.Repeat("x", 300)
	code, status, msg = stripeapi.Describe(&stripe.Error{HTTPStatusCode: 400, Type: stripe.ErrorTypeInvalidRequest, Msg: long})
	assert.Equal(t, "invalid_request_error", code)
	assert.Equal(t, 400, status)
	assert.LessOrEqual(t, len([]rune(msg)), 200)
	assert.True(t, strings.HasPrefix(msg, "Bad thing with sk_live_****QRST and rk_test_****, Bearer **** and whsec_**** xxx"), msg)
	assert.NotContains(t, msg, "\n")
	assert.NotContains(t, msg, "Abcdefghijklmnop")

	// Meter event session tokens are masked whole, whatever their mode part
	// or alphabet.
	for _, tok := range []string{"mesk_test_Ab12Cd34Ef56", "mesk_live_AbCd-Ef_Gh12", "mesk_Zz99Yy88"} {
		_, _, msg = stripeapi.Describe(&stripe.Error{HTTPStatusCode: 401, Type: stripe.ErrorTypeInvalidRequest, Msg: "token " + tok + " expired"})
		assert.Equal(t, "token mesk_**** expired", msg, tok)
	}
}
