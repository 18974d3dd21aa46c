package console_test

import (
	"encoding/csv"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/mappings"
)

// states is every outbox item's state and the number of item audit
// entries: what a confirmation page must leave as it found it.
func (s *site) states(t *testing.T) string {
	t.Helper()
	var out string
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT (SELECT string_agg(id || ' ' || state, ',' ORDER BY id) FROM outbox_items)
		|| ' audit ' || (SELECT count(*) FROM audit_log WHERE subject LIKE 'item:%')`).Scan(&out))
	return out
}

// The operator asks to requeue every quarantined item: the confirmation
// shows the dry run's counts and changes nothing; the requeue then does
// what it said, shows its counts, and is audited per item. Every matching
// item, not one button each.
func TestOperatorRequeuesAllMatching(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	_, _, err := s.env.Maps.PutTenant(s.env.Ctx, s.env.Pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_acme"}, "test")
	require.NoError(t, err)
	ctx, consoleErrors := browse(t)
	require.NoError(t, chromedp.Do(ctx, signIn(s.token(t, "otto", auth.RoleOperator), s.url)))
	before := s.states(t)

	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/quarantine"),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=requeue-matching]`)), chromedp.Click(chromedp.CSS(`[data-testid=requeue-matching]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=requeue-confirm]`))))
	require.Equal(t, "0 requeued, 1 re-addressed, 1 refused", text(t, ctx, `[data-testid=confirm-counts]`))
	require.Contains(t, text(t, ctx, `[data-testid=requeue-confirm]`), "still_ineligible: 1", "gpu is still unmapped")
	require.Equal(t, "Requeue 2 items", text(t, ctx, `[data-testid=requeue-matching-confirm]`))
	screenshot(t, ctx, "operator-requeue-all-confirm")
	require.Equal(t, before, s.states(t), "the confirmation changed nothing")

	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(`[data-testid=requeue-matching-confirm]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-testid=requeue-result]`))))
	require.Equal(t, "0 requeued, 1 re-addressed, 1 refused", text(t, ctx, `[data-testid=result-counts]`))
	require.Equal(t, 1, count(t, ctx, `[data-testid=items] tr[data-testid^=item-]`), "the refused item stays")
	screenshot(t, ctx, "operator-requeue-all-result")
	var states []string
	rows, err := s.env.Pool.Query(s.env.Ctx, `SELECT coalesce(quarantine_reason, '') || ' ' || state FROM outbox_items
		WHERE quarantine_reason IS NOT NULL ORDER BY id`)
	require.NoError(t, err)
	for rows.Next() {
		var st string
		require.NoError(t, rows.Scan(&st))
		states = append(states, st)
	}
	require.Equal(t, []string{"no_customer superseded", "feature_unmapped quarantined"}, states)
	var audited string
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT string_agg(actor || ' ' || action, ',') FROM audit_log WHERE subject LIKE 'item:%'`).Scan(&audited))
	require.Equal(t, "console:otto readdress", audited)

	// Filtered: nothing of no_customer is left to requeue.
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url+"/console/quarantine?reason=no_customer"),
		chromedp.Click(chromedp.CSS(`[data-testid=requeue-matching]`)), chromedp.WaitVisible(chromedp.CSS(`[data-testid=requeue-confirm]`))))
	require.Equal(t, "0 requeued, 0 re-addressed, 0 refused", text(t, ctx, `[data-testid=confirm-counts]`))
	require.Equal(t, 1, count(t, ctx, `[data-testid=requeue-matching-confirm][disabled]`), "nothing to requeue")
	require.Empty(t, consoleErrors())
}

// The requeue of every matching item is a POST with the session's CSRF
// token, by an operator; finance sees no such action but downloads the
// items as CSV, one row an item.
func TestRequeueAllNeedsCSRFAndRoleAndItemsCSV(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	client := func(token string) *http.Client {
		jar, err := cookiejar.New(nil)
		require.NoError(t, err)
		c := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		resp, err := postSignIn(c, s.url, token)
		require.NoError(t, err)
		resp.Body.Close()
		return c
	}
	page := func(c *http.Client, path string) (int, string) {
		resp, err := c.Get(s.url + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	before := s.states(t)
	const action = "/console/items/matching/requeue"
	op := client(s.token(t, "olga", auth.RoleOperator))
	fin := client(s.token(t, "fred", auth.RoleFinance))
	for name, c := range map[string]struct {
		client *http.Client
		form   url.Values
		status int
	}{
		"no CSRF token":   {op, url.Values{"after": {"0"}}, http.StatusForbidden},
		"a wrong token":   {op, url.Values{"after": {"0"}, "csrf": {"guess"}}, http.StatusForbidden},
		"finance":         {fin, url.Values{"after": {"0"}}, http.StatusForbidden},
		"no session":      {http.DefaultClient, url.Values{"after": {"0"}}, http.StatusUnauthorized},
		"a bad period":    {op, url.Values{"after": {"0"}, "period": {"2026-13"}}, http.StatusBadRequest},
		"a negative page": {op, url.Values{"after": {"-1"}}, http.StatusBadRequest},
	} {
		form := c.form
		if c.status == http.StatusBadRequest {
			_, body := page(op, "/console/quarantine")
			form.Set("csrf", regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(body)[1])
		}
		resp, err := c.client.PostForm(s.url+action, form)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, c.status, resp.StatusCode, name)
	}
	require.Equal(t, before, s.states(t), "nothing was done")

	code, body := page(fin, "/console/quarantine?confirm=requeue")
	require.Equal(t, http.StatusOK, code)
	require.NotContains(t, body, "requeue-matching", "finance is offered no requeue")
	require.NotContains(t, body, "requeue-confirm", "and runs no dry run")
	require.Contains(t, body, `data-testid="items-csv"`)

	resp, err := fin.Get(s.url + "/console/quarantine.csv?items=1&reason=no_customer")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, resp.Header.Get("Content-Disposition"), "tally-quarantine-items.csv")
	records, err := csv.NewReader(resp.Body).ReadAll()
	require.NoError(t, err)
	require.Len(t, records, 2)
	require.Equal(t, "id,tenant,feature,customer,destination_account,reason", strings.Join(records[0][:6], ","))
	var item int64
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT id FROM outbox_items WHERE quarantine_reason = 'no_customer'`).Scan(&item))
	var account string
	require.NoError(t, s.env.Pool.QueryRow(s.env.Ctx, `SELECT destination_account FROM outbox_items WHERE id = $1`, item).Scan(&account))
	require.Equal(t, []string{fmt.Sprint(item), "acme", "api", "", account, "no_customer"}, records[1][:6])
}
