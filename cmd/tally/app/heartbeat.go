package app

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// heartbeats is tally_job_last_success_age_seconds{job}: how long ago each
// periodic job last completed. Staging and reconciliation run on whichever
// node River gives them, so their heartbeat is read from the database at
// scrape time (River's completed staging jobs through package meter, the
// reconcile runs through package reconcile); the outbox maintenance runs
// on every node, so its heartbeat is this node's. A job that never
// completed has no series (alert on its absence too).
type heartbeats struct {
	pool   *pgxpool.Pool
	outbox *outbox.Store
	desc   *prometheus.Desc
}

func newHeartbeats(pool *pgxpool.Pool, ob *outbox.Store) *heartbeats {
	return &heartbeats{pool: pool, outbox: ob, desc: prometheus.NewDesc("tally_job_last_success_age_seconds",
		"Seconds since each periodic job last completed: stage (staging pass, any node), reconcile (a reconcile run that succeeded, any node), maintenance (the outbox maintenance pass, this node).",
		[]string{"job"}, nil)}
}

func (h *heartbeats) Describe(ch chan<- *prometheus.Desc) { ch <- h.desc }

func (h *heartbeats) Collect(ch chan<- prometheus.Metric) {
	if t := h.outbox.LastMaintained(); !t.IsZero() {
		ch <- prometheus.MustNewConstMetric(h.desc, prometheus.GaugeValue, time.Since(t).Seconds(), "maintenance")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	// The database's own health is /readyz's: on an error the series are
	// absent meanwhile, both of them, as one failed reading.
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
}
