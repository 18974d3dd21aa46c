package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// The transitions out of leased share one predicate (docs/outbox.md, "The
// states"):
//
//	WHERE id = ? AND lease_token = ? AND state = 'leased'
//
// Each is one UPDATE over a batch (unnest of parallel arrays), and the same
// statement appends the attempt's outcome to outbox_attempts. Items not
// returned were fenced out. The "locked" CTE takes the batch's row locks in
// ascending id order, the order every waiting writer of this package uses,
// so that two batches over overlapping items (a stale writer's and the
// sweep's, say) can wait for each other but never deadlock. Claims never
// wait: they skip locked rows. The UPDATE depends on "locked" through an
// uncorrelated count, which the planner runs once as a one-time filter
// before the UPDATE reads its first row: every lock is held, in id order,
// before any row is written, and the join costs one pass over the batch (a
// semi-join against the CTE would compare each row with every locked id).
//
// The accept, the statement of every accepted send, is a cached statement
// run with its generic plan (genericTrip), planned once per connection for
// any batch: its rows are found only by primary key, one probe per outcome
// (a nested loop over unnest()), whatever the statistics say. It names no
// id array beside the join (o.id = ANY(@ids) lets the plan read the items
// first and compare each with every outcome), and it compares the state
// under collation "C", which no partial index's predicate uses, so no plan
// can read the leased items from a partial index instead: those indexes
// keep the entries of every lease since the last vacuum, and a plan that
// scanned one would grow with them. Equality of text is the same under
// every deterministic collation: the predicate is the same.
//
// The accept takes the provider's error report into account: when a report
// named the item while it was in flight (NoteFailures), the accept lands
// where the report says — quarantined with its reason, or rejected — with
// the report's error, as fail_accepted would have moved it a moment later,
// and the note is cleared. As in fail_accepted, refused_attempts :=
// attempts only when the accepted attempt was the only one that may have
// reached the provider.
const (
	sqlAccept = `
WITH b AS (SELECT * FROM unnest(@ids::bigint[], @tokens::bigint[], @refs::text[], @meters::text[]) AS b(id, token, ref, meter)),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_item_states o WHERE o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
),
t AS (
    UPDATE outbox_item_states o SET
        state = coalesce(o.reported_state, 'accepted'), quarantine_reason = o.reported_reason,
        refused_attempts = CASE WHEN o.reported_state IS NOT NULL AND o.attempts - o.refused_attempts <= 1
                                THEN o.attempts ELSE o.refused_attempts END,
        last_error_code   = CASE WHEN o.reported_state IS NULL THEN o.last_error_code ELSE o.reported_code END,
        last_error_status = CASE WHEN o.reported_state IS NULL THEN o.last_error_status END,
        last_error        = CASE WHEN o.reported_state IS NULL THEN o.last_error ELSE o.reported_message END,
        reported_state = NULL, reported_reason = NULL, reported_code = NULL, reported_message = NULL,
        provider_ref = nullif(b.ref, ''), meter = nullif(b.meter, ''), accepted_at = statement_timestamp(),
        lease_expires_at = NULL, updated_at = statement_timestamp()
    FROM b
    WHERE o.id = b.id AND (SELECT count(*) FROM locked) >= 0 AND o.lease_token = b.token AND o.state = 'leased' COLLATE "C"
    RETURNING o.id, o.lease_token, o.lease_owner, o.leased_at, o.state, o.provider_ref, o.quarantine_reason, o.bucket
),
log AS (
    INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused, provider_ref, bucket)
    SELECT id, lease_token, lease_owner, leased_at, 'accepted', state, false, provider_ref, bucket FROM t
)
SELECT id, state, coalesce(quarantine_reason, '') FROM t`

	// A retry becomes mark_uncertain in the same statement when it is past
	// the cap, or would happen past the horizon (from first_attempt_at) while
	// some attempt, this one included, may have reached the provider: the
	// claim's budget (withinBudget) and the sweep draw the same line. Both
	// sides of the horizon comparison are the database clock.
	sqlRetry = `
WITH b AS (
    SELECT * FROM unnest(@ids::bigint[], @tokens::bigint[], @delays::bigint[], @refused::bool[],
                         @kinds::text[], @codes::text[], @statuses::int[], @messages::text[])
        AS b(id, token, delay_us, refused, kind, code, status, message)
),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_item_states o WHERE o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
),
t AS (
    UPDATE outbox_item_states o SET
        state = CASE
            WHEN o.attempts - o.attempts_base >= @max THEN 'uncertain'
            WHEN o.refused_attempts + b.refused::int < o.attempts
                 AND statement_timestamp() + b.delay_us * interval '1 microsecond' > o.first_attempt_at + @horizon::interval
                THEN 'uncertain'
            ELSE 'pending' END,
        next_attempt_at   = statement_timestamp() + b.delay_us * interval '1 microsecond',
        refused_attempts  = o.refused_attempts + b.refused::int,
        last_error_code   = b.code, last_error_status = nullif(b.status, 0), last_error = nullif(b.message, ''),
        lease_expires_at  = NULL, updated_at = statement_timestamp()
    FROM b
    WHERE o.id = ANY(@ids::bigint[]) AND o.id = b.id AND (SELECT count(*) FROM locked) >= 0 AND o.lease_token = b.token AND o.state = 'leased'
    RETURNING o.id, o.lease_token, o.lease_owner, o.leased_at, o.state, b.refused, b.kind, b.code, b.status, b.message, o.bucket
),
log AS (
    INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused,
                                 error_code, error_status, error_message, bucket)
    SELECT id, lease_token, lease_owner, leased_at, kind, state, refused, code, nullif(status, 0), nullif(message, ''), bucket
    FROM t
)
SELECT id, state, ''::text FROM t`

	// sqlSettleFailure is mark_uncertain, reject and quarantine, the
	// failures that end automatic delivery: the same predicate, a target
	// state per row.
	sqlSettleFailure = `
WITH b AS (
    SELECT * FROM unnest(@ids::bigint[], @tokens::bigint[], @states::text[], @reasons::text[], @refused::bool[],
                         @codes::text[], @statuses::int[], @messages::text[])
        AS b(id, token, target, reason, refused, code, status, message)
),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_item_states o WHERE o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
),
t AS (
    UPDATE outbox_item_states o SET
        state = b.target, quarantine_reason = nullif(b.reason, ''),
        refused_attempts = o.refused_attempts + b.refused::int,
        last_error_code = b.code, last_error_status = nullif(b.status, 0), last_error = nullif(b.message, ''),
        lease_expires_at = NULL, updated_at = statement_timestamp()
    FROM b
    WHERE o.id = ANY(@ids::bigint[]) AND o.id = b.id AND (SELECT count(*) FROM locked) >= 0 AND o.lease_token = b.token AND o.state = 'leased'
    RETURNING o.id, o.lease_token, o.lease_owner, o.leased_at, o.state, o.quarantine_reason, b.refused, b.code, b.status, b.message, o.bucket
),
log AS (
    INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused,
                                 error_code, error_status, error_message, bucket)
    SELECT id, lease_token, lease_owner, leased_at, state, state, refused, code, nullif(status, 0), nullif(message, ''), bucket
    FROM t
)
SELECT id, state, coalesce(quarantine_reason, '') FROM t`
)

