package console

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
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
	Discrepancies []discrepancyView
	// OpenCounts count the open ones by kind (the index page), OpenMore
	// those open beyond the first openOnIndex it lists.
	OpenCounts []kindCount
	OpenMore   int64
	Plan       reconcile.Plan
	// Steps are the plan's actions in words.
	Steps  []planStep
	Settle string
	// SettleNote, on a run's page, says why a run that succeeded confirmed
	// nothing.
	SettleNote string
	// CanResolve: finance and above resolve discrepancies.
	CanResolve bool
	Reasons    []reconcile.ResolutionReason
	// Notice is what the last action on the page came to.
	Notice *flash
	// Review shows the plan for confirmation; Results, once applied, what
	// each action came to.
	Review  bool
	Results []planOutcome
	// ResultsMore counts the items applying the plan came to that Results
	// does not name.
	ResultsMore int
}

// planStep is an action of a plan in words: what happened to its item
// and what applying the plan does to it.
type planStep struct {
	reconcile.PlanAction
	Happened, Does string
}

// stepsOf says each action of p in words.
func stepsOf(p reconcile.Plan) []planStep {
	out := make([]planStep, len(p.Actions))
	for i, a := range p.Actions {
		d := a.Evidence
		stripe := "nothing"
		if d.Provider != nil {
			stripe = *d.Provider
		}
		out[i] = planStep{PlanAction: a,
			Happened: fmt.Sprintf("It was sent and no answer came back. For %s's %s in the hour of %s UTC, Stripe has %s and Tally %s without it: this item makes up the difference, so Stripe has it.",
				d.Customer, d.EventName, d.Hour.Format("2006-01-02 15:04"), stripe, d.Expected),
			Does: "Marks it accepted: Stripe has it, it is never sent again, and the next run confirms it."}
	}
	return out
}

// planOutcome is what applying one action of a plan came to.
type planOutcome struct {
	Item    int64
	Applied bool
}

// openOnIndex is how many open discrepancies the index page lists; the
// open-discrepancies page pages through them all.
const openOnIndex = 50

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
	data := reconcilePageData{Runs: runs, Settle: durationWords(c.Settle), Reasons: reconcile.ResolutionReasons}
	if n, ok := reconcileNotices[r.URL.Query().Get("notice")]; ok {
		data.Notice = &n
	}
	if sess, ok := sessionOf(r); ok {
		data.CanResolve = sess.Role.Allows(auth.RoleFinance)
	}
	s := chi.URLParam(r, "id")
	if s == "" {
		open, err := reconcile.FirstOpen(ctx, c.pool, openOnIndex)
		if err != nil {
			c.fail(w, r, err)
			return data, false
		}
		if data.Discrepancies, err = c.viewsOf(ctx, open); err != nil {
			c.fail(w, r, err)
			return data, false
		}
		n, err := reconcile.OpenCounts(ctx, c.pool)
		if err != nil {
			c.fail(w, r, err)
			return data, false
		}
		var total int64
		for _, k := range reconcile.Kinds {
			data.OpenCounts = append(data.OpenCounts, kindCount{Kind: k, Label: kindLabels[k], Count: n[k]})
			total += n[k]
		}
		data.OpenMore = total - int64(len(open))
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
	ds, err := reconcile.Discrepancies(ctx, c.pool, id)
	if err != nil {
		c.fail(w, r, err)
		return data, false
	}
	data.SettleNote = settleNote(run, len(ds))
	if data.Discrepancies, err = c.viewsOf(ctx, ds); err != nil {
		c.fail(w, r, err)
		return data, false
	}
	if data.Plan, err = reconcile.PlanOf(ctx, c.pool, c.Outbox, id); err != nil {
		c.fail(w, r, err)
		return data, false
	}
	data.Steps = stepsOf(data.Plan)
	data.Results, data.ResultsMore = outcomesOf(r.URL.Query())
	return data, true
}

// settleNote says why run, having succeeded, confirmed nothing: it leaves
// out the usage of its settle delay, which Stripe may still be counting.
// Empty when it confirmed something, found discrepancies (found, of
// them), or has not succeeded.
func settleNote(run reconcile.Run, found int) string {
	if run.Status != "succeeded" || run.ItemsConfirmed > 0 || run.Discrepancies > 0 || found > 0 {
		return ""
	}
	return fmt.Sprintf("This run confirmed nothing. It compares only usage older than its settle delay (%s), "+
		"because Stripe may still be counting newer usage: whatever was sent within that time waits for a run started after it has passed. "+
		"Runs start on their schedule, or here.", settleWords(run.Settle))
}

