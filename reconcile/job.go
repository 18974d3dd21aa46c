package reconcile

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/robfig/cron/v3"

	"github.com/tallymeter/tally/internal/pgdb"
)

// Args is the River job that works a reconcile run: RunID names a run
// queued by the API; zero is the periodic run, which records its own.
type Args struct {
	RunID int64 `json:"run_id,omitempty"`
}

// QueueName is the River queue of reconcile runs: one at a time, apart from
// staging.
const QueueName = "reconcile"

// Kind names the job.
func (Args) Kind() string { return "tally_reconcile" }

// InsertOpts: a second attempt resumes a run whose worker died (River's
// rescuer retries it).
func (Args) InsertOpts() river.InsertOpts { return river.InsertOpts{MaxAttempts: 3, Queue: QueueName} }

// Worker works reconcile runs for River.
type Worker struct {
	river.WorkerDefaults[Args]
	Reconciler *Reconciler
	DB         pgdb.DB
	// Settle is the periodic run's settle delay.
	Settle time.Duration
	Logger *slog.Logger
}

// Work runs the job. A queued run that cannot start because another is
// running waits a minute and tries again; a periodic run that finds one
// running is skipped (the running one does the work).
func (w *Worker) Work(ctx context.Context, job *river.Job[Args]) error {
	if w.Reconciler == nil {
		w.Logger.WarnContext(ctx, "reconcile: no Stripe key; nothing to reconcile against")
		return nil
	}
	var (
		run Run
		err error
	)
	if job.Args.RunID == 0 {
		run, err = w.Reconciler.RunNow(ctx, w.DB, TriggerSchedule, "schedule", Options{Settle: w.Settle})
		if errors.Is(err, ErrRunning) {
			w.Logger.InfoContext(ctx, "reconcile: the scheduled run was skipped: another run is in progress")
			return nil
		}
	} else {
		run, err = w.Reconciler.Work(ctx, w.DB, job.Args.RunID)
		if errors.Is(err, ErrRunning) {
			return river.JobSnooze(time.Minute)
		}
	}
	if err != nil && run.Status == "failed" {
		// The run ended, failed, and says why; the next run starts afresh.
		// Only a run whose worker died is worth this job's next attempt
		// (it resumes).
		return river.JobCancel(err)
	}
	return err
}

// Timeout: a run takes as long as its keys need (the worker's heartbeat,
// not River's timeout, tells a live run from a dead one).
func (w *Worker) Timeout(*river.Job[Args]) time.Duration { return -1 }

// Periodic is the scheduled run on a cron schedule (UTC), inserted by
// River's leader alone. It returns nil for "off".
func Periodic(schedule string) (*river.PeriodicJob, error) {
	if schedule == "off" {
		return nil, nil
	}
	s, err := parseUTC(schedule)
	if err != nil {
		return nil, err
	}
	return river.NewPeriodicJob(s, func() (river.JobArgs, *river.InsertOpts) {
		return Args{}, &river.InsertOpts{MaxAttempts: 3, Queue: QueueName, UniqueOpts: river.UniqueOpts{
			ByPeriod: time.Minute,
			ByState: []rivertype.JobState{rivertype.JobStateAvailable, rivertype.JobStatePending,
				rivertype.JobStateRunning, rivertype.JobStateScheduled, rivertype.JobStateRetryable},
		}}
	}, &river.PeriodicJobOpts{ID: "tally_reconcile"}), nil
}

// parseUTC parses a cron schedule evaluated in UTC.
func parseUTC(schedule string) (utc, error) {
	s, err := cron.ParseStandard(schedule)
	return utc{s}, err
}

// utc evaluates a cron schedule in UTC, whatever the node's zone.
type utc struct{ s cron.Schedule }

func (u utc) Next(t time.Time) time.Time { return u.s.Next(t.UTC()) }