// oneShot runs a batch statement (the retry's and the failures'; the accept
// has genericTrip) as an unnamed statement, planned for the arrays it is
// given: a cached prepared statement would switch to a generic plan after
// five runs, and the generic plan of these joins over unnest() scans a
// partial index's every entry — dead ones too — growing with every batch.
const oneShot = pgx.QueryExecModeExec

// sqlLockBatch takes the row locks of a mixed batch of outcomes up front, in
// ascending id order, so that the per-transition statements that follow in
// the same transaction never wait on one another's rows in another order.
const sqlLockBatch = `SELECT id FROM outbox_item_states WHERE id = ANY(@ids::bigint[]) ORDER BY id FOR UPDATE`

// Record writes the outcomes of attempts (accept, retry, mark_uncertain,
// reject, quarantine), batched, one statement per transition present. Each
// outcome lands or is fenced out on its own; a fenced outcome's Result
// carries ErrStaleLease, is counted by the stale-writer metric and must not
// be retried. A batch of one kind is one statement; a mixed batch runs in one
// READ COMMITTED transaction of its own that first locks every row of the
// batch in id order, so concurrent writers never deadlock. The error return
// is for failures of the database or of the input (an outcome kind unknown,
// one item twice, a quarantine without a reason); then nothing of the batch
// was written.
func (s *Store) Record(ctx context.Context, db pgdb.DB, outcomes []Outcome) ([]Result, error) {
	ctx, span := batchSpan(ctx, "settle", TransitionAccept, TransitionRetry, TransitionMarkUncertain,
		TransitionReject, TransitionQuarantine)
	res, err := s.recordBatch(ctx, db, outcomes)
	endBatch(span, len(outcomes), err)
	return res, err
}

