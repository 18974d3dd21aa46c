package api_test

import (
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
)

// invoiceCheckView is an invoice check as the API answers it.
type invoiceCheckView struct {
	ID         int64    `json:"id"`
	Invoice    string   `json:"invoice"`
	Kinds      []string `json:"kinds"`
	Invoiced   *int64   `json:"invoiced"`
	Expected   *int64   `json:"expected"`
	Resolution *struct {
		Reason string `json:"reason"`
		Note   string `json:"note"`
		By     string `json:"by"`
	} `json:"resolution"`
}

// Finance lists the checks that differ, reads one, and resolves it with
// a reason that fits; every refusal says what is wrong, and the
// completeness report shows the invoiced quantity.
func TestInvoiceChecksListedAndResolved(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	fin := h.as(h.token("fin", auth.RoleFinance))
	op := h.as(h.token("op", auth.RoleOperator))
	require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/features/logins", op,
		map[string]any{"event_name": "logins", "aggregation": "count"}).status)
	require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/tenants/acme", op,
		map[string]any{"stripe_customer_id": "cus_acme"}).status)
	start := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	_, err := h.pool.Exec(h.ctx, `INSERT INTO stripe_invoices (account, invoice, customer, status, billing_reason, auto_advance, created, finalized_at, currency)
		VALUES ('', 'in_1', 'cus_acme', 'open', 'subscription_cycle', true, $1, $1, 'usd')`, start.AddDate(0, 1, 0))
	require.NoError(t, err)
	var more, same int64
	require.NoError(t, h.pool.QueryRow(h.ctx, `INSERT INTO invoice_checks (account, invoice, customer, event_name, formula, period_start, period_end,
		tenants, features, lines, prices, invoiced, expected, status, kinds)
		VALUES ('', 'in_1', 'cus_acme', 'logins', 'count', $1, $2, '{acme}', '{logins}', '{il_1}', '{price_1}', 5, 3, 'differs', '{invoiced_more}')
		RETURNING id`, start, start.AddDate(0, 1, 0)).Scan(&more))
	require.NoError(t, h.pool.QueryRow(h.ctx, `INSERT INTO invoice_checks (account, invoice, customer, event_name, formula, period_start, period_end,
		tenants, features, lines, prices, invoiced, expected, status, kinds)
		VALUES ('', 'in_1', 'cus_acme', 'calls', 'sum', $1, $2, '{acme}', '{}', '{il_2}', '{price_2}', 7, 7, 'matches', '{}')
		RETURNING id`, start, start.AddDate(0, 1, 0)).Scan(&same))

	var list struct {
		Status string             `json:"status"`
		Checks []invoiceCheckView `json:"checks"`
	}
	r := h.request(http.MethodGet, "/v1/invoices/checks?period=2026-11&tenant=acme", fin, nil)
	require.Equal(t, http.StatusOK, r.status, r)
	r.decode(t, &list)
	require.Equal(t, "open", list.Status)
	require.Len(t, list.Checks, 1, "only the one that differs is open")
	require.Equal(t, []string{"invoiced_more"}, list.Checks[0].Kinds)
	require.Equal(t, int64(5), *list.Checks[0].Invoiced)
	r = h.request(http.MethodGet, "/v1/invoices/checks?status=all", fin, nil)
	r.decode(t, &list)
	require.Len(t, list.Checks, 2)
	lines := completeness(t, h, fin, "2026-11").Lines
	require.Len(t, lines, 1, "a line invoiced with no usage is shown")
	require.Equal(t, int64(5), *lines[0].Invoiced)
	require.Equal(t, "in_1", lines[0].Invoice)
	require.Equal(t, []string{"invoiced_more"}, lines[0].InvoiceKinds)

	for _, tc := range []struct {
		path   string
		status int
		code   string
	}{
		{"/v1/invoices/checks?month=2026-11", http.StatusBadRequest, "unknown_filter"},
		{"/v1/invoices/checks?period=2026-13", http.StatusBadRequest, "invalid_period"},
		{"/v1/invoices/checks?status=closed", http.StatusUnprocessableEntity, "invalid_status"},
		{"/v1/invoices/checks/0", http.StatusBadRequest, "invalid_id"},
		{"/v1/invoices/checks/424242", http.StatusNotFound, "not_found"},
	} {
		r := h.request(http.MethodGet, tc.path, fin, nil)
		require.Equal(t, tc.status, r.status, "%s: %s", tc.path, r)
		require.Equal(t, tc.code, r.errorCode(t), tc.path)
	}
	resolve := func(id int64, reason, note string) response {
		return h.request(http.MethodPost, "/v1/invoices/checks/"+strconv.FormatInt(id, 10)+"/resolve", fin,
			map[string]any{"reason": reason, "note": note})
	}
	for _, tc := range []struct {
		id           int64
		reason, note string
		status       int
		code         string
	}{
		{more, "refund", "n", http.StatusUnprocessableEntity, "invalid_resolution"},
		{more, "accept_stripe", " ", http.StatusUnprocessableEntity, "invalid_resolution"},
		{more, "invoiced_separately", "n", http.StatusUnprocessableEntity, "reason_does_not_fit"},
		{same, "accept_tally", "n", http.StatusConflict, "not_a_discrepancy"},
		{424242, "accept_tally", "n", http.StatusNotFound, "not_found"},
	} {
		r := resolve(tc.id, tc.reason, tc.note)
		require.Equal(t, tc.status, r.status, "%+v: %s", tc, r)
		require.Equal(t, tc.code, r.errorCode(t))
	}
	r = resolve(more, "credited_in_stripe", "credit note CN-1")
	require.Equal(t, http.StatusOK, r.status, r)
	var done invoiceCheckView
	r.decode(t, &done)
	require.Equal(t, "credited_in_stripe", done.Resolution.Reason)
	require.Equal(t, "token:fin", done.Resolution.By)
	r = resolve(more, "accept_stripe", "again")
	require.Equal(t, http.StatusConflict, r.status)
	require.Equal(t, "resolved", r.errorCode(t))
	require.Equal(t, int64(1), h.count(`SELECT count(*) FROM audit_log WHERE action = 'invoice.resolve' AND actor = 'token:fin'`))
	r = h.request(http.MethodGet, "/v1/invoices/checks?status=resolved", fin, nil)
	r.decode(t, &list)
	require.Len(t, list.Checks, 1)

	// The gates: a held draft is open until its period is complete.
	_, err = h.pool.Exec(h.ctx, `INSERT INTO invoice_gates (account, invoice, customer, tenants, period_start, period_end, state,
		incomplete, missing, held_at, hold_until) VALUES ('', 'in_1', 'cus_acme', '{acme}', $1, $2, 'held', true,
		'acme/logins: 1 events quarantined', clock_timestamp(), clock_timestamp() + interval '1 day')`, start, start.AddDate(0, 1, 0))
	require.NoError(t, err)
	var gates struct {
		Status string `json:"status"`
		Gates  []struct {
			Invoice    string `json:"invoice"`
			State      string `json:"state"`
			Incomplete bool   `json:"incomplete"`
			Missing    string `json:"missing"`
		} `json:"gates"`
	}
	r = h.request(http.MethodGet, "/v1/invoices/gates", fin, nil)
	require.Equal(t, http.StatusOK, r.status, r)
	r.decode(t, &gates)
	require.Len(t, gates.Gates, 1)
	require.Equal(t, "held", gates.Gates[0].State)
	require.Equal(t, "acme/logins: 1 events quarantined", gates.Gates[0].Missing)
	require.Equal(t, http.StatusUnprocessableEntity, h.request(http.MethodGet, "/v1/invoices/gates?status=held", fin, nil).status)
	require.Equal(t, http.StatusBadRequest, h.request(http.MethodGet, "/v1/invoices/gates?tenant=acme", fin, nil).status)
}
