package meter

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/tallymeter/tally/internal/pgdb"
)

// StageArgs is the River job that runs one staging pass of a part of the
// tenants (PassPart); the zero StageArgs stages them all.
type StageArgs struct {
	Part
}

// Kind names the job.
func (StageArgs) Kind() string { return "tally_stage" }

// InsertOpts: one attempt, since the next period retries and a failed pass
// leaves nothing half-done.
func (StageArgs) InsertOpts() river.InsertOpts {
	return river.InsertOpts{MaxAttempts: 1}
}

// minUniquePeriod is the shortest bucket of stageInsertOpts: how long a pass
// that died with its process can hold up staging at most.
const minUniquePeriod = 30 * time.Second

// stageInsertOpts keeps at most one pass queued or running per bucket of
// the period (max(interval, 30s) in PeriodicStages) and part: a periodic
// insert while one of its part waits is skipped. The bucket matters after
// a crash: a pass whose process was killed stays 'running' in river_job
// until River's rescuer sees it (an hour by default), and uniqueness by
// state alone would skip every insert until then. With buckets the next
// bucket's insert goes through. Two passes may then overlap; staging is
// safe under that (per-key advisory locks and SKIP LOCKED), it only does
// the work once.
func stageInsertOpts(period time.Duration) *river.InsertOpts {
	return &river.InsertOpts{
		MaxAttempts: 1,
		UniqueOpts: river.UniqueOpts{
			ByArgs:   true, // one per part
			ByPeriod: period,
			ByState: []rivertype.JobState{
				rivertype.JobStateAvailable, rivertype.JobStatePending, rivertype.JobStateRunning, rivertype.JobStateScheduled,
			},
		},
	}
}

// StageWorker runs staging passes for River.
type StageWorker struct {
	river.WorkerDefaults[StageArgs]
	Stager *Stager
	DB     pgdb.DB
	Logger *slog.Logger
}

// Work runs one pass of the job's part, records what it did as the job's
// output (River's metadata "output": a PassResult) and logs it. A pass
// skipped because export is stalled completes with output stalled: true,
// which SinceLastStage does not count as a heartbeat.
func (w *StageWorker) Work(ctx context.Context, job *river.Job[StageArgs]) error {
	res, err := w.Stager.PassPart(ctx, w.DB, job.Args.Part)
	if oerr := river.RecordOutput(ctx, res); oerr != nil {
		// Without its output a skipped pass would count as a heartbeat:
		// fail the job instead (never expected; PassResult always encodes).
		err = errors.Join(err, fmt.Errorf("meter: recording the staging pass's output: %w", oerr))
	}
	switch {
	case err != nil && errors.Is(ctx.Err(), context.Canceled):
		// The node is stopping: the next pass, on any node, goes on.
		w.Logger.InfoContext(ctx, "staging pass interrupted by the node stopping", "items", res.Items, "events", res.Events)
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

// PeriodicStages are the periodic jobs that stage every interval, one per
// part of parts (StageWorkers): River's leader alone inserts them, and the
// node's workers run them at once. Parts is the leader's setting; after it
// changes, or while an older pass still runs, the ranges of two passes may
// overlap, which staging tolerates (see stageBatch): a window is staged once
// whoever takes it.
func PeriodicStages(interval time.Duration, parts int) []*river.PeriodicJob {
	var jobs []*river.PeriodicJob
	for _, part := range Parts(parts) {
		id := "tally_stage"
		if part.Count > 1 {
			id = fmt.Sprintf("tally_stage_%d_of_%d", part.Index+1, part.Count)
		}
		jobs = append(jobs, river.NewPeriodicJob(river.PeriodicInterval(interval),
			func() (river.JobArgs, *river.InsertOpts) {
				return StageArgs{Part: part}, stageInsertOpts(max(interval, minUniquePeriod))
			},
			&river.PeriodicJobOpts{ID: id, RunOnStart: true}))
	}
	return jobs
}

// StageWorkers is how many staging passes run at once, each over its part
// of the tenants: n when positive (TALLY_STAGE_WORKERS), else the node's
// cores, at most half of conns, the connections of the pool the passes
// share with the deliverers, and at least one.
func StageWorkers(n, conns int) int {
	if n > 0 {
		return n
	}
	return max(min(runtime.GOMAXPROCS(0), conns/2), 1)
}

// MonthsAhead is how many months after the current one MonthsWorker keeps
// the ledger's partitions made: an event is at most a day ahead, so three
// months leave two of slack for a node that was down.
const MonthsAhead = 3

// MonthsArgs is the River job that keeps the ledger's months ahead
// (EnsureMonths).
type MonthsArgs struct{}

// Kind names the job.
func (MonthsArgs) Kind() string { return "tally_ledger_months" }

// MonthsWorker runs EnsureMonths for River.
type MonthsWorker struct {
	river.WorkerDefaults[MonthsArgs]
	DB     pgdb.DB
	Logger *slog.Logger
}

// Work creates the months missing through MonthsAhead and logs those made.
func (w *MonthsWorker) Work(ctx context.Context, _ *river.Job[MonthsArgs]) error {
	made, err := EnsureMonths(ctx, w.DB, MonthsAhead)
	if made > 0 {
		w.Logger.InfoContext(ctx, "made the ledger's months ahead", "months", made)
	}
	return err
}

// PeriodicMonths runs MonthsWorker at start and daily; River's leader alone
// inserts it.
func PeriodicMonths() *river.PeriodicJob {
	return river.NewPeriodicJob(river.PeriodicInterval(24*time.Hour),
		func() (river.JobArgs, *river.InsertOpts) { return MonthsArgs{}, nil },
		&river.PeriodicJobOpts{ID: "tally_ledger_months", RunOnStart: true})
}
