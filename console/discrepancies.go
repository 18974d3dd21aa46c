package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// discrepancyView is a discrepancy as the pages show it: its numbers in
// words and its hour's month.
type discrepancyView struct {
	reconcile.Discrepancy
	// Numbers says what Tally has and what Stripe has.
	Numbers string
	// Month is the hour's month, YYYY-MM.
	Month string
	// Recoverable: some of the items that explain it are still uncertain,
	// so its run's plan recovers them. Recovered: none is, and some were
	// recovered as accepted, so the next run that compares the hour
	// confirms them and clears it.
	Recoverable, Recovered bool
}

// Explained says whether d is open and explained by uncertain items that
// landed and are still uncertain: its run's plan recovers them, which is
// what settles it. One whose items were recovered as accepted waits for
// the next run; one whose items moved otherwise (sent again, abandoned)
// is for finance to resolve like any other.
func (d discrepancyView) Explained() bool {
	return d.Open() && d.Explanation == "explained" && d.Recoverable
}

// AwaitsRun says whether d is open, explained, and its items were
// recovered as accepted: the next run that compares its hour settles it.
func (d discrepancyView) AwaitsRun() bool {
	return d.Open() && d.Explanation == "explained" && !d.Recoverable && d.Recovered
}

// viewsOf says ds in words, reading the current state of the items that
// explain the open explained ones (each item once).
func (c *Console) viewsOf(ctx context.Context, ds []reconcile.Discrepancy) ([]discrepancyView, error) {
	out := make([]discrepancyView, len(ds))
	states := map[int64]outbox.State{}
	for i, d := range ds {
		v := discrepancyView{Discrepancy: d, Numbers: numbersInWords(d), Month: d.Hour.Format("2006-01")}
		if d.Open() && d.Explanation == "explained" {
			for _, id := range d.ExplainedBy {
				st, seen := states[id]
				if !seen {
					it, err := c.Outbox.Get(ctx, c.pool, id)
					if err != nil && !errors.Is(err, outbox.ErrNotFound) {
						return nil, err
					}
					st = it.State // "" when not found
					states[id] = st
				}
				v.Recoverable = v.Recoverable || st == outbox.StateUncertain
				v.Recovered = v.Recovered || st == outbox.StateAccepted || st == outbox.StateConfirmed
			}
		}
		out[i] = v
	}
	return out, nil
}

// formulaWords say what a meter's number of an hour is, by its formula.
var formulaWords = map[string]string{"sum": "a total of", "count": "a count of", "last": "a last value of"}

// numbersInWords says what Tally has and what Stripe has for d's hour.
func numbersInWords(d reconcile.Discrepancy) string {
	f := formulaWords[d.Formula]
	var s string
	switch {
	case d.Refused():
		s = fmt.Sprintf("Tally has %s %s from this hour on; Stripe refused to show its numbers for this customer and meter (%s, HTTP %d), so none of Tally's %d items was compared",
			f, d.Expected, d.ErrorCode, d.ErrorStatus, len(d.ExpectedItems))
	case d.Provider == nil:
		s = fmt.Sprintf("Tally has %s %s; Stripe has nothing for this hour: usage not billed", f, d.Expected)
	case d.Difference != nil && strings.HasPrefix(*d.Difference, "-"):
		s = fmt.Sprintf("Tally has %s %s, Stripe %s: Stripe has %s less, usage not billed", f, d.Expected, *d.Provider,
			strings.TrimPrefix(*d.Difference, "-"))
	case d.Difference != nil:
		s = fmt.Sprintf("Tally has %s %s, Stripe %s: Stripe has %s more, the customer may be billed too much", f, d.Expected,
			*d.Provider, *d.Difference)
	default:
		s = fmt.Sprintf("Tally has %s %s, Stripe %s", f, d.Expected, *d.Provider)
	}
	if d.AfterConfirmation() {
		s += "; Stripe's number changed after it had matched"
	}
	return s + "."
}

// openPageData is what the open discrepancies page shows.
type openPageData struct {
	Tenant string
	// Kind filters by kind; Kinds are the choices.
	Kind          string
	Kinds         []kindCount
	Discrepancies []discrepancyView
	// NextHref is the next page, older ones, when more may match.
	NextHref string
	// First: this is the first page (no Before).
	First bool
	// CanResolve: finance and above resolve; CanApply: operators apply
	// plans.
	CanResolve, CanApply bool
	Reasons              []reconcile.ResolutionReason
	Notice               *flash
}

// openDiscrepancies lists the open discrepancies of every run, newest
// first, a page at a time (reconcile.ListOpen), optionally of one tenant
// and one kind.
func (c *Console) openDiscrepancies(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	before, err := strconv.ParseInt(q.Get("before"), 10, 64)
	if err != nil || before < 0 {
		before = 0
	}
	data := openPageData{Tenant: strings.TrimSpace(q.Get("tenant")), First: before == 0, Reasons: reconcile.ResolutionReasons}
	if k := q.Get("kind"); slices.Contains(reconcile.Kinds, k) {
		data.Kind = k // an unknown one lists every kind
	}
	for _, k := range reconcile.Kinds {
		data.Kinds = append(data.Kinds, kindCount{Kind: k, Label: kindLabels[k]})
	}
	if n, ok := reconcileNotices[q.Get("notice")]; ok {
		data.Notice = &n
	}
	if sess, ok := sessionOf(r); ok {
		data.CanResolve, data.CanApply = sess.Role.Allows(auth.RoleFinance), sess.Role.Allows(auth.RoleOperator)
	}
	page, err := reconcile.ListOpen(r.Context(), c.pool, reconcile.OpenQuery{Tenant: data.Tenant, Kind: data.Kind, Before: before})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	if data.Discrepancies, err = c.viewsOf(r.Context(), page.Discrepancies); err != nil {
		c.fail(w, r, err)
		return
	}
	if page.Next != 0 {
		next := url.Values{"before": {strconv.FormatInt(page.Next, 10)}}
		if data.Tenant != "" {
			next.Set("tenant", data.Tenant)
		}
		if data.Kind != "" {
			next.Set("kind", data.Kind)
		}
		data.NextHref = "/console/discrepancies?" + next.Encode()
	}
	c.render(w, r, "discrepancies", "Open discrepancies", data)
}
