package console

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/reconcile"
)

// reconcilePageData is what the reconciliation page shows: the open
// discrepancies of every run (Stripe-has-more first) and the latest runs;
// on a run's page, that run with its discrepancies and plan; on the plan's
// page (Review), the plan to confirm, or (Results) what applying it came
// to.
type reconcilePageData struct {
	Runs []reconcile.Run
	Run  *reconcile.Run
	// Discrepancies are the open ones of every run, or the run's.
	Discrepancies []reconcile.Discrepancy
	// OpenCounts count the open ones by kind (the index page).
	OpenCounts []kindCount
	Plan       reconcile.Plan
	Settle     string
	// CanResolve: finance and above resolve discrepancies.
	CanResolve bool
	Reasons    []reconcile.ResolutionReason
	// Notice is what the last action on the page came to.
	Notice *flash
	// Review shows the plan for confirmation; Results, once applied, each
	// action's result.
	Review  bool
	Results []reconcile.PlanResult
}

func (c *Console) reconcilePage(w http.ResponseWriter, r *http.Request) {
	data, ok := c.reconcileData(w, r)
	if ok {
		c.render(w, r, "reconcile", "Reconciliation", data)
	}
}

// reconcileData reads what the page shows: the latest runs, and the run
// the path names (if any) with its discrepancies and plan. It answers the
// request itself (404, 500) when it returns false.
func (c *Console) reconcileData(w http.ResponseWriter, r *http.Request) (reconcilePageData, bool) {
	ctx := r.Context()
	runs, err := reconcile.List(ctx, c.pool, 30)
	if err != nil {
		c.fail(w, r, err)
		return reconcilePageData{}, false
	}
	data := reconcilePageData{Runs: runs, Settle: c.Settle.String(), Reasons: reconcile.ResolutionReasons}
	if n, ok := reconcileNotices[r.URL.Query().Get("notice")]; ok {
		data.Notice = &n
	}
	if sess, ok := sessionOf(r); ok {
		data.CanResolve = sess.Role.Allows(auth.RoleFinance)
	}
	s := chi.URLParam(r, "id")
	if s == "" {
		if data.Discrepancies, err = reconcile.OpenDiscrepancies(ctx, c.pool); err != nil {
			c.fail(w, r, err)
			return data, false
		}
		n := map[string]int64{}
		for _, d := range data.Discrepancies {
			n[d.Kind]++
		}
		for _, k := range reconcile.Kinds {
			data.OpenCounts = append(data.OpenCounts, kindCount{Kind: k, Label: kindLabels[k], Count: n[k]})
		}
		return data, true
	}
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		http.NotFound(w, r)
		return data, false
	}
	run, err := reconcile.Get(ctx, c.pool, id)
	if errors.Is(err, reconcile.ErrNotFound) {
		http.NotFound(w, r)
		return data, false
	}
	if err != nil {
		c.fail(w, r, err)
		return data, false
	}
	data.Run = &run
	if data.Discrepancies, err = reconcile.Discrepancies(ctx, c.pool, id); err != nil {
		c.fail(w, r, err)
		return data, false
	}
	if data.Plan, err = reconcile.PlanOf(ctx, c.pool, c.Outbox, id); err != nil {
		c.fail(w, r, err)
		return data, false
	}
	return data, true
}

func (c *Console) startRun(w http.ResponseWriter, r *http.Request) {
	if c.Reconcile == nil {
		back(w, r, "/console/reconcile", "no_stripe")
		return
	}
	settle, err := time.ParseDuration(strings.TrimSpace(r.PostFormValue("settle")))
	if err != nil || settle < 0 {
		back(w, r, "/console/reconcile", "invalid_settle")
		return
	}
	err = pgx.BeginFunc(r.Context(), c.pool, func(tx pgx.Tx) error {
		id, err := reconcile.Queue(r.Context(), tx, reconcile.TriggerAPI, actor(r), reconcile.Options{Settle: settle})
		if err != nil {
			return err
		}
		return c.Reconcile(r.Context(), tx, id)
	})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	back(w, r, "/console/reconcile", "run_queued")
}

// reconcileRoutes registers the reconciliation page's actions on r, a
// router whose requests have a session (Handler's session group): finance
// and above resolve discrepancies; operators review a run's recovery plan
// and apply it.
func (c *Console) reconcileRoutes(r chi.Router) {
	r.With(requireRole(auth.RoleFinance)).Post("/reconcile/discrepancies/{id}/resolve", c.resolveDiscrepancy)
	r.Group(func(r chi.Router) {
		r.Use(requireRole(auth.RoleOperator))
		r.With(c.limitReads).Get("/reconcile/{id}/plan", c.reviewPlan)
		r.Post("/reconcile/{id}/plan", c.applyPlan)
	})
}