// recordBatch checks and sorts a batch of outcomes, runs the statement of
// each transition present, and counts where every outcome landed.
func (s *Store) recordBatch(ctx context.Context, db pgdb.DB, outcomes []Outcome) ([]Result, error) {
	if err := refuseOpenTx(db); err != nil {
		return nil, fmt.Errorf("outbox: record: %w", err)
	}
	steps, err := s.settleSteps(outcomes)
	if err != nil || len(steps) == 0 {
		return nil, err
	}
	results, err := settle(ctx, db, outcomes, steps)
	if err != nil {
		return nil, err
	}
	s.countSettled(outcomes, results)
	return results, nil
}

// settleStep is one statement of a batch of outcomes: the transition that
// settles the outcomes of some kinds, with their arguments.
type settleStep struct {
	name string
	sql  string
	args pgx.NamedArgs
	// cached runs the statement as a cached prepared statement with its
	// generic plan (genericTrip), not oneShot.
	cached bool
}

// settleSteps checks a batch of outcomes and returns the statements that
// settle it, one per statement: accepts, retries (or mark_uncertain past
// the cap or the horizon) and the failures that end automatic delivery
// (mark_uncertain, reject, quarantine).
func (s *Store) settleSteps(outcomes []Outcome) ([]settleStep, error) {
	seen := make(map[int64]bool, len(outcomes))
	var (
		accept, retry, failure []int // indexes into outcomes
	)
	for i, o := range outcomes {
		if seen[o.Lease.ID] {
			return nil, fmt.Errorf("outbox: item %d appears twice in one batch of outcomes", o.Lease.ID)
		}
		seen[o.Lease.ID] = true
		switch o.Kind {
		case Accepted:
			accept = append(accept, i)
		case Retry, RateLimited:
			retry = append(retry, i)
		case Uncertain, Rejected:
			failure = append(failure, i)
		case Quarantined:
			if !o.Reason.valid() {
				return nil, fmt.Errorf("outbox: item %d: quarantine needs a known reason, got %q", o.Lease.ID, o.Reason)
			}
			failure = append(failure, i)
		default:
			return nil, fmt.Errorf("outbox: item %d: unknown outcome kind %v", o.Lease.ID, o.Kind)
		}
	}

	var steps []settleStep
	if len(accept) > 0 {
		steps = append(steps, settleStep{"accept", sqlAccept, s.acceptArgs(outcomes, accept), true})
	}
	if len(retry) > 0 {
		steps = append(steps, settleStep{"retry", sqlRetry, s.retryArgs(outcomes, retry), false})
	}
	if len(failure) > 0 {
		steps = append(steps, settleStep{"mark_uncertain/reject/quarantine", sqlSettleFailure, s.failureArgs(outcomes, failure), false})
	}
	return steps, nil
}

