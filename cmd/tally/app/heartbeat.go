package app

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/outbox"
)

// heartbeats is tally_job_last_success_age_seconds{job}: how long ago each
// periodic job last completed. Staging and reconciliation run on whichever
// node River gives them, so their heartbeat is read from the database at
// scrape time (River's completed jobs, the reconcile runs); the outbox
// maintenance runs on every node, so its heartbeat is this node's. A job
// that never completed has no series (alert on its absence too).
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
	var stage, rec *float64
	err := h.pool.QueryRow(ctx, `SELECT
		(SELECT extract(epoch FROM clock_timestamp() - max(finalized_at))::float8 FROM river_job
			WHERE kind = 'tally_stage' AND state = 'completed'),
		(SELECT extract(epoch FROM clock_timestamp() - max(finished_at))::float8 FROM reconcile_runs
			WHERE status = 'succeeded')`).Scan(&stage, &rec)
	if err != nil {
		return // the database's own health is /readyz's; the series are absent meanwhile
	}
	if stage != nil {
		ch <- prometheus.MustNewConstMetric(h.desc, prometheus.GaugeValue, *stage, "stage")
	}
	if rec != nil {
		ch <- prometheus.MustNewConstMetric(h.desc, prometheus.GaugeValue, *rec, "reconcile")
	}
}
