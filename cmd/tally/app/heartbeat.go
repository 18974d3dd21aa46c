package app

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// heartbeats are the readings of the shared database taken at scrape time.
//
// tally_job_last_success_age_seconds{task}: how long ago each periodic job
// last completed. Staging and reconciliation run on whichever node River
// gives them, so their heartbeat is read from the database (River's
// completed staging jobs through package meter — a pass skipped because
// export is stalled does not count —, the reconcile runs through package
// reconcile); the outbox maintenance runs on every node, so its heartbeat
// is this node's. task="reports" is the listing of Stripe's events: how
// long ago any account's listing last succeeded, any node (package
// reconcile). A job that never completed has no series (alert on its
// absence too).
//
// tally_stripe_events_last_delivery_age_seconds: how long ago the event
// destination last delivered an event Tally records, any node; absent
// until it has. Reports are rare when all is well: the listing's
// recordings (tally_stripe_events_total{arrival="listing"}) say better
// whether the destination misses some.
//
// tally_ledger_unstaged_events and tally_ledger_oldest_unstaged_age_seconds:
// the usage waiting in the ledger, not yet staged into outbox items (through
// package meter). While export is stalled it waits here, not in the outbox.
//
// tally_reconcile_open_discrepancies{kind}: the discrepancies with Stripe
// open now, of every reconcile run (through package reconcile), the same
// on every node.
type heartbeats struct {
	pool     *pgxpool.Pool
	outbox   *outbox.Store
	desc     *prometheus.Desc
	unstaged *prometheus.Desc
	oldest   *prometheus.Desc
	open     *prometheus.Desc
	delivery *prometheus.Desc
}

func newHeartbeats(pool *pgxpool.Pool, ob *outbox.Store) *heartbeats {
	return &heartbeats{pool: pool, outbox: ob,
		desc: prometheus.NewDesc("tally_job_last_success_age_seconds",
			"Seconds since each periodic job last completed: stage (a staging pass that was not skipped for a stalled export, any node), reconcile (a reconcile run that succeeded, any node), reports (a listing of an account's Stripe events that succeeded, any node), maintenance (the outbox maintenance pass, this node).",
			[]string{"task"}, nil),
		unstaged: prometheus.NewDesc("tally_ledger_unstaged_events",
			fmt.Sprintf("Usage events in the ledger not yet staged into outbox items, counted up to %d (at it: at least that many).", meter.BacklogCountCap),
			nil, nil),
		oldest: prometheus.NewDesc("tally_ledger_oldest_unstaged_age_seconds",
			"Seconds since the oldest unstaged usage event was received; 0 when none waits.",
			nil, nil),
		open: prometheus.NewDesc("tally_reconcile_open_discrepancies",
			"Discrepancies with Stripe open now, of every reconcile run (unresolved, and no later run compared the hour again), by kind: stripe_has_more (Stripe counts more than Tally: a customer may be billed too much), stripe_has_less (usage not billed), summaries_refused (Stripe refused a key's summaries). Read from the database: the same on every node.",
			[]string{"kind"}, nil),
		delivery: prometheus.NewDesc("tally_stripe_events_last_delivery_age_seconds",
			"Seconds since Stripe's event destination last delivered an event Tally records (POST /v1/stripe/events), any node; absent until it has.",
			nil, nil)}
}

func (h *heartbeats) Describe(ch chan<- *prometheus.Desc) {
	ch <- h.desc
	ch <- h.unstaged
	ch <- h.oldest
	ch <- h.open
	ch <- h.delivery
}

func (h *heartbeats) Collect(ch chan<- prometheus.Metric) {
	if t := h.outbox.LastMaintained(); !t.IsZero() {
		ch <- prometheus.MustNewConstMetric(h.desc, prometheus.GaugeValue, time.Since(t).Seconds(), "maintenance")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	// The database's own health is /readyz's: on an error the series of
	// that reading are absent meanwhile.
	if b, err := meter.ReadBacklog(ctx, h.pool); err == nil {
		ch <- prometheus.MustNewConstMetric(h.unstaged, prometheus.GaugeValue, float64(b.Events))
		ch <- prometheus.MustNewConstMetric(h.oldest, prometheus.GaugeValue, b.OldestAge.Seconds())
	}
	if open, err := reconcile.OpenCounts(ctx, h.pool); err == nil {
		for _, kind := range reconcile.Kinds {
			ch <- prometheus.MustNewConstMetric(h.open, prometheus.GaugeValue, float64(open[kind]), kind)
		}
	}
	stage, staged, err := meter.SinceLastStage(ctx, h.pool)
	if err != nil {
		return
	}
	rec, reconciled, err := reconcile.SinceLastSuccess(ctx, h.pool)
	if err != nil {
		return
	}
	if staged {
		ch <- prometheus.MustNewConstMetric(h.desc, prometheus.GaugeValue, stage.Seconds(), "stage")
	}
	if reconciled {
		ch <- prometheus.MustNewConstMetric(h.desc, prometheus.GaugeValue, rec.Seconds(), "reconcile")
	}
	if since, listed, err := reconcile.SinceLastListing(ctx, h.pool); err == nil && listed {
		ch <- prometheus.MustNewConstMetric(h.desc, prometheus.GaugeValue, since.Seconds(), "reports")
	}
	if since, delivered, err := reconcile.SinceLastDelivery(ctx, h.pool); err == nil && delivered {
		ch <- prometheus.MustNewConstMetric(h.delivery, prometheus.GaugeValue, since.Seconds())
	}
}
