package console

import (
	"context"
	"html/template"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// chartSpan is how far back the overview's charts reach.
const chartSpan = 24 * time.Hour

// backlogStates are the states the backlog chart draws, in its order.
var backlogStates = []outbox.State{outbox.StatePending, outbox.StateLeased, outbox.StateQuarantined, outbox.StateUncertain}

type stateCount struct {
	State, Cue string
	Count      string
	Bad        bool
}

func (c *Console) overview(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	s, _ := sessionOf(r)
	// The open discrepancies of every reconcile run, by kind.
	counts, err := reconcile.OpenCounts(ctx, c.pool)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var (
		open      []kindCount
		openTotal int64
	)
	for _, k := range reconcile.Kinds {
		open = append(open, kindCount{Kind: k, Label: kindLabels[k], Count: counts[k]})
		openTotal += counts[k]
	}
	usage, err := c.usage(ctx)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	data := overviewPage{Usage: usage, Open: open, OpenTotal: openTotal, StripeHasMore: counts[reconcile.KindStripeHasMore]}
	if s.Role.Allows(auth.RoleOperator) {
		if data.Operations, err = c.operations(ctx); err != nil {
			c.fail(w, r, err)
			return
		}
	}
	c.render(w, r, "overview", "Overview", data)
}

// overviewPage is what the overview shows: this month's usage and the
// open discrepancies to everyone, the outbox's states and charts to
// operators.
type overviewPage struct {
	Usage         usageView
	Open          []kindCount
	OpenTotal     int64
	StripeHasMore int64
	Operations    *operationsView
}

// usageView is this month's usage by feature, from the completeness
// report's snapshot (its counters, never the ledger).
type usageView struct {
	Month, AsOf, Href string
	Features          []usageRow
	// Events is the total of every feature's events; values add up per
	// feature only, each in its own unit.
	Events string
}

type usageRow struct {
	Feature, Unit, Href                     string
	Events, Ingested, Billed, Waiting, Held string
	Attention                               bool
}

// usage sums this month's completeness report by feature.
func (c *Console) usage(ctx context.Context) (usageView, error) {
	month := time.Now().UTC().Format("2006-01")
	rep, err := c.Reports.Completeness(ctx, c.pool, month, "", false)
	if err != nil {
		return usageView{}, err
	}
	features, err := c.Mappings.Features(ctx, c.pool)
	if err != nil {
		return usageView{}, err
	}
	units := map[string]mappings.Feature{}
	for _, f := range features {
		units[f.Feature] = f
	}
	type sum struct {
		events                          int64
		ingested, billed, waiting, held quarantine.Value
	}
	sums := map[string]*sum{}
	var (
		order []string
		total int64
	)
	for _, l := range rep.Lines {
		s := sums[l.Feature]
		if s == nil {
			s = &sum{}
			sums[l.Feature] = s
			order = append(order, l.Feature)
		}
		s.events += l.Ingested.Events
		total += l.Ingested.Events
		s.ingested = s.ingested.Plus(l.Ingested.Value)
		s.billed = s.billed.Plus(l.Confirmed.Value).Plus(l.Accepted.Value)
		s.waiting = s.waiting.Plus(l.Pending.Value)
		s.held = s.held.Plus(l.Quarantined.Value).Plus(l.Uncertain.Value).Plus(l.Rejected.Value)
	}
	slices.Sort(order)
	v := usageView{Month: month, AsOf: rep.AsOf, Href: "/console/completeness?period=" + month, Events: grouped(strconv.FormatInt(total, 10))}
	for _, f := range order {
		s := sums[f]
		u, ok := units[f]
		v.Features = append(v.Features, usageRow{Feature: f, Unit: unitOf(u, ok), Href: v.Href,
			Events: grouped(strconv.FormatInt(s.events, 10)), Ingested: grouped(s.ingested.String()), Billed: grouped(s.billed.String()),
			Waiting: grouped(s.waiting.String()), Held: grouped(s.held.String()), Attention: s.held.String() != "0"})
	}
	return v, nil
}

// operationsView is the outbox at a glance, for operators.
type operationsView struct {
	States        []stateCount
	OldestPending string
	BacklogChart  template.HTML
	RateChart     template.HTML
}

// operations reads the outbox's gauge, the backlog's snapshots and the
// export rate of the last 24 hours.
func (c *Console) operations(ctx context.Context) (*operationsView, error) {
	g, err := c.Outbox.ReadGauge(ctx, c.pool)
	if err != nil {
		return nil, err
	}
	var states []stateCount
	for _, st := range outbox.States {
		bad := (st == outbox.StateUncertain || st == outbox.StateRejected || st == outbox.StateQuarantined) && g.Counts[st] > 0
		states = append(states, stateCount{State: string(st), Cue: stateCue[string(st)], Count: grouped(strconv.FormatInt(g.Counts[st], 10)), Bad: bad})
	}
	// The backlog: the maintenance pass's snapshots of the last 24 hours.
	snapshots, err := c.Outbox.Snapshots(ctx, c.pool, chartSpan, backlogStates)
	if err != nil {
		return nil, err
	}
	// The export rate: accepted outcomes per hour, from the attempt log.
	hours, err := c.Outbox.AcceptedPerHour(ctx, c.pool, chartSpan)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	return &operationsView{States: states, OldestPending: (time.Duration(g.OldestPendingAgeSeconds) * time.Second).String(),
		BacklogChart: lineChart(backlogSeries(snapshots), stateNames(backlogStates), now.Add(-chartSpan), now, "items"),
		RateChart:    barChart(ratePoints(hours), now.Add(-chartSpan), now, "accepted")}, nil
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
	invoices.KindInvoicedMore:      "invoiced more than used",
	invoices.KindInvoicedLess:      "invoiced less than used",
	invoices.KindUsedNotInvoiced:   "used but on no invoice",
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
