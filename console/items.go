package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// reviewListLimit bounds the list of uncertain and rejected items.
const reviewListLimit = 500

// stateWords say what an item's state means, on its page.
var stateWords = map[outbox.State]string{
	outbox.StatePending:     "Waiting to be sent to Stripe.",
	outbox.StateLeased:      "Being sent to Stripe now.",
	outbox.StateAccepted:    "Stripe accepted it; a reconcile run confirms it once Stripe's numbers for its hour match.",
	outbox.StateConfirmed:   "Stripe's numbers for its hour match Tally's: it is billed.",
	outbox.StateUncertain:   "It was sent, but no answer came back: Stripe may or may not have it. Someone has to decide what happened.",
	outbox.StateRejected:    "Stripe refused it, or someone abandoned it: it is not billed.",
	outbox.StateQuarantined: "Held back before sending: it cannot be sent as it is (see the reason).",
	outbox.StateSuperseded:  "Its usage moved to another item, under a newer mapping.",
	outbox.StateWithdrawn:   "Withdrawn: its usage was taken back before it was billed.",
}

// outcome is a choice of what happened to an uncertain item.
type outcome struct {
	To    outbox.State
	Label string
}

// outcomes are the choices a recovery offers, none of them chosen
// beforehand: the operator must say which one happened.
var outcomes = []outcome{
	{outbox.StateAccepted, "Stripe has it: mark it accepted (it is not sent again; a reconcile run confirms it)"},
	{outbox.StatePending, "Stripe does not have it: send it again, under the same identifier"},
	{outbox.StateRejected, "Abandon it: mark it rejected, never billed (say why)"},
}

// outcomeLabels are the outcomes' labels by state.
var outcomeLabels = func() map[outbox.State]string {
	m := map[outbox.State]string{}
	for _, o := range outcomes {
		m[o.To] = o.Label
	}
	return m
}()

// itemPage is what an item's page shows.
type itemPage struct {
	Item       outbox.Item
	StateWords string
	// UsageAt is the usage's time, and PeriodFrom its billing period's
	// start, as the page writes them.
	UsageAt, PeriodFrom string
	Payload             string
	Attempts            []outbox.Attempt
	Evidence            []reconcile.Evidence
	Audit               []audit.Entry
	// CanRecover: an operator, and the item is uncertain.
	CanRecover bool
	Outcomes   []outcome
	Notice     *flash
}

