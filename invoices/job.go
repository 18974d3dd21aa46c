package invoices

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/mappings"
)

// Queue is the River queue of the invoices' jobs: one at a time, apart
// from staging.
const Queue = "tally_invoices"

// Recompared says what one Recompare did.
type Recompared struct {
	Invoices int
	Differs  int
}

// sqlStale picks finalized invoices of the last @within whose comparison
// is older than @ttl (or never made), oldest first: an index range of the
// invoices finalized since, which grows with customers, never with usage.
const sqlStale = `
SELECT account, invoice FROM stripe_invoices
WHERE finalized_at > clock_timestamp() - @within::interval AND status NOT IN ('draft', 'void')
  AND (compared_at IS NULL OR compared_at < clock_timestamp() - @ttl::interval)
ORDER BY finalized_at LIMIT @batch`

// Recompare compares again, from Tally's own tables (no call to Stripe),
// up to batch finalized invoices of the last within whose comparison is
// older than ttl: usage of their periods can still arrive after them (it
// is quarantined period_closed), and it belongs on the check as used but
// on no invoice.
func Recompare(ctx context.Context, db pgdb.Beginner, maps *mappings.Store, within, ttl time.Duration, batch int) (Recompared, error) {
	keys, err := invoiceKeys(ctx, db, sqlStale, pgx.NamedArgs{"within": within, "ttl": ttl, "batch": batch})
	if err != nil {
		return Recompared{}, fmt.Errorf("invoices: picking invoices to compare again: %w", err)
	}
	var res Recompared
	for _, k := range keys {
		checks, err := Compare(ctx, db, maps, k.account, k.invoice)
		if err != nil {
			return res, err
		}
		res.Invoices++
		for _, c := range checks {
			if c.Status == Differs && c.Resolution == nil {
				res.Differs++
			}
		}
	}
	return res, nil
}

// invoiceKey names an invoice in an account.
type invoiceKey struct{ account, invoice string }

// invoiceKeys runs sql, which selects account and invoice.
func invoiceKeys(ctx context.Context, q pgdb.Querier, sql string, args pgx.NamedArgs) ([]invoiceKey, error) {
	rows, err := q.Query(ctx, sql, args)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (invoiceKey, error) {
		var k invoiceKey
		return k, r.Scan(&k.account, &k.invoice)
	})
}

// RecompareArgs is the River job that runs Recompare.
type RecompareArgs struct{}

// Kind names the job.
func (RecompareArgs) Kind() string { return "tally_invoice_recompare" }

// Defaults of RecompareWorker: invoices finalized in the last 40 days
// (Stripe takes usage 35 days back), compared again once a day, 500 a run.
const (
	DefaultRecompareWithin = 40 * 24 * time.Hour
	DefaultRecompareTTL    = 24 * time.Hour
	DefaultRecompareBatch  = 500
)

// RecompareWorker runs RecompareArgs with the defaults.
type RecompareWorker struct {
	river.WorkerDefaults[RecompareArgs]
	DB     pgdb.Beginner
	Maps   *mappings.Store
	Logger *slog.Logger
}

// Work compares the stale invoices again.
func (w *RecompareWorker) Work(ctx context.Context, _ *river.Job[RecompareArgs]) error {
	res, err := Recompare(ctx, w.DB, w.Maps, DefaultRecompareWithin, DefaultRecompareTTL, DefaultRecompareBatch)
	if err != nil {
		return err
	}
	if res.Differs > 0 {
		w.Logger.WarnContext(ctx, "invoices: finalized invoices differ from the ledger; finance resolves them (GET /v1/invoices/checks)",
			"invoices", res.Invoices, "open_checks", res.Differs)
	}
	return nil
}

// PeriodicRecompare is the recompare job every hour and when River's
// leader starts, unique in the cluster.
func PeriodicRecompare() *river.PeriodicJob { return periodic(time.Hour, RecompareArgs{}) }

// periodic is a job of args every interval and when River's leader
// starts, on the invoices' queue, one at a time in the cluster.
func periodic(every time.Duration, args river.JobArgs) *river.PeriodicJob {
	return river.NewPeriodicJob(river.PeriodicInterval(every), func() (river.JobArgs, *river.InsertOpts) {
		return args, &river.InsertOpts{MaxAttempts: 1, Queue: Queue, UniqueOpts: river.UniqueOpts{
			ByState: []rivertype.JobState{rivertype.JobStateAvailable, rivertype.JobStatePending,
				rivertype.JobStateRunning, rivertype.JobStateScheduled, rivertype.JobStateRetryable},
		}}
	}, &river.PeriodicJobOpts{ID: args.Kind(), RunOnStart: true})
}

// GateArgs is the River job that checks the open invoice gates.
type GateArgs struct{}

// Kind names the job.
func (GateArgs) Kind() string { return "tally_invoice_gates" }

// DefaultGateBatch is how many open gates one run checks.
const DefaultGateBatch = 200

// GateWorker runs GateArgs: Gate.CheckOpen.
type GateWorker struct {
	river.WorkerDefaults[GateArgs]
	Gate *Gate
}

// gateBudget is how long one run keeps checking batches: under the job's
// minute, so that a billing day's many drafts are all checked each run.
const gateBudget = 50 * time.Second

// Work checks the open gates, least recently checked first, batch after
// batch for up to gateBudget.
func (w *GateWorker) Work(ctx context.Context, _ *river.Job[GateArgs]) error {
	open, err := w.Gate.OpenGates(ctx)
	if err != nil {
		return err
	}
	for end := time.Now().Add(gateBudget); open > 0 && time.Now().Before(end); open -= DefaultGateBatch {
		if _, err := w.Gate.CheckOpen(ctx, DefaultGateBatch); err != nil {
			return err
		}
	}
	return nil
}

// PeriodicGates is the gates' job every minute and when River's leader
// starts, unique in the cluster: a hold is released within a minute of
// its period becoming complete, or of its bound.
func PeriodicGates() *river.PeriodicJob { return periodic(time.Minute, GateArgs{}) }
