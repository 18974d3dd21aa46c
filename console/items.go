package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// reviewListLimit bounds the list of uncertain and rejected items.
const reviewListLimit = 500

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
	attempts, err := c.Outbox.Attempts(ctx, c.pool, id)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	evidence, err := reconcile.EvidenceOf(ctx, c.pool, []int64{id})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	trail, err := audit.List(ctx, c.pool, audit.Item(id), 100)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, "item", fmt.Sprintf("Item %d", id), struct {
		Item     outbox.Item
		Payload  string
		Attempts []outbox.Attempt
		Evidence []reconcile.Evidence
		Audit    []audit.Entry
	}{it, prettyJSON(it.Payload), attempts, evidence, trail})
}

// doubtfulItem is an uncertain or rejected item with what the latest
// reconcile run suggests for it.
type doubtfulItem struct {
	outbox.ReviewItem
	Suggestion string
}

func (c *Console) uncertain(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
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
	items := make([]doubtfulItem, len(review))
	for i, it := range review {
		items[i] = doubtfulItem{ReviewItem: it, Suggestion: suggest[it.ID]}
	}
	c.render(w, r, "uncertain", "Uncertain and rejected", struct{ Items []doubtfulItem }{items})
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
		suggest[a.Item] = fmt.Sprintf("recover to %s (run %d: Stripe's %s at %s)", a.To, plan.RunID, a.Evidence.EventName, a.Evidence.Hour.Format("2006-01-02 15:04"))
	}
	return suggest, nil
}

func (c *Console) recover(w http.ResponseWriter, r *http.Request) {
	id, ok := itemID(r)
	if !ok {
		http.NotFound(w, r)
		return
	}
	_, err := reconcile.Recover(r.Context(), c.pool, c.Outbox, id, reconcile.Recovery{
		Expect: outbox.State(r.PostFormValue("expect")), To: outbox.State(r.PostFormValue("to")),
		Reason: r.PostFormValue("reason"), NotReached: r.PostFormValue("not_reached") != "", By: actor(r)})
	if err != nil {
		c.refused(w, r, "recover", "/console/uncertain", err)
		return
	}
	back(w, r, "/console/uncertain", "recovered")
}
