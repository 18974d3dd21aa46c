package console_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/reconcile"
)

// A run's page shows each discrepancy's reason, and for a key whose
// summaries Stripe refused, Stripe's code and status and how many items
// were not compared, beside an hour's mismatch.
func TestReconcilePageShowsTheReasonOfARefusedKey(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	ctx, pool := s.env.Ctx, s.env.Pool
	run, err := reconcile.Queue(ctx, pool, reconcile.TriggerAPI, "token:otto", reconcile.Options{Settle: time.Hour})
	require.NoError(t, err)
	hour := time.Date(2026, 11, 30, 7, 0, 0, 0, time.UTC)
	_, err = pool.Exec(ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name, meter, customer,
			reason, error_code, error_status, hour, formula, expected, provider, difference, expected_items, uncertain_items,
			explained_by, explanation)
		VALUES ($1, 'acct_1', 'test', 'api', 'mtr_1', 'cus_gone', 'summaries_refused', 'resource_missing', 400, $2, 'sum', 12,
			NULL, NULL, '{101,102,103}', '{104}', '{}', 'not_compared'),
		       ($1, 'acct_1', 'test', 'api', 'mtr_1', 'cus_beta', DEFAULT, NULL, NULL, $2, 'sum', 5, 4, -1, '{201}', '{}', '{}',
			'unexplained')`, run, hour)
	require.NoError(t, err)

	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar}
	resp, err := postSignIn(c, s.url, s.token(t, "fin", auth.RoleFinance))
	require.NoError(t, err)
	resp.Body.Close()
	resp, err = c.Get(fmt.Sprintf("%s/console/reconcile/%d", s.url, run))
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	page := string(b)
	require.Contains(t, page, `data-reason="summaries_refused"`)
	require.Contains(t, page, "Stripe refused to show its numbers for this customer and meter (resource_missing, HTTP 400)")
	require.Contains(t, page, "none of Tally&#39;s 3 items was compared")
	require.Contains(t, page, "2026-11 · from 11-30 07:00")
	require.Contains(t, page, `<a href="/console/items/104">104</a>`)
	require.Contains(t, page, `data-reason="mismatch"`)
	require.Contains(t, page, "Tally has a total of 5, Stripe 4: Stripe has 1 less, usage not billed.")
}