// settle runs the steps of a batch and returns each outcome's Result. One
// step is one statement on db; several run in one READ COMMITTED
// transaction of their own that first locks every row of the batch in id
// order, committed before settle returns.
func settle(ctx context.Context, db pgdb.DB, outcomes []Outcome, steps []settleStep) ([]Result, error) {
	if len(steps) == 1 {
		return runSettleSteps(ctx, db, true, outcomes, steps)
	}
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return nil, fmt.Errorf("outbox: record: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	ids := make([]int64, len(outcomes))
	for i, o := range outcomes {
		ids[i] = o.Lease.ID
	}
	if _, err := tx.Exec(ctx, sqlLockBatch, pgx.NamedArgs{"ids": ids}); err != nil {
		return nil, fmt.Errorf("outbox: record: locking the batch: %w", err)
	}
	results, err := runSettleSteps(ctx, tx, false, outcomes, steps)
	if err != nil {
		return nil, err
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("outbox: record: committing: %w", err)
	}
	return results, nil
}

// runSettleSteps runs each step on q and collects where each outcome
// landed: an outcome whose item no statement returned was fenced out
// (ErrStaleLease). ownTx says q is not inside a transaction: a cached step
// then runs as one of its own (genericTrip).
func runSettleSteps(ctx context.Context, q batchQuerier, ownTx bool, outcomes []Outcome, steps []settleStep) ([]Result, error) {
	results := make([]Result, len(outcomes))
	index := make(map[int64]int, len(outcomes))
	for i, o := range outcomes {
		results[i] = Result{ID: o.Lease.ID, Err: ErrStaleLease}
		index[o.Lease.ID] = i
	}
	for _, st := range steps {
		var (
			id     int64
			state  State
			reason Reason
		)
		each := func(rows pgx.Rows) error {
			_, err := pgx.ForEachRow(rows, []any{&id, &state, &reason}, func() error {
				results[index[id]] = Result{ID: id, State: state, Reason: reason}
				return nil
			})
			return err
		}
		var err error
		if st.cached {
			err = genericTrip(ctx, q, ownTx, st, each)
		} else {
			var rows pgx.Rows
			if rows, err = q.Query(ctx, st.sql, oneShot, st.args); err == nil {
				err = each(rows)
			}
		}
		if err != nil {
			return nil, fmt.Errorf("outbox: %s: %w", st.name, err)
		}
	}
	return results, nil
}

// batchQuerier is a Querier that sends batches: a pool, a connection or a
// transaction.
type batchQuerier interface {
	pgdb.Querier
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Around a cached step: its plan is the cache's generic plan from the first
// run (plan_cache_mode force_generic_plan), never one of the five custom
// plans the cache tries first. A custom plan of the accept knows the batch's
// size and, with the state compared under collation "C", no estimate of how
// many items are leased: for a large batch it can read the whole table and
// compare every leased item with every outcome.
// Inside a caller's transaction the setting is saved and restored around
// the step (set_config, local to the transaction, in one pipeline).
const (
	sqlGenericOnly    = `SELECT set_config('tally.saved_plan_cache_mode', current_setting('plan_cache_mode'), true), set_config('plan_cache_mode', 'force_generic_plan', true)`
	sqlGenericRestore = `SELECT set_config('plan_cache_mode', current_setting('tally.saved_plan_cache_mode'), true)`
)

// genericTrip runs a cached step with its generic plan in one round trip:
// in a READ COMMITTED transaction of its own (BEGIN, SET LOCAL, the
// statement, COMMIT) when ownTx, else between sqlGenericOnly and
// sqlGenericRestore in the caller's transaction. each reads the
// statement's rows. A failed statement makes the server skip the rest of
// the pipeline, COMMIT included; the transaction is then rolled back as
// claimTrip's is (rollbackLeftOpen), and a caller's transaction is the
// caller's to end.
func genericTrip(ctx context.Context, q batchQuerier, ownTx bool, st settleStep, each func(pgx.Rows) error) (err error) {
	b := &pgx.Batch{}
	if ownTx {
		b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
		b.Queue("SET LOCAL plan_cache_mode = force_generic_plan")
	} else {
		b.Queue(sqlGenericOnly)
	}
	b.Queue(st.sql, st.args)
	if ownTx {
		b.Queue("COMMIT")
	} else {
		b.Queue(sqlGenericRestore)
	}
	br := q.SendBatch(ctx, b)
	err = readGenericTrip(br, ownTx, each)
	if cerr := br.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil && ownTx {
		if db, ok := q.(pgdb.DB); ok {
			rollbackLeftOpen(db)
		}
	}
	return err
}

// readGenericTrip reads the answers of genericTrip's pipeline in order.
func readGenericTrip(br pgx.BatchResults, ownTx bool, each func(pgx.Rows) error) error {
	if ownTx {
		if _, err := br.Exec(); err != nil {
			return fmt.Errorf("beginning: %w", err)
		}
	}
	if _, err := br.Exec(); err != nil {
		return fmt.Errorf("choosing the generic plan: %w", err)
	}
	rows, err := br.Query()
	if err != nil {
		return err
	}
	if err := each(rows); err != nil {
		return err
	}
	if _, err := br.Exec(); err != nil {
		if ownTx {
			return fmt.Errorf("committing: %w", err)
		}
		return fmt.Errorf("restoring plan_cache_mode: %w", err)
	}
	return nil
}

// countSettled counts every outcome of a batch: a fenced-out one as a stale
// write of its transition, a landed one as a move into its state.
func (s *Store) countSettled(outcomes []Outcome, results []Result) {
	for i, r := range results {
		transition := outcomeTransitions[outcomes[i].Kind]
		switch {
		case r.Err != nil:
			s.metrics.staleWrites(transition, 1)
		case r.State == StateUncertain:
			s.metrics.moved(TransitionMarkUncertain, r.State)
		case outcomes[i].Kind == Accepted && r.State != StateAccepted:
			// An error report came while the item was in flight: the
			// accept lands where the report says, fail_accepted's way.
			s.metrics.moved(TransitionFailAccepted, r.State)
			if r.State == StateQuarantined {
				s.metrics.quarantinedFor(r.Reason)
			}
		default:
			s.metrics.moved(transition, r.State)
			if r.State == StateQuarantined {
				s.metrics.quarantinedFor(r.Reason)
			}
		}
	}
}

// acceptArgs are the arguments of sqlAccept for the outcomes at idx.
func (s *Store) acceptArgs(outcomes []Outcome, idx []int) pgx.NamedArgs {
	ids, tokens, refs, meters := make([]int64, len(idx)), make([]int64, len(idx)), make([]string, len(idx)), make([]string, len(idx))
	for j, i := range idx {
		o := outcomes[i]
		ids[j], tokens[j], refs[j], meters[j] = o.Lease.ID, o.Lease.LeaseToken, o.ProviderRef, o.Meter
	}
	return pgx.NamedArgs{"ids": ids, "tokens": tokens, "refs": refs, "meters": meters}
}

// retryDelay is the delay of a Retry or RateLimited outcome, jittered.
func (s *Store) retryDelay(o Outcome) time.Duration {
	// The attempt number inside the current budget: after an operator's
	// recovery or requeue the backoff starts again from the base.
	d := Backoff(o.Lease.Attempts-o.Lease.AttemptsBase, s.cfg.BackoffBase, s.cfg.BackoffCap)
	if o.Kind == RateLimited {
		d = s.cfg.RateLimitDelay
	}
	return max(Jitter(d), o.MinDelay)
}

// retryArgs are the arguments of sqlRetry for the outcomes at idx.
func (s *Store) retryArgs(outcomes []Outcome, idx []int) pgx.NamedArgs {
	n := len(idx)
	ids, tokens, delays := make([]int64, n), make([]int64, n), make([]int64, n)
	refused, kinds := make([]bool, n), make([]string, n)
	codes, statuses, messages := make([]string, n), make([]int32, n), make([]string, n)
	for j, i := range idx {
		o := outcomes[i]
		e := o.Error.Sanitized()
		ids[j], tokens[j] = o.Lease.ID, o.Lease.LeaseToken
		delays[j] = s.retryDelay(o).Microseconds()
		refused[j] = o.Refused || o.Kind == RateLimited
		kinds[j] = o.Kind.String()
		codes[j], statuses[j], messages[j] = e.Code, int32(e.Status), e.Message
	}
	return pgx.NamedArgs{
		"ids": ids, "tokens": tokens, "delays": delays, "refused": refused, "kinds": kinds,
		"codes": codes, "statuses": statuses, "messages": messages,
		"max": s.cfg.MaxAttempts, "horizon": s.cfg.Horizon,
	}
}

// failureArgs are the arguments of sqlSettleFailure for the outcomes at idx.
func (s *Store) failureArgs(outcomes []Outcome, idx []int) pgx.NamedArgs {
	n := len(idx)
	ids, tokens, states, reasons := make([]int64, n), make([]int64, n), make([]string, n), make([]string, n)
	refused := make([]bool, n)
	codes, statuses, messages := make([]string, n), make([]int32, n), make([]string, n)
	for j, i := range idx {
		o := outcomes[i]
		e := o.Error.Sanitized()
		ids[j], tokens[j] = o.Lease.ID, o.Lease.LeaseToken
		switch o.Kind {
		case Uncertain:
			states[j], refused[j] = string(StateUncertain), o.Refused
		case Rejected:
			states[j], refused[j] = string(StateRejected), true
		case Quarantined:
			states[j], refused[j], reasons[j] = string(StateQuarantined), true, string(o.Reason)
		}
		codes[j], statuses[j], messages[j] = e.Code, int32(e.Status), e.Message
	}
	return pgx.NamedArgs{
		"ids": ids, "tokens": tokens, "states": states, "reasons": reasons, "refused": refused,
		"codes": codes, "statuses": statuses, "messages": messages,
	}
}

// record runs one outcome and returns its landing state or ErrStaleLease.
func (s *Store) record(ctx context.Context, db pgdb.DB, o Outcome) (State, error) {
	res, err := s.Record(ctx, db, []Outcome{o})
	if err != nil {
		return "", err
	}
	return res[0].State, res[0].Err
}

// Accept is the accept transition for one lease: leased to accepted.
func (s *Store) Accept(ctx context.Context, db pgdb.DB, l Lease, providerRef string) error {
	_, err := s.record(ctx, db, Outcome{Lease: l, Kind: Accepted, ProviderRef: providerRef})
	return err
}

// Retry is the retry transition for one lease (mark_uncertain past the cap or
// the horizon); it returns the state the item landed in. Refused says the
// provider refused this attempt outright (see Outcome.Refused).
func (s *Store) Retry(ctx context.Context, db pgdb.DB, l Lease, e ErrorInfo, refused bool) (State, error) {
	return s.record(ctx, db, Outcome{Lease: l, Kind: Retry, Error: e, Refused: refused})
}

// RetryRateLimited is the retry transition after a rate-limit answer
// (mark_uncertain past the cap or the horizon).
func (s *Store) RetryRateLimited(ctx context.Context, db pgdb.DB, l Lease, e ErrorInfo) (State, error) {
	return s.record(ctx, db, Outcome{Lease: l, Kind: RateLimited, Error: e})
}

// MarkUncertain is the mark_uncertain transition for one lease: leased to
// uncertain.
func (s *Store) MarkUncertain(ctx context.Context, db pgdb.DB, l Lease, e ErrorInfo, refused bool) error {
	_, err := s.record(ctx, db, Outcome{Lease: l, Kind: Uncertain, Error: e, Refused: refused})
	return err
}

// Reject is the reject transition for one lease: leased to rejected, which
// is terminal.
func (s *Store) Reject(ctx context.Context, db pgdb.DB, l Lease, e ErrorInfo) error {
	_, err := s.record(ctx, db, Outcome{Lease: l, Kind: Rejected, Error: e})
	return err
}

// Quarantine is the quarantine transition for one lease: leased to
// quarantined.
func (s *Store) Quarantine(ctx context.Context, db pgdb.DB, l Lease, reason Reason, e ErrorInfo) error {
	_, err := s.record(ctx, db, Outcome{Lease: l, Kind: Quarantined, Reason: reason, Error: e})
	return err
}