// reconcileNotices are what an action on the page may come back with, by
// code, so that a link cannot make the page say anything else.
var reconcileNotices = map[string]flash{
	"resolved":           {Text: "Resolved: its accepted items are confirmed, and the next runs do not report these numbers again."},
	"invalid_resolution": {Text: "Not resolved: choose a reason that fits (a credit in Stripe when Stripe has more, a repost when it has less) and say in the note what was done.", Error: true},
	"already_resolved":   {Text: "Not resolved: these numbers of this hour are resolved already.", Error: true},
	"superseded":         {Text: "Not resolved: a later run found other numbers for this hour; resolve its discrepancy.", Error: true},
	"items_moved":        {Text: "Not resolved: some of its items are no longer accepted or confirmed; run reconcile again and resolve what it finds.", Error: true},
	"not_found":          {Text: "Not resolved: there is no such discrepancy.", Error: true},
}

// resolveDiscrepancy resolves a discrepancy with the form's reason and
// note, and goes back to its run's page saying what came of it.
func (c *Console) resolveDiscrepancy(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(r) // the path's {id}: here a discrepancy's
	if !ok {
		http.NotFound(w, r)
		return
	}
	to := "/console/reconcile"
	if run, err := strconv.ParseInt(r.PostFormValue("run"), 10, 64); err == nil && run > 0 {
		to = fmt.Sprintf("/console/reconcile/%d", run)
	}
	_, err := reconcile.Resolve(r.Context(), c.pool, c.Outbox, id, reconcile.Decision{
		Reason: reconcile.ResolutionReason(r.PostFormValue("reason")), Note: r.PostFormValue("note"), By: actor(r)})
	code := "resolved"
	if err != nil {
		var ok bool
		if code, _, ok = flashOf("resolve", err); !ok {
			c.fail(w, r, err)
			return
		}
	}
	http.Redirect(w, r, fmt.Sprintf("%s?notice=%s#discrepancy-%d", to, code, id), http.StatusSeeOther)
}

// reviewPlan shows a run's recovery plan for confirmation: each action
// with the lease token it was reviewed at, which the apply carries.
func (c *Console) reviewPlan(w http.ResponseWriter, r *http.Request) {
	data, ok := c.reconcileData(w, r)
	if !ok {
		return
	}
	data.Review = true
	c.render(w, r, "reconcile", "Reconciliation", data)
}

// applyPlan applies the actions of the plan the operator reviewed and
// confirmed (each "item:lease token") through reconcile.ApplyPlan, the
// recoveries of the API and the CLI, and shows what each came to. The
// reasons and targets are the plan's as it is now; an action no longer in
// it, or whose item moved since its review, is refused and changes
// nothing.
func (c *Console) applyPlan(w http.ResponseWriter, r *http.Request) {
	data, ok := c.reconcileData(w, r)
	if !ok {
		return
	}
	if err := r.ParseForm(); err != nil {
		http.Error(w, "the form could not be read", http.StatusBadRequest)
		return
	}
	current := map[int64]reconcile.PlanAction{}
	for _, a := range data.Plan.Actions {
		current[a.Item] = a
	}
	reviewed := reconcile.Plan{RunID: data.Plan.RunID, Created: data.Plan.Created}
	var gone []reconcile.PlanResult
	for _, v := range r.PostForm["action"] {
		item, token, ok := parseAction(v)
		if !ok {
			http.Error(w, "an action of the form is not item:lease_token", http.StatusBadRequest)
			return
		}
		a, in := current[item]
		if !in {
			gone = append(gone, reconcile.PlanResult{Item: item, To: "", Error: "no longer in the plan: the item is not uncertain any more"})
			continue
		}
		a.LeaseToken = token
		reviewed.Actions = append(reviewed.Actions, a)
	}
	data.Results = append(reconcile.ApplyPlan(r.Context(), c.pool, c.Outbox, reviewed, actor(r)), gone...)
	if data.Plan, ok = c.planNow(w, r, data.Plan.RunID); !ok {
		return
	}
	c.render(w, r, "reconcile", "Reconciliation", data)
}

// planNow is run id's plan after an apply: what is left of it.
func (c *Console) planNow(w http.ResponseWriter, r *http.Request, id int64) (reconcile.Plan, bool) {
	p, err := reconcile.PlanOf(r.Context(), c.pool, c.Outbox, id)
	if err != nil {
		c.fail(w, r, err)
		return reconcile.Plan{}, false
	}
	return p, true
}

// parseAction reads a reviewed action of the plan form: "item:lease_token".
func parseAction(v string) (item, token int64, ok bool) {
	a, b, found := strings.Cut(v, ":")
	if !found {
		return 0, 0, false
	}
	item, err1 := strconv.ParseInt(a, 10, 64)
	token, err2 := strconv.ParseInt(b, 10, 64)
	return item, token, err1 == nil && err2 == nil && item > 0 && token >= 0
}