func (c *Console) item(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	id, ok := itemID(r)
	if !ok {
		http.NotFound(w, r)
		return
	}
	it, err := c.Outbox.Get(ctx, c.pool, id)
	if errors.Is(err, outbox.ErrNotFound) {
		http.NotFound(w, r)
		return
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	p := itemPage{Item: it, StateWords: stateWords[it.State], Payload: prettyJSON(it.Payload), Outcomes: outcomes,
		Notice: recoveryNotice(r.URL.Query()), UsageAt: time.Unix(it.Payload.Timestamp, 0).UTC().Format("2006-01-02 15:04:05"),
		PeriodFrom: it.Payload.Period}
	if t, err := time.Parse(time.RFC3339, it.Payload.Period); err == nil {
		p.PeriodFrom = t.UTC().Format("2006-01-02")
	}
	if p.Attempts, err = c.Outbox.Attempts(ctx, c.pool, id); err != nil {
		c.fail(w, r, err)
		return
	}
	if p.Evidence, err = reconcile.EvidenceOf(ctx, c.pool, []int64{id}); err != nil {
		c.fail(w, r, err)
		return
	}
	if p.Audit, err = audit.List(ctx, c.pool, audit.Item(id), 100); err != nil {
		c.fail(w, r, err)
		return
	}
	s, _ := sessionOf(r)
	p.CanRecover = s.Role.Allows(auth.RoleOperator) && it.State == outbox.StateUncertain
	c.render(w, r, "item", fmt.Sprintf("Item %d", id), p)
}

// doubtfulItem is an uncertain or rejected item with what the latest
// reconcile run suggests for it.
type doubtfulItem struct {
	outbox.ReviewItem
	Suggestion string
}

// uncertainPage is what the uncertain page shows: the list, or the review
// of a bulk recovery.
type uncertainPage struct {
	// Tenant and Feature filter the list.
	Tenant, Feature string
	Items           []doubtfulItem
	// Uncertain counts the listed items that are uncertain.
	Uncertain int
	Outcomes  []outcome
	Notice    *flash
	// Review is the bulk recovery to confirm, nil on the list.
	Review *bulkReview
}

// bulkReview is a bulk recovery as the operator reviews it.
type bulkReview struct {
	To         outbox.State
	ToLabel    string
	Reason     string
	NotReached bool
	// Items are those it recovers, each as it is now; Left those it
	// leaves out, no longer uncertain.
	Items []outbox.Item
	Left  []outbox.Item
	// BackHref is the list with the filter the review came from.
	BackHref string
}

// filtered keeps the items of the tenant and feature (either empty: any).
func filtered(items []outbox.ReviewItem, tenant, feature string) []outbox.ReviewItem {
	out := items[:0:0]
	for _, it := range items {
		if (tenant == "" || it.Tenant == tenant) && (feature == "" || it.Feature == feature) {
			out = append(out, it)
		}
	}
	return out
}

func (c *Console) uncertain(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	q := r.URL.Query()
	p := uncertainPage{Tenant: strings.TrimSpace(q.Get("tenant")), Feature: strings.TrimSpace(q.Get("feature")),
		Outcomes: outcomes, Notice: recoveryNotice(q)}
	review, err := c.Outbox.ForReview(ctx, c.pool, reviewListLimit)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	suggest, err := c.suggestions(ctx)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	for _, it := range filtered(review, p.Tenant, p.Feature) {
		p.Items = append(p.Items, doubtfulItem{ReviewItem: it, Suggestion: suggest[it.ID]})
		if it.State == outbox.StateUncertain {
			p.Uncertain++
		}
	}
	c.render(w, r, "uncertain", "Uncertain and rejected", p)
}

// suggestions are the recoveries the plan of the latest successful run
// suggests, by item; none before a run has succeeded.
func (c *Console) suggestions(ctx context.Context) (map[int64]string, error) {
	runID, ok, err := reconcile.LatestSucceeded(ctx, c.pool)
	if err != nil || !ok {
		return nil, err
	}
	plan, err := reconcile.PlanOf(ctx, c.pool, c.Outbox, runID)
	if err != nil {
		return nil, err
	}
	suggest := map[int64]string{}
	for _, a := range plan.Actions {
		suggest[a.Item] = fmt.Sprintf("Stripe has it: run %d found its %s of %s in Stripe's numbers", plan.RunID,
			a.Evidence.EventName, a.Evidence.Hour.Format("2006-01-02 15:04"))
	}
	return suggest, nil
}

// recoveryRoutes registers the bulk recovery of uncertain items on r, a
// router whose requests have a session: operators review it (a read of up
// to reconcile.MaxRecoverAll items, bounded like the other expensive
// pages), then confirm it.
func (c *Console) recoveryRoutes(r chi.Router) {
	r.Group(func(r chi.Router) {
		r.Use(requireRole(auth.RoleOperator))
		r.With(c.limitReads).Get("/uncertain/review", c.reviewRecovery)
		r.Post("/uncertain/recover", c.recoverAll)
	})
}

// recoveryNotices are what a recovery may come back with, by code, so that
// a link cannot make a page say anything else; %d is the query's n (a
// count, or an item).
var recoveryNotices = map[string]flash{
	"recovered_accepted": {Text: "Recovered: the item is accepted; it is not sent again."},
	"recovered_pending":  {Text: "Recovered: the item is pending; it is sent again under the same identifier."},
	"recovered_rejected": {Text: "Recovered: the item is rejected; it is not billed."},
	"bulk_recovered":     {Text: "Recovered %d items, each in the audit log under your name."},
	"choose_outcome":     {Text: "Not recovered: choose what happened — Stripe has it, send it again, or abandon it.", Error: true},
	"choose_items":       {Text: "Not recovered: tick the uncertain items to recover, or choose all that match the filter.", Error: true},
	"bulk_moved":         {Text: "Nothing recovered: item %d changed since you reviewed it (sent again, or recovered by someone else). Review again.", Error: true},
	"bulk_too_many":      {Text: "Not recovered: recover at most %d items at once; narrow the filter.", Error: true},
	"expected_state":     {Text: "Not recovered: the item is no longer uncertain (or changed since the page was drawn).", Error: true},
	"invalid_recovery":   {Text: "Not recovered: give a reason (required to abandon an item, and with 'nothing reached Stripe', which goes with sending again only).", Error: true},
	"past_horizon":       {Text: "Not recovered: too long has passed for Stripe to recognise a resend as the same event; send it again only with 'nothing reached Stripe' and a reason.", Error: true},
}

// recoveryNotice is the notice a page's query names, with its count.
func recoveryNotice(q url.Values) *flash {
	f, ok := recoveryNotices[q.Get("notice")]
	if !ok {
		return nil
	}
	if strings.Contains(f.Text, "%d") {
		n, err := strconv.ParseInt(q.Get("n"), 10, 64)
		if err != nil || n < 0 {
			return nil
		}
		f.Text = fmt.Sprintf(f.Text, n)
	}
	return &f
}

// noticeURL is page with the notice code and, when not 0, its n.
func noticeURL(page string, q url.Values, code string, n int64) string {
	if q == nil {
		q = url.Values{}
	}
	q.Set("notice", code)
	if n != 0 {
		q.Set("n", strconv.FormatInt(n, 10))
	}
	return page + "?" + q.Encode()
}

// recoveryOf reads the recovery a form or a query asks for.
func recoveryOf(v url.Values, by string) reconcile.Recovery {
	return reconcile.Recovery{Expect: outbox.StateUncertain, To: outbox.State(v.Get("to")),
		Reason: strings.TrimSpace(v.Get("reason")), NotReached: v.Get("not_reached") != "", By: by}
}

// invalidCode is the notice of a recovery Validate refuses.
func invalidCode(rec reconcile.Recovery) string {
	if rec.To == "" {
		return "choose_outcome"
	}
	return "invalid_recovery"
}

// recover recovers one uncertain item as its page's form says, at the
// lease token the page was drawn with, and goes back to the page saying
// what came of it.
func (c *Console) recover(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(r)
	if !ok {
		http.NotFound(w, r)
		return
	}
	if err := r.ParseForm(); err != nil {
		http.Error(w, "the form could not be read", http.StatusBadRequest)
		return
	}
	rec := recoveryOf(r.PostForm, actor(r))
	if t, err := strconv.ParseInt(r.PostFormValue("lease_token"), 10, 64); err == nil {
		rec.LeaseToken = &t
	}
	page := fmt.Sprintf("/console/items/%d", id)
	if err := rec.Validate(); err != nil {
		http.Redirect(w, r, noticeURL(page, nil, invalidCode(rec), 0), http.StatusSeeOther)
		return
	}
	if _, err := reconcile.Recover(r.Context(), c.pool, c.Outbox, id, rec); err != nil {
		code, notFound, ok := flashOf("recover", err)
		switch {
		case !ok:
			c.fail(w, r, err)
		case notFound:
			http.NotFound(w, r)
		default:
			http.Redirect(w, r, noticeURL(page, nil, code, 0), http.StatusSeeOther)
		}
		return
	}
	http.Redirect(w, r, noticeURL(page, nil, "recovered_"+string(rec.To), 0), http.StatusSeeOther)
}

// listQuery is the uncertain list's filter as a query.
func listQuery(tenant, feature string) url.Values {
	q := url.Values{}
	if tenant != "" {
		q.Set("tenant", tenant)
	}
	if feature != "" {
		q.Set("feature", feature)
	}
	return q
}

// reviewRecovery shows what a bulk recovery would do: the ticked items
// (or, with all, every uncertain one the filter matches), each as it is
// now, with counts; it changes nothing. Its form carries each item's
// lease token, so an item that moves before the confirmation refuses the
// whole recovery.
func (c *Console) reviewRecovery(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	q := r.URL.Query()
	tenant, feature := strings.TrimSpace(q.Get("tenant")), strings.TrimSpace(q.Get("feature"))
	rec := recoveryOf(q, actor(r))
	if err := rec.Validate(); err != nil {
		http.Redirect(w, r, noticeURL("/console/uncertain", listQuery(tenant, feature), invalidCode(rec), 0), http.StatusSeeOther)
		return
	}
	var ids []int64
	if q.Get("all") != "" {
		review, err := c.Outbox.ForReview(ctx, c.pool, reviewListLimit)
		if err != nil {
			c.fail(w, r, err)
			return
		}
		for _, it := range filtered(review, tenant, feature) {
			if it.State == outbox.StateUncertain {
				ids = append(ids, it.ID)
			}
		}
	} else {
		for _, v := range q["item"] {
			if id, err := strconv.ParseInt(v, 10, 64); err == nil && id > 0 {
				ids = append(ids, id)
			}
		}
	}
	if len(ids) == 0 {
		http.Redirect(w, r, noticeURL("/console/uncertain", listQuery(tenant, feature), "choose_items", 0), http.StatusSeeOther)
		return
	}
	if len(ids) > reconcile.MaxRecoverAll {
		http.Redirect(w, r, noticeURL("/console/uncertain", listQuery(tenant, feature), "bulk_too_many", reconcile.MaxRecoverAll), http.StatusSeeOther)
		return
	}
	b := &bulkReview{To: rec.To, ToLabel: outcomeLabels[rec.To], Reason: rec.Reason, NotReached: rec.NotReached,
		BackHref: "/console/uncertain?" + listQuery(tenant, feature).Encode()}
	for _, id := range ids {
		it, err := c.Outbox.Get(ctx, c.pool, id)
		if errors.Is(err, outbox.ErrNotFound) {
			continue
		}
		if err != nil {
			c.fail(w, r, err)
			return
		}
		if it.State == outbox.StateUncertain {
			b.Items = append(b.Items, it)
		} else {
			b.Left = append(b.Left, it)
		}
	}
	c.render(w, r, "uncertain", "Recover uncertain items", uncertainPage{Tenant: tenant, Feature: feature, Review: b})
}

// recoverAll applies a reviewed bulk recovery (each "item:lease token")
// in one transaction (reconcile.RecoverAll): every item, or, when one
// moved since the review, none. It redirects to the list saying what came
// of it.
func (c *Console) recoverAll(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil {
		http.Error(w, "the form could not be read", http.StatusBadRequest)
		return
	}
	back := listQuery(strings.TrimSpace(r.PostForm.Get("tenant")), strings.TrimSpace(r.PostForm.Get("feature")))
	rec := recoveryOf(r.PostForm, actor(r))
	if err := rec.Validate(); err != nil {
		http.Redirect(w, r, noticeURL("/console/uncertain", back, invalidCode(rec), 0), http.StatusSeeOther)
		return
	}
	var items []reconcile.Reviewed
	for _, v := range r.PostForm["item"] {
		item, token, ok := parseAction(v)
		if !ok {
			http.Error(w, "an item of the form is not item:lease_token", http.StatusBadRequest)
			return
		}
		items = append(items, reconcile.Reviewed{Item: item, LeaseToken: token})
	}
	if len(items) == 0 {
		http.Redirect(w, r, noticeURL("/console/uncertain", back, "choose_items", 0), http.StatusSeeOther)
		return
	}
	err := reconcile.RecoverAll(r.Context(), c.pool, c.Outbox, items, rec)
	if err == nil {
		http.Redirect(w, r, noticeURL("/console/uncertain", back, "bulk_recovered", int64(len(items))), http.StatusSeeOther)
		return
	}
	code, notFound, ok := flashOf("recover_all", err)
	if !ok {
		c.fail(w, r, err)
		return
	}
	var n int64
	var se *reconcile.ExpectedStateError
	switch {
	case notFound:
		code = "expected_state"
	case code == "bulk_moved" && errors.As(err, &se):
		n = se.ID
	case code == "bulk_too_many":
		n = reconcile.MaxRecoverAll
	}
	http.Redirect(w, r, noticeURL("/console/uncertain", back, code, n), http.StatusSeeOther)
}
