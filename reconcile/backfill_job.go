package reconcile

import (
	"context"
	"log/slog"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/tallymeter/tally/internal/pgdb"
)

// BackfillArgs is the River job that lists Stripe's events of every
// account Tally exports to (Backfill).
type BackfillArgs struct{}

// BackfillQueue is the River queue of the listing: one at a time, apart
// from staging and reconcile runs.
const BackfillQueue = "stripe_events"

// Kind names the job.
func (BackfillArgs) Kind() string { return "tally_stripe_events_backfill" }

// InsertOpts: one listing at a time in the cluster — a job is not inserted
// while another is queued or running —, and a listing that failed (its
// database) is tried again.
func (BackfillArgs) InsertOpts() river.InsertOpts {
	return river.InsertOpts{MaxAttempts: 3, Queue: BackfillQueue, UniqueOpts: river.UniqueOpts{
		ByState: []rivertype.JobState{rivertype.JobStateAvailable, rivertype.JobStatePending,
			rivertype.JobStateRunning, rivertype.JobStateScheduled, rivertype.JobStateRetryable},
	}}
}

// BackfillWorker works the listing for River.
type BackfillWorker struct {
	river.WorkerDefaults[BackfillArgs]
	// Backfill is nil without a key: the job then does nothing.
	Backfill *Backfill
	DB       pgdb.DB
	Logger   *slog.Logger
}

// Work lists every account once. Accounts whose listing failed are
// recorded and logged, and the next listing tries them again; only the
// database's failures fail the job.
func (w *BackfillWorker) Work(ctx context.Context, _ *river.Job[BackfillArgs]) error {
	if w.Backfill == nil {
		return nil
	}
	res, err := w.Backfill.Run(ctx, w.DB)
	if err != nil {
		return err
	}
	w.Logger.InfoContext(ctx, "Stripe's events listed", "accounts", res.Accounts, "failed", len(res.Failed),
		"listed", res.Listed, "recorded", res.Recorded, "unreadable", res.Unreadable)
	return nil
}

// Timeout bounds a listing below the interval between listings.
func (w *BackfillWorker) Timeout(*river.Job[BackfillArgs]) time.Duration { return backfillTimeout }

// PeriodicBackfill is the listing every interval and once when River's
// leader starts (River's leader alone inserts periodic jobs).
func PeriodicBackfill(interval time.Duration) *river.PeriodicJob {
	return river.NewPeriodicJob(river.PeriodicInterval(interval), func() (river.JobArgs, *river.InsertOpts) {
		return BackfillArgs{}, nil
	}, &river.PeriodicJobOpts{ID: "tally_stripe_events_backfill", RunOnStart: true})
}
