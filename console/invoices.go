package console

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/go-chi/chi/v5"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/invoices"
)

// invoicesPageData is what the invoices page shows: the drafts whose
// period is not proven complete (held or not), the gates of the last 100
// days, and the invoice checks that differ.
type invoicesPageData struct {
	Open, Recent []invoices.GateView
	Checks       []invoices.Check
	CanResolve   bool
	Reasons      []invoices.ResolutionReason
	Notice       *flash
}

// invoiceNotices are what resolving a check may come back with, by code.
var invoiceNotices = map[string]flash{
	"resolved":            {Text: "Resolved: the check keeps these numbers; a comparison that finds others opens it again."},
	"invalid_resolution":  {Text: "Not resolved: choose what was done and say in the note how.", Error: true},
	"reason_does_not_fit": {Text: "Not resolved: that reason does not answer what the check found (a credit for invoiced more, billed separately for invoiced less or used but on no invoice).", Error: true},
	"not_a_discrepancy":   {Text: "Not resolved: the check matches, or was not compared.", Error: true},
	"resolved_already":    {Text: "Not resolved: the check was resolved already.", Error: true},
	"not_found":           {Text: "Not resolved: there is no such check.", Error: true},
}

// invoicesPage shows the invoice gates and the checks that differ.
func (c *Console) invoicesPage(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	data := invoicesPageData{Reasons: invoices.ResolutionReasons}
	if n, ok := invoiceNotices[r.URL.Query().Get("notice")]; ok {
		data.Notice = &n
	}
	if sess, ok := sessionOf(r); ok {
		data.CanResolve = sess.Role.Allows(auth.RoleFinance)
	}
	var err error
	if data.Open, err = invoices.Gates(ctx, c.pool, false); err != nil {
		c.fail(w, r, err)
		return
	}
	all, err := invoices.Gates(ctx, c.pool, true)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	for _, g := range all {
		if g.State != invoices.GateWaiting && g.State != invoices.GateHeld && len(data.Recent) < 50 {
			data.Recent = append(data.Recent, g)
		}
	}
	if data.Checks, err = invoices.List(ctx, c.pool, invoices.Filter{Status: invoices.ListOpen}); err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "invoices", "Invoices", data)
}

// resolveInvoiceCheck resolves a check with the form's reason and note and
// goes back to the page saying what came of it.
func (c *Console) resolveInvoiceCheck(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(chi.URLParam(r, "id"), 10, 64)
	if err != nil || id <= 0 {
		http.NotFound(w, r)
		return
	}
	_, err = invoices.Resolve(r.Context(), c.pool, id, invoices.Decision{
		Reason: invoices.ResolutionReason(r.PostFormValue("reason")), Note: r.PostFormValue("note"), By: actor(r)})
	code := "resolved"
	switch {
	case err == nil:
	case errors.Is(err, invoices.ErrResolved):
		code = "resolved_already"
	default:
		if _, ok := invoiceNotices[errcode.ConditionOf(err)]; !ok {
			c.fail(w, r, err)
			return
		}
		code = errcode.ConditionOf(err)
	}
	http.Redirect(w, r, fmt.Sprintf("/console/invoices?%s#check-%d", url.Values{"notice": {code}}.Encode(), id), http.StatusSeeOther)
}

// gateWords says a gate's state in words.
func gateWords(g invoices.GateView) string {
	switch g.State {
	case invoices.GateHeld:
		return "held (auto_advance off) until " + g.HoldUntil.UTC().Format("01-02 15:04")
	case invoices.GateWaiting:
		if g.Incomplete {
			return "incomplete, not held"
		}
		return "waiting for usage on its way"
	case invoices.GateComplete:
		if g.ReleasedAt != nil {
			return "complete; held, released " + g.ReleasedAt.UTC().Format("01-02 15:04")
		}
		return "complete"
	case invoices.GateReleased:
		return "released incomplete: the hold ran out " + g.ReleasedAt.UTC().Format("01-02 15:04")
	}
	return strings.ReplaceAll(string(g.State), "_", " ") + ": the invoice finalized first"
}
