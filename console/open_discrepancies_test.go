package console_test

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/outbox"
)

// The overview counts the open discrepancies of every run by kind, Stripe
// has more first — said to mean a customer may be billed too much, and
// called out — each linking to the open discrepancies of its kind; the
// reconciliation page lists them in that order with a form to resolve each. A resolution from
// that list comes back to it; a reason that does not fit the kind is
// refused; once resolved, the overview no longer counts it.
func TestOverviewAndReconcilePageShowOpenDiscrepancies(t *testing.T) {
	t.Parallel()
	s := newReconcileSite(t) // explainedDiscrepancy: Stripe has 4, Tally 0; dropped: Tally 6, Stripe 0
	fin, csrf := consoleClient(t, s.site, s.token(t, "fiona", auth.RoleFinance), s.url+"/console/")
	get := func(path string) string {
		t.Helper()
		resp, err := fin.Get(s.url + path)
		require.NoError(t, err)
		body := readBody(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, body)
		return body
	}

	overview := get("/console/")
	require.Contains(t, overview, `data-testid="stripe-has-more"`)
	require.Contains(t, overview, "Stripe counts more than Tally in 1 hour: a customer may be billed too much")
	more := strings.Index(overview, `data-testid="open-stripe_has_more"`)
	less := strings.Index(overview, `data-testid="open-stripe_has_less"`)
	refused := strings.Index(overview, `data-testid="open-summaries_refused"`)
	require.True(t, more > 0 && more < less && less < refused, "Stripe has more first")
	require.Contains(t, overview, `<a class="card" href="/console/discrepancies?kind=stripe_has_more" data-testid="open-stripe_has_more"><div class="n bad">1</div>`)
	require.Contains(t, overview, `data-testid="open-stripe_has_less"><div class="n bad">1</div>`)
	require.Contains(t, overview, `data-testid="open-summaries_refused"><div class="n">0</div>`)

	page := get("/console/reconcile")
	require.Contains(t, page, `id="open-stripe_has_more"`)
	first := strings.Index(page, fmt.Sprintf(`id="discrepancy-%d"`, s.explainedDiscrepancy))
	second := strings.Index(page, fmt.Sprintf(`id="discrepancy-%d"`, s.dropped))
	require.True(t, first > 0 && first < second, "Stripe has more first")
	require.Contains(t, page, fmt.Sprintf(`action="/console/reconcile/discrepancies/%d/resolve"`, s.dropped))
	require.NotContains(t, page, fmt.Sprintf(`action="/console/reconcile/discrepancies/%d/resolve"`, s.explainedDiscrepancy),
		"an explained one points at its plan instead")
	require.Contains(t, page, fmt.Sprintf(`<a data-testid="plan-link" href="/console/reconcile/%d#plan">`, s.run))

	noRedirect := *fin
	noRedirect.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	resolve := func(id int64, reason string) string {
		t.Helper()
		resp, err := noRedirect.PostForm(fmt.Sprintf("%s/console/reconcile/discrepancies/%d/resolve", s.url, id),
			url.Values{"csrf": {csrf}, "reason": {reason}, "note": {"credit note CN-12"}})
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusSeeOther, resp.StatusCode)
		return resp.Header.Get("Location")
	}
	require.Equal(t, fmt.Sprintf("/console/reconcile?notice=invalid_resolution#discrepancy-%d", s.dropped),
		resolve(s.dropped, "credited_in_stripe"), "a credit does not answer Stripe having less")
	require.Equal(t, outbox.StateAccepted, s.state(t, s.accepted))
	require.Equal(t, fmt.Sprintf("/console/reconcile?notice=resolved#discrepancy-%d", s.explainedDiscrepancy),
		resolve(s.explainedDiscrepancy, "credited_in_stripe"), "back to the open list")

	overview = get("/console/")
	require.NotContains(t, overview, `data-testid="stripe-has-more"`)
	require.Contains(t, overview, `data-testid="open-stripe_has_more"><div class="n">0</div>`)
	page = get("/console/reconcile")
	require.NotContains(t, page, fmt.Sprintf(`id="discrepancy-%d"`, s.explainedDiscrepancy), "no longer open")
	require.Contains(t, page, fmt.Sprintf(`id="discrepancy-%d"`, s.dropped))
	runPage := get(fmt.Sprintf("/console/reconcile/%d", s.run))
	require.Contains(t, runPage, "credited_in_stripe</span> by console:fiona", "the run's page shows it resolved")
}
