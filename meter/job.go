package meter

import (
	"context"
	"log/slog"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
)

// StageArgs is the River job that runs one staging pass.
type StageArgs struct{}

// Kind names the job.
func (StageArgs) Kind() string { return "tally_stage" }

// InsertOpts keeps at most one pass queued or running: a periodic insert
// while one waits is skipped.
func (StageArgs) InsertOpts() river.InsertOpts {
	return river.InsertOpts{
		MaxAttempts: 1, // the next period retries; a failed pass leaves nothing half-done
		UniqueOpts: river.UniqueOpts{ByState: []rivertype.JobState{
			rivertype.JobStateAvailable, rivertype.JobStatePending, rivertype.JobStateRunning, rivertype.JobStateScheduled,
		}},
	}
}

// StageWorker runs staging passes for River.
type StageWorker struct {
	river.WorkerDefaults[StageArgs]
	Stager *Stager
	DB     TxBeginner
	Logger *slog.Logger
}

// Work runs one pass and logs what it did.
func (w *StageWorker) Work(ctx context.Context, _ *river.Job[StageArgs]) error {
	res, err := w.Stager.Pass(ctx, w.DB)
	switch {
	case err != nil:
		w.Logger.ErrorContext(ctx, "staging pass failed in part", "error", err, "items", res.Items, "events", res.Events)
	case res.Stalled:
		w.Logger.DebugContext(ctx, "staging stalled: no Stripe destination")
	case res.Items > 0:
		w.Logger.InfoContext(ctx, "staged usage", "items", res.Items, "quarantined", res.Quarantined, "events", res.Events)
	}
	return err
}

// Timeout bounds one pass.
func (w *StageWorker) Timeout(*river.Job[StageArgs]) time.Duration { return 10 * time.Minute }

// PeriodicStage is the periodic job that stages every interval; River's
// leader alone inserts it.
func PeriodicStage(interval time.Duration) *river.PeriodicJob {
	return river.NewPeriodicJob(river.PeriodicInterval(interval),
		func() (river.JobArgs, *river.InsertOpts) { return StageArgs{}, nil },
		&river.PeriodicJobOpts{ID: "tally_stage", RunOnStart: true})
}
