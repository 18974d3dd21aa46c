package console

import (
	"html/template"
	"net/http"
	"time"

	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// chartSpan is how far back the overview's charts reach.
const chartSpan = 24 * time.Hour

// backlogStates are the states the backlog chart draws, in its order.
var backlogStates = []outbox.State{outbox.StatePending, outbox.StateLeased, outbox.StateQuarantined, outbox.StateUncertain}

type stateCount struct {
	State string
	Count int64
	Bad   bool
}

func (c *Console) overview(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	g, err := c.Outbox.ReadGauge(ctx, c.pool)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var states []stateCount
	for _, st := range outbox.States {
		bad := (st == outbox.StateUncertain || st == outbox.StateRejected || st == outbox.StateQuarantined) && g.Counts[st] > 0
		states = append(states, stateCount{State: string(st), Count: g.Counts[st], Bad: bad})
	}
	// The backlog: the maintenance pass's snapshots of the last 24 hours.
	snapshots, err := c.Outbox.Snapshots(ctx, c.pool, chartSpan, backlogStates)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	// The export rate: accepted outcomes per hour, from the attempt log.
	hours, err := c.Outbox.AcceptedPerHour(ctx, c.pool, chartSpan)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	// The open discrepancies of every reconcile run, by kind.
	counts, err := reconcile.OpenCounts(ctx, c.pool)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var open []kindCount
	for _, k := range reconcile.Kinds {
		open = append(open, kindCount{Kind: k, Label: kindLabels[k], Count: counts[k]})
	}
	now := time.Now()
	c.render(w, r, "overview", "Overview", struct {
		States        []stateCount
		OldestPending string
		Open          []kindCount
		StripeHasMore int64
		BacklogChart  template.HTML
		RateChart     template.HTML
	}{states, (time.Duration(g.OldestPendingAgeSeconds) * time.Second).String(), open, counts[reconcile.KindStripeHasMore],
		lineChart(backlogSeries(snapshots), stateNames(backlogStates), now.Add(-chartSpan), now, "items"),
		barChart(ratePoints(hours), now.Add(-chartSpan), now, "accepted")})
}

// kindCount is how many discrepancies of a kind are open.
type kindCount struct {
	Kind, Label string
	Count       int64
}

// kindLabels say what each kind of discrepancy means, on the overview and
// the reconciliation page.
var kindLabels = map[string]string{
	reconcile.KindStripeHasMore:    "Stripe has more: a customer may be billed too much",
	reconcile.KindStripeHasLess:    "Stripe has less: usage not billed",
	reconcile.KindSummariesRefused: "summaries refused: nothing compared",
}

// backlogSeries is the snapshots as one series of points per state.
func backlogSeries(snapshots []outbox.Snapshot) map[string][]point {
	series := map[string][]point{}
	for _, sn := range snapshots {
		series[string(sn.State)] = append(series[string(sn.State)], point{sn.At, float64(sn.Items)})
	}
	return series
}

// ratePoints is the hourly counts as points.
func ratePoints(hours []outbox.HourCount) []point {
	var pts []point
	for _, h := range hours {
		pts = append(pts, point{h.Hour, float64(h.Count)})
	}
	return pts
}

func stateNames(states []outbox.State) []string {
	out := make([]string, len(states))
	for i, st := range states {
		out[i] = string(st)
	}
	return out
}
