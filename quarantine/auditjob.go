package quarantine

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/robfig/cron/v3"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// AuditArgs is the River job that audits the completeness counters of the
// current and the previous month against the ledger.
type AuditArgs struct{}

// Kind names the job.
func (AuditArgs) Kind() string { return "tally_completeness_audit" }

// AuditQueue is the River queue of audits: one at a time, apart from
// staging (an audit reads whole months).
const AuditQueue = "completeness_audit"

// AuditSchedule is when the nightly audit runs: 03:17 UTC, away from the
// hour's staging and the reconcile run's usual minute.
const AuditSchedule = "17 3 * * *"

// DefaultAuditTimeout bounds each statement of an audit.
const DefaultAuditTimeout = 30 * time.Minute

// AuditWorker runs AuditArgs: it audits each month, records the result in
// completeness_audits, logs every key that differs (an error naming tenant,
// feature, period and bucket) and sets tally_completeness_drift_keys to
// the number of keys the audit found. It never changes a counter's sum: it
// only folds the slots of past months into one row each.
type AuditWorker struct {
	river.WorkerDefaults[AuditArgs]
	DB pgdb.DB
	// StatementTimeout bounds each statement of an audit. Defaults to
	// DefaultAuditTimeout.
	StatementTimeout time.Duration
	Metrics          *AuditMetrics
	Logger           *slog.Logger
}

// sqlAuditMonths names the months the nightly audit reads, by the
// database's clock: the current month and the previous one, whose periods
// still move in the first days (late usage, confirmations).
const sqlAuditMonths = `
SELECT to_char(now() AT TIME ZONE 'UTC' - interval '1 month', 'YYYY-MM'), to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM')`

// Timeout lets an audit run as long as its statements may (River's
// default is a minute).
func (w *AuditWorker) Timeout(*river.Job[AuditArgs]) time.Duration { return -1 }

// Work audits the months. A month that cannot be audited fails the job
// (River retries it); the metric keeps its last value meanwhile.
func (w *AuditWorker) Work(ctx context.Context, _ *river.Job[AuditArgs]) error {
	var months [2]string
	if err := w.DB.QueryRow(ctx, sqlAuditMonths).Scan(&months[0], &months[1]); err != nil {
		return fmt.Errorf("quarantine: the months to audit: %w", err)
	}
	total := 0
	for _, m := range months {
		a, err := RunAudit(ctx, w.DB, m, AuditNightly, "nightly", w.statementTimeout(), w.Logger)
		if err != nil {
			return err
		}
		total += a.DriftKeys
	}
	w.Metrics.audited(total)
	folded, err := FoldCounters(ctx, w.DB)
	if err != nil {
		return err
	}
	w.Logger.InfoContext(ctx, "completeness counters folded", "rows", folded)
	return nil
}

// sqlFold moves the counters of the periods that started before the
// current month into one slot, sums unchanged (completeness_fold): a past
// month, rarely written, is then read as one row per line and account. It
// folds the buckets it is given ($1): one shard group's, whose rows it
// locks and rewrites on that group's node.
const sqlFold = `SELECT completeness_fold(date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', $1::smallint[])`

// FoldCounters folds the counters of past months (sqlFold) and returns how
// many rows it folded: once with every bucket on one server, once per
// shard group on a distributed database (a fold over several shards cannot
// lock their rows). Each group's fold is a statement of its own; the sums
// are unchanged after each.
func FoldCounters(ctx context.Context, db pgdb.Querier) (int64, error) {
	shards, err := tenantbucket.ReadShards(ctx, db)
	if err != nil {
		return 0, fmt.Errorf("quarantine: folding the counters of past months: %w", err)
	}
	var total int64
	for g := range shards.Groups() {
		buckets := shards.Buckets(g)
		if buckets == nil {
			buckets = tenantbucket.All()
		}
		var n int64
		if err := db.QueryRow(ctx, sqlFold, buckets).Scan(&n); err != nil {
			return total, fmt.Errorf("quarantine: folding the counters of past months: %w", err)
		}
		total += n
	}
	return total, nil
}