// settleWords says a settle delay as PostgreSQL writes an interval
// ("02:00:00") in Go's words ("2h"); as it is when it is not of that
// form.
func settleWords(interval string) string {
	var h, m, sec int
	if n, err := fmt.Sscanf(interval, "%d:%d:%d", &h, &m, &sec); err != nil || n != 3 {
		return interval
	}
	return durationWords(time.Duration(h)*time.Hour + time.Duration(m)*time.Minute + time.Duration(sec)*time.Second)
}

// durationWords is d as Go writes it without its zero tails: "2h", not
// "2h0m0s".
func durationWords(d time.Duration) string {
	out := d.String()
	if strings.HasSuffix(out, "m0s") {
		out = strings.TrimSuffix(out, "0s")
	}
	if strings.HasSuffix(out, "h0m") {
		out = strings.TrimSuffix(out, "0m")
	}
	return out
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
	r.With(c.limitReads).Get("/discrepancies", c.openDiscrepancies)
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
// note, and goes back to the page the form was on (its run's, the
// reconciliation page, or the open discrepancies with their filter)
// saying what came of it.
func (c *Console) resolveDiscrepancy(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(r) // the path's {id}: here a discrepancy's
	if !ok {
		http.NotFound(w, r)
		return
	}
	to, q := "/console/reconcile", url.Values{}
	if run, err := strconv.ParseInt(r.PostFormValue("run"), 10, 64); err == nil && run > 0 {
		to = fmt.Sprintf("/console/reconcile/%d", run)
	}
	if r.PostFormValue("from") == "open" {
		to = "/console/discrepancies"
		if t := r.PostFormValue("tenant"); t != "" {
			q.Set("tenant", t)
		}
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
	q.Set("notice", code)
	http.Redirect(w, r, fmt.Sprintf("%s?%s#discrepancy-%d", to, q.Encode(), id), http.StatusSeeOther)
}

// reviewPlan shows a run's recovery plan for confirmation, each action
// in words; the form carries each item's lease token as reviewed, so that
// an item that moved since is refused.
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
// recoveries of the API and the CLI, and redirects to the run's page,
// which shows what each came to. The reasons and targets are the plan's
// as it is now; an action no longer in it, or whose item moved since its
// review, is refused and changes nothing.
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
	var refused []int64
	for _, v := range r.PostForm["action"] {
		item, token, ok := parseAction(v)
		if !ok {
			http.Error(w, "an action of the form is not item:lease_token", http.StatusBadRequest)
			return
		}
		a, in := current[item]
		if !in {
			refused = append(refused, item) // no longer uncertain
			continue
		}
		a.LeaseToken = token
		reviewed.Actions = append(reviewed.Actions, a)
	}
	var applied []int64
	for _, res := range reconcile.ApplyPlan(r.Context(), c.pool, c.Outbox, reviewed, actor(r)) {
		if res.Applied {
			applied = append(applied, res.Item)
		} else {
			refused = append(refused, res.Item)
		}
	}
	q := url.Values{}
	q.Set("applied", joinIDs(applied))
	q.Set("refused", joinIDs(refused))
	http.Redirect(w, r, fmt.Sprintf("/console/reconcile/%d?%s#results", data.Plan.RunID, q.Encode()), http.StatusSeeOther)
}

// maxOutcomes bounds the items a redirect after applying a plan names,
// of each kind, so that its address stays short; the rest are counted.
const maxOutcomes = 200

// joinIDs writes ids as the query of a redirect: comma-separated, at most
// maxOutcomes of them, then "+N" for the rest.
func joinIDs(ids []int64) string {
	var b strings.Builder
	for i, id := range ids {
		if i == maxOutcomes {
			fmt.Fprintf(&b, ",+%d", len(ids)-i)
			break
		}
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(id, 10))
	}
	return b.String()
}

// outcomesOf reads what applying a plan came to from the redirect's query
// (applied and refused, as joinIDs wrote them): the items named, and how
// many more were not. Nil without one.
func outcomesOf(q url.Values) (out []planOutcome, more int) {
	if !q.Has("applied") && !q.Has("refused") {
		return nil, 0
	}
	out = []planOutcome{}
	for _, k := range []string{"applied", "refused"} {
		for i, v := range strings.Split(q.Get(k), ",") {
			if n, err := strconv.Atoi(strings.TrimPrefix(v, "+")); err == nil && strings.HasPrefix(v, "+") && n > 0 {
				more += n
			} else if id, err := strconv.ParseInt(v, 10, 64); err == nil && id > 0 && i < maxOutcomes {
				out = append(out, planOutcome{Item: id, Applied: k == "applied"})
			}
		}
	}
	return out, more
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
