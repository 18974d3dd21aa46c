package console_test

import (
	"fmt"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
)

// The invoices page shows a held draft with what its period lacks, the
// checks that differ with a form to resolve each, and the completeness
// report the invoiced quantity and the amount at the invoice's price;
// finance resolves a check from the page, and a reason that does not fit,
// or a second resolution, is refused in words.
func TestInvoicesPageShowsHoldsAndChecks(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	ctx, pool := s.env.Ctx, s.env.Pool
	start := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	_, err := pool.Exec(ctx, `INSERT INTO stripe_invoices (account, invoice, customer, status, billing_reason, auto_advance, created, finalized_at, currency)
		VALUES ('', 'in_held', 'cus_beta', 'draft', 'subscription_cycle', false, $1, NULL, 'usd'),
		       ('', 'in_final', 'cus_beta', 'open', 'subscription_cycle', true, $1, $1, 'usd')`, start.AddDate(0, 1, 0))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO invoice_gates (account, invoice, customer, tenants, period_start, period_end, state, incomplete,
		missing, held_at, hold_until) VALUES ('', 'in_held', 'cus_beta', '{beta}', $1, $2, 'held', true, 'beta/gpu: 1 events quarantined',
		clock_timestamp(), clock_timestamp() + interval '1 day')`, start, start.AddDate(0, 1, 0))
	require.NoError(t, err)
	var check int64
	require.NoError(t, pool.QueryRow(ctx, `INSERT INTO invoice_checks (account, invoice, customer, event_name, formula, period_start, period_end,
		tenants, features, lines, prices, invoiced, expected, status, kinds, currency, invoiced_amount, expected_amount)
		VALUES ('', 'in_final', 'cus_beta', 'api', 'sum', $1, $2, '{beta}', '{api}', '{il_1}', '{price_1}', 3, 4, 'differs',
		'{invoiced_less}', 'usd', 300, 400) RETURNING id`, start, start.AddDate(0, 1, 0)).Scan(&check))
	_, err = pool.Exec(ctx, `INSERT INTO stripe_prices (account, price, body) VALUES ('', 'price_1', '{"id": "price_1",
		"object": "price", "currency": "usd", "type": "recurring", "billing_scheme": "per_unit", "unit_amount": 100,
		"unit_amount_decimal": "100", "recurring": {"usage_type": "metered", "interval": "month", "interval_count": 1}}')`)
	require.NoError(t, err)

	fin, csrf := consoleClient(t, s, s.token(t, "fiona", auth.RoleFinance), s.url+"/console/invoices")
	get := func(c *http.Client, path string) string {
		t.Helper()
		resp, err := c.Get(s.url + path)
		require.NoError(t, err)
		body := readBody(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, body)
		return body
	}
	page := get(fin, "/console/invoices")
	require.Contains(t, page, `<tr data-state="held">`)
	require.Contains(t, page, "held (auto_advance off) until")
	require.Contains(t, page, "beta/gpu: 1 events quarantined")
	require.Contains(t, page, fmt.Sprintf(`action="/console/invoices/checks/%d/resolve"`, check))
	require.Contains(t, page, "invoiced less than used")
	require.Contains(t, page, "300 / 400 usd")

	noRedirect := *fin
	noRedirect.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	resolve := func(reason string) string {
		t.Helper()
		resp, err := noRedirect.PostForm(fmt.Sprintf("%s/console/invoices/checks/%d/resolve", s.url, check),
			url.Values{"csrf": {csrf}, "reason": {reason}, "note": {"invoice item on the next invoice"}})
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusSeeOther, resp.StatusCode)
		return resp.Header.Get("Location")
	}
	require.Contains(t, resolve("credited_in_stripe"), "notice=reason_does_not_fit")
	require.Contains(t, get(fin, "/console/invoices?notice=reason_does_not_fit"), "does not answer what the check found")
	require.Contains(t, resolve("invoiced_separately"), "notice=resolved")
	require.Contains(t, resolve("accept_tally"), "notice=resolved_already")
	require.NotContains(t, get(fin, "/console/invoices"), fmt.Sprintf(`id="check-%d"`, check), "resolved: no longer open")

	report := get(fin, "/console/completeness?period=2026-11")
	require.Contains(t, report, `data-testid="invoiced">3</td>`)
	require.Contains(t, report, `data-testid="amount">0.00 USD</td>`, "priced at the invoice's price: no usage, nothing to bill")
	require.Contains(t, report, `<tr data-testid="money-customer"><td>cus_beta</td><td class="num">0.00 USD</td>`)
}