func (w *AuditWorker) statementTimeout() time.Duration {
	if w.StatementTimeout > 0 {
		return w.StatementTimeout
	}
	return DefaultAuditTimeout
}

// RunAudit audits the month period, records the audit, and logs every key
// that differs as an error (one line a key) and a summary.
func RunAudit(ctx context.Context, db pgdb.DB, period, kind, by string, timeout time.Duration, logger *slog.Logger) (Audit, error) {
	a, err := AuditCompleteness(ctx, db, period, kind, timeout)
	if err != nil {
		return Audit{}, err
	}
	if err := RecordAudit(ctx, db, &a, by); err != nil {
		return Audit{}, err
	}
	for _, d := range a.Drift {
		logger.ErrorContext(ctx, "completeness drift: the counters differ from the ledger", "audit", a.ID,
			"tenant", d.Tenant, "feature", d.Feature, "period", d.Period, "bucket", d.Bucket,
			"counters_events", d.Counters.Events, "counters_value", d.Counters.Value.String(),
			"ledger_events", d.Ledger.Events, "ledger_value", d.Ledger.Value.String())
	}
	logger.InfoContext(ctx, "completeness audit", "audit", a.ID, "period", period, "kind", kind, "lines", a.Lines,
		"drift_keys", a.DriftKeys, "took", a.FinishedAt.Sub(a.StartedAt).String())
	return a, nil
}

// PeriodicAudit is the nightly audit's periodic job, unique in the cluster
// (River's leader inserts it; a second insert within the hour is dropped).
func PeriodicAudit() *river.PeriodicJob {
	s, err := cron.ParseStandard(AuditSchedule)
	if err != nil {
		panic(err) // a constant
	}
	return river.NewPeriodicJob(utcSchedule{s}, func() (river.JobArgs, *river.InsertOpts) {
		return AuditArgs{}, &river.InsertOpts{MaxAttempts: 3, Queue: AuditQueue, UniqueOpts: river.UniqueOpts{
			ByPeriod: time.Hour,
			ByState: []rivertype.JobState{rivertype.JobStateAvailable, rivertype.JobStatePending,
				rivertype.JobStateRunning, rivertype.JobStateScheduled, rivertype.JobStateRetryable},
		}}
	}, &river.PeriodicJobOpts{ID: "tally_completeness_audit"})
}

// utcSchedule evaluates a cron schedule in UTC, whatever the node's zone.
type utcSchedule struct{ s cron.Schedule }

func (u utcSchedule) Next(t time.Time) time.Time { return u.s.Next(t.UTC()) }

// AuditMetrics are the audit's metrics, without a tenant label: the keys
// are in completeness_audits and the log.
type AuditMetrics struct {
	drift prometheus.Gauge
	last  prometheus.Gauge
}

// NewAuditMetrics registers the audit's metrics on reg.
func NewAuditMetrics(reg prometheus.Registerer) (*AuditMetrics, error) {
	m := &AuditMetrics{
		drift: prometheus.NewGauge(prometheus.GaugeOpts{Name: "tally_completeness_drift_keys",
			Help: "Keys (tenant, feature, period, bucket) where the latest nightly audit on this node found the completeness counters different from the full computation from the ledger (the current and the previous month); 0 before the first."}),
		last: prometheus.NewGauge(prometheus.GaugeOpts{Name: "tally_completeness_audit_timestamp_seconds",
			Help: "When the latest nightly completeness audit on this node finished (Unix seconds); 0 before the first."}),
	}
	for _, c := range []prometheus.Collector{m.drift, m.last} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *AuditMetrics) audited(driftKeys int) {
	if m != nil {
		m.drift.Set(float64(driftKeys))
		m.last.SetToCurrentTime()
	}
}
