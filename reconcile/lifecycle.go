package reconcile

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/redact"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Queue records a run to be worked later (by the River job); it may run
// inside the caller's transaction.
func Queue(ctx context.Context, q pgdb.Querier, trigger Trigger, by string, opts Options) (int64, error) {
	if opts.Settle < 0 {
		return 0, errors.New("reconcile: the settle delay must not be negative")
	}
	var since *time.Time
	if !opts.Since.IsZero() {
		since = &opts.Since
	}
	var id int64
	err := q.QueryRow(ctx, `INSERT INTO reconcile_runs (status, trigger, requested_by, settle, since)
		VALUES ('queued', @trigger, @by, @settle::interval, @since) RETURNING id`,
		pgx.NamedArgs{"trigger": string(trigger), "by": by, "settle": opts.Settle, "since": since}).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("reconcile: queueing a run: %w", err)
	}
	return id, nil
}

// begin marks run id running: a queued run, an interrupted one, or one
// whose worker stopped saying it is alive (the last two resume from their
// cursor). A run that has not been
// heard of for staleAfter is interrupted first, whichever it is.
func begin(ctx context.Context, db pgdb.DB, id int64) error {
	if _, err := db.Exec(ctx, `UPDATE reconcile_runs SET status = 'interrupted', finished_at = clock_timestamp(),
			error_code = 'no_heartbeat', error = 'the run stopped without finishing (its process died); a rerun or a resume takes over'
		WHERE status = 'running' AND id <> @id AND heartbeat_at < clock_timestamp() - @stale::interval`,
		pgx.NamedArgs{"id": id, "stale": staleAfter}); err != nil {
		return fmt.Errorf("reconcile: interrupting stale runs: %w", err)
	}
	tag, err := db.Exec(ctx, `UPDATE reconcile_runs SET status = 'running', error_code = NULL, error = NULL, finished_at = NULL,
			started_at = coalesce(started_at, clock_timestamp()), heartbeat_at = clock_timestamp()
		WHERE id = @id AND (status IN ('queued', 'interrupted')
			OR (status = 'running' AND heartbeat_at < clock_timestamp() - @stale::interval))`,
		pgx.NamedArgs{"id": id, "stale": staleAfter})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.ConstraintName == "reconcile_runs_one_running" {
		return ErrRunning
	}
	if err != nil {
		return fmt.Errorf("reconcile: starting run %d: %w", id, err)
	}
	if tag.RowsAffected() == 1 {
		return nil
	}
	run, err := Get(ctx, db, id)
	if err != nil {
		return err
	}
	if run.Status == "running" {
		return ErrRunning
	}
	return fmt.Errorf("reconcile: run %d is %s; it cannot start again", id, run.Status)
}

// RunNow records a run and works it at once, in this process.
func (r *Reconciler) RunNow(ctx context.Context, db pgdb.DB, trigger Trigger, by string, opts Options) (Run, error) {
	id, err := Queue(ctx, db, trigger, by, opts)
	if err != nil {
		return Run{}, err
	}
	if err := begin(ctx, db, id); err != nil {
		// Nothing was done under this run: it ends failed, visibly.
		_, _ = db.Exec(context.WithoutCancel(ctx), `UPDATE reconcile_runs SET status = 'failed', finished_at = clock_timestamp(),
			error_code = 'not_started', error = @msg WHERE id = @id AND status = 'queued'`,
			pgx.NamedArgs{"id": id, "msg": redact.Message(err.Error())})
		return Run{ID: id}, err
	}
	return r.work(ctx, db, id)
}

// Work works a queued run (or resumes an interrupted one) to its end.
func (r *Reconciler) Work(ctx context.Context, db pgdb.DB, id int64) (Run, error) {
	if err := begin(ctx, db, id); err != nil {
		return Run{ID: id}, err
	}
	return r.work(ctx, db, id)
}

// work runs a begun run and records how it ended.
func (r *Reconciler) work(ctx context.Context, db pgdb.DB, id int64) (Run, error) {
	stop := heartbeat(ctx, db, id)
	err := r.pass(ctx, db, id)
	stop()
	return r.finish(context.WithoutCancel(ctx), db, id, err)
}

// heartbeat says every heartbeatEvery that run id is alive, until the
// returned stop is called; stop returns once the heartbeat has stopped.
func heartbeat(ctx context.Context, db pgdb.DB, id int64) (stop func()) {
	hctx, cancel := context.WithCancel(ctx)
	beat := make(chan struct{})
	go func() {
		defer close(beat)
		t := time.NewTicker(heartbeatEvery)
		defer t.Stop()
		for {
			select {
			case <-hctx.Done():
				return
			case <-t.C:
				_, _ = db.Exec(hctx, `UPDATE reconcile_runs SET heartbeat_at = clock_timestamp() WHERE id = $1 AND status = 'running'`, id)
			}
		}
	}()
	return func() {
		cancel()
		<-beat
	}
}

// finish records how run id ended — failed, or interrupted when it was
// stopped, with the error err; succeeded when err is nil — and reads the
// run as it ended. end is not cancelled with the run.
func (r *Reconciler) finish(end context.Context, db pgdb.DB, id int64, err error) (Run, error) {
	if err != nil {
		code, status, msg := stripeapi.Describe(err)
		info := outbox.ErrorInfo{Code: code, Status: status, Message: msg}
		if errors.Is(err, context.Canceled) {
			info = outbox.ErrorInfo{Code: "canceled", Message: "the run was stopped (shutdown); a resume continues from its last key"}
		}
		info = info.Sanitized()
		status2 := "failed"
		if errors.Is(err, context.Canceled) {
			status2 = "interrupted"
		}
		_, _ = db.Exec(end, `UPDATE reconcile_runs SET status = @status, finished_at = clock_timestamp(),
			error_code = @code, error = nullif(@msg, '') WHERE id = @id AND status = 'running'`,
			pgx.NamedArgs{"id": id, "status": status2, "code": info.Code, "msg": info.Message})
		r.cfg.Logger.Error("reconcile run failed", "run", id, "error", info.String())
		r.metrics.runs.WithLabelValues(status2).Inc()
	} else {
		if _, uerr := db.Exec(end, `UPDATE reconcile_runs SET status = 'succeeded', finished_at = clock_timestamp()
			WHERE id = $1 AND status = 'running'`, id); uerr != nil {
			err = fmt.Errorf("reconcile: finishing run %d: %w", id, uerr)
		}
	}
	run, gerr := Get(end, db, id)
	if gerr != nil && err == nil {
		err = gerr
	}
	if err == nil {
		r.metrics.runs.WithLabelValues("succeeded").Inc()
		r.cfg.Logger.Info("reconcile run finished", "run", id, "keys", run.KeysDone, "hours_compared", run.HoursCompared,
			"hours_matched", run.HoursMatched, "confirmed", run.ItemsConfirmed, "discrepancies", run.Discrepancies,
			"stripe_calls", run.StripeCalls)
	}
	return run, err
}
