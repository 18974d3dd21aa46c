package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// OutcomeKind is what an attempt came to.
type OutcomeKind int

// Outcome kinds: the transitions out of leased.
const (
	// Accepted is T2: the provider accepted the item (or answered that it
	// already had its identifier).
	Accepted OutcomeKind = iota + 1
	// Retry is T3: try again after the exponential backoff; past the attempt
	// cap or the horizon it is T4 instead.
	Retry
	// RateLimited is T3 after a rate-limit answer: try again after the
	// rate-limit delay; past the cap or the horizon it is T4 instead.
	RateLimited
	// Uncertain is T4: the item may or may not have reached the provider and
	// must not be sent again automatically.
	Uncertain
	// Rejected is T5: the provider refused the item itself. Terminal.
	Rejected
	// Quarantined is T6: a mapping, account or mode problem, found at claim
	// time or named by the provider's answer.
	Quarantined
)

var outcomeNames = map[OutcomeKind]string{
	Accepted: "accepted", Retry: "retry", RateLimited: "rate_limited",
	Uncertain: "uncertain", Rejected: "rejected", Quarantined: "quarantined",
}

var outcomeTransitions = map[OutcomeKind]string{
	Accepted: "T2", Retry: "T3", RateLimited: "T3", Uncertain: "T4", Rejected: "T5", Quarantined: "T6",
}

func (k OutcomeKind) String() string {
	if n, ok := outcomeNames[k]; ok {
		return n
	}
	return fmt.Sprintf("OutcomeKind(%d)", int(k))
}

// Outcome is what the holder of a lease reports about one attempt.
type Outcome struct {
	// Lease is the claim the outcome is for; its ID and LeaseToken fence
	// the write, and its Attempts sets the backoff.
	Lease Lease
	// Kind is the outcome.
	Kind OutcomeKind
	// ProviderRef is the provider's reference for an Accepted item (Stripe's
	// Request-Id).
	ProviderRef string
	// Error describes a failure; it is sanitised before it is written.
	Error ErrorInfo
	// Refused says the provider refused this attempt outright, so it cannot
	// have recorded it (a 429, a 401 or 403). It matters for Retry and
	// Uncertain; RateLimited, Rejected and Quarantined attempts are refusals
	// (or were never sent) by definition, and Accepted ones are not.
	Refused bool
	// Reason is the quarantine reason of a Quarantined outcome.
	Reason Reason
	// MinDelay raises a Retry's or RateLimited's delay to at least this long
	// (e.g. the provider's Retry-After).
	MinDelay time.Duration
}

// Result is where one outcome landed.
type Result struct {
	// ID is the item.
	ID int64
	// State is the state the item landed in; empty when Err is set. An
	// Accepted outcome lands in quarantined or rejected when the provider's
	// error report named the item while it was in flight (NoteFailures).
	State State
	// Reason is the quarantine reason when State is quarantined.
	Reason Reason
	// Err is ErrStaleLease when the write was fenced out.
	Err error
}

// The transitions out of leased share the seed's predicate:
//
//	WHERE id = ? AND lease_token = ? AND state = 'leased'
//
// Each is one UPDATE over a batch (unnest of parallel arrays), and the same
// statement appends the attempt's outcome to outbox_attempts. Items not
// returned were fenced out. The "locked" CTE takes the batch's row locks in
// ascending id order, the order every waiting writer of this package uses,
// so that two batches over overlapping items (a stale writer's and the
// sweep's, say) can wait for each other but never deadlock. Claims never
// wait: they skip locked rows.
//
// T2 takes the provider's error report into account: when a report named
// the item while it was in flight (NoteFailures), the accept lands where the
// report says — quarantined with its reason, or rejected — with the report's
// error, as T10 would have moved it a moment later, and the note is cleared.
// As in T10, refused_attempts := attempts only when the accepted attempt was
// the only one that may have reached the provider.
const (
	sqlT2Accept = `
WITH b AS (SELECT * FROM unnest(@ids::bigint[], @tokens::bigint[], @refs::text[]) AS b(id, token, ref)),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_items o WHERE o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
),
t AS (
    UPDATE outbox_items o SET
        state = coalesce(o.reported_state, 'accepted'), quarantine_reason = o.reported_reason,
        refused_attempts = CASE WHEN o.reported_state IS NOT NULL AND o.attempts - o.refused_attempts <= 1
                                THEN o.attempts ELSE o.refused_attempts END,
        last_error_code   = CASE WHEN o.reported_state IS NULL THEN o.last_error_code ELSE o.reported_code END,
        last_error_status = CASE WHEN o.reported_state IS NULL THEN o.last_error_status END,
        last_error        = CASE WHEN o.reported_state IS NULL THEN o.last_error ELSE o.reported_message END,
        reported_state = NULL, reported_reason = NULL, reported_code = NULL, reported_message = NULL,
        provider_ref = nullif(b.ref, ''), accepted_at = clock_timestamp(),
        lease_expires_at = NULL, updated_at = clock_timestamp()
    FROM b
    WHERE o.id = ANY(@ids::bigint[]) AND o.id = b.id AND o.id IN (SELECT id FROM locked) AND o.lease_token = b.token AND o.state = 'leased'
    RETURNING o.id, o.lease_token, o.lease_owner, o.leased_at, o.state, o.provider_ref, o.quarantine_reason
),
log AS (
    INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused, provider_ref)
    SELECT id, lease_token, lease_owner, leased_at, 'accepted', state, false, provider_ref FROM t
)
SELECT id, state, coalesce(quarantine_reason, '') FROM t`

	// T3 becomes T4 in the same statement when the retry is past the cap, or
	// would happen past the horizon (measured from first_attempt_at). Both
	// sides of the horizon comparison are the database clock.
	sqlT3Retry = `
WITH b AS (
    SELECT * FROM unnest(@ids::bigint[], @tokens::bigint[], @delays::bigint[], @refused::bool[],
                         @kinds::text[], @codes::text[], @statuses::int[], @messages::text[])
        AS b(id, token, delay_us, refused, kind, code, status, message)
),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_items o WHERE o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
),
t AS (
    UPDATE outbox_items o SET
        state = CASE
            WHEN o.attempts - o.attempts_base >= @max THEN 'uncertain'
            WHEN clock_timestamp() + b.delay_us * interval '1 microsecond' > o.first_attempt_at + @horizon::interval
                THEN 'uncertain'
            ELSE 'pending' END,
        next_attempt_at   = clock_timestamp() + b.delay_us * interval '1 microsecond',
        refused_attempts  = o.refused_attempts + b.refused::int,
        last_error_code   = b.code, last_error_status = nullif(b.status, 0), last_error = nullif(b.message, ''),
        lease_expires_at  = NULL, updated_at = clock_timestamp()
    FROM b
    WHERE o.id = ANY(@ids::bigint[]) AND o.id = b.id AND o.id IN (SELECT id FROM locked) AND o.lease_token = b.token AND o.state = 'leased'
    RETURNING o.id, o.lease_token, o.lease_owner, o.leased_at, o.state, b.refused, b.kind, b.code, b.status, b.message
),
log AS (
    INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused,
                                 error_code, error_status, error_message)
    SELECT id, lease_token, lease_owner, leased_at, kind, state, refused, code, nullif(status, 0), nullif(message, '')
    FROM t
)
SELECT id, state, ''::text FROM t`

	// sqlT4T5T6 is T4 (uncertain), T5 (rejected) and T6 (quarantined): the
	// same predicate, a target state per row.
	sqlT4T5T6 = `
WITH b AS (
    SELECT * FROM unnest(@ids::bigint[], @tokens::bigint[], @states::text[], @reasons::text[], @refused::bool[],
                         @codes::text[], @statuses::int[], @messages::text[])
        AS b(id, token, target, reason, refused, code, status, message)
),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_items o WHERE o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
),
t AS (
    UPDATE outbox_items o SET
        state = b.target, quarantine_reason = nullif(b.reason, ''),
        refused_attempts = o.refused_attempts + b.refused::int,
        last_error_code = b.code, last_error_status = nullif(b.status, 0), last_error = nullif(b.message, ''),
        lease_expires_at = NULL, updated_at = clock_timestamp()
    FROM b
    WHERE o.id = ANY(@ids::bigint[]) AND o.id = b.id AND o.id IN (SELECT id FROM locked) AND o.lease_token = b.token AND o.state = 'leased'
    RETURNING o.id, o.lease_token, o.lease_owner, o.leased_at, o.state, o.quarantine_reason, b.refused, b.code, b.status, b.message
),
log AS (
    INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused,
                                 error_code, error_status, error_message)
    SELECT id, lease_token, lease_owner, leased_at, state, state, refused, code, nullif(status, 0), nullif(message, '')
    FROM t
)
SELECT id, state, coalesce(quarantine_reason, '') FROM t`
)

// oneShot runs a batch statement as an unnamed statement, planned for the
// arrays it is given: a cached prepared statement would switch to a generic
// plan after five runs, and the generic plan of these joins over unnest()
// scans a partial index's every entry — dead ones too — growing with every
// batch (measured: 67 ms per 1,000 accepts planned for the batch, 220 ms
// with the generic plan after a few thousand).
const oneShot = pgx.QueryExecModeExec

// sqlLockBatch takes the row locks of a mixed batch of outcomes up front, in
// ascending id order, so that the per-transition statements that follow in
// the same transaction never wait on one another's rows in another order.
const sqlLockBatch = `SELECT id FROM outbox_items WHERE id = ANY(@ids::bigint[]) ORDER BY id FOR UPDATE`

// Record writes the outcomes of attempts: T2-T6, batched, one statement per
// transition present. Each outcome lands or is fenced out on its own; a
// fenced outcome's Result carries ErrStaleLease, is counted by the
// stale-writer metric and must not be retried. A batch of one kind is one
// statement; a mixed batch runs in one READ COMMITTED transaction of its own
// that first locks every row of the batch in id order, so concurrent writers
// never deadlock. The error return is for failures of the database or of the
// input (an outcome kind unknown, one item twice, a quarantine without a
// reason); then nothing of the batch was written.
func (s *Store) Record(ctx context.Context, db TxBeginner, outcomes []Outcome) ([]Result, error) {
	ctx, span := batchSpan(ctx, "settle", "T2-T6")
	res, err := s.recordBatch(ctx, db, outcomes)
	endBatch(span, len(outcomes), err)
	return res, err
}

func (s *Store) recordBatch(ctx context.Context, db TxBeginner, outcomes []Outcome) ([]Result, error) {
	seen := make(map[int64]bool, len(outcomes))
	var (
		accept, retry, other []int // indexes into outcomes
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
			other = append(other, i)
		case Quarantined:
			if !o.Reason.valid() {
				return nil, fmt.Errorf("outbox: item %d: quarantine needs a known reason, got %q", o.Lease.ID, o.Reason)
			}
			other = append(other, i)
		default:
			return nil, fmt.Errorf("outbox: item %d: unknown outcome kind %v", o.Lease.ID, o.Kind)
		}
	}

	type step struct {
		name string
		idx  []int
		sql  string
		args pgx.NamedArgs
	}
	var steps []step
	if len(accept) > 0 {
		steps = append(steps, step{"T2 accept", accept, sqlT2Accept, s.acceptArgs(outcomes, accept)})
	}
	if len(retry) > 0 {
		steps = append(steps, step{"T3 retry", retry, sqlT3Retry, s.retryArgs(outcomes, retry)})
	}
	if len(other) > 0 {
		steps = append(steps, step{"T4/T5/T6", other, sqlT4T5T6, s.settleArgs(outcomes, other)})
	}
	if len(steps) == 0 {
		return nil, nil
	}

	var q Querier = db
	if len(steps) > 1 {
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
		q = tx
	}

	results := make([]Result, len(outcomes))
	index := make(map[int64]int, len(outcomes))
	for i, o := range outcomes {
		results[i] = Result{ID: o.Lease.ID, Err: ErrStaleLease}
		index[o.Lease.ID] = i
	}
	for _, st := range steps {
		rows, err := q.Query(ctx, st.sql, oneShot, st.args)
		if err != nil {
			return nil, fmt.Errorf("outbox: %s: %w", st.name, err)
		}
		var (
			id     int64
			state  State
			reason Reason
		)
		if _, err := pgx.ForEachRow(rows, []any{&id, &state, &reason}, func() error {
			results[index[id]] = Result{ID: id, State: state, Reason: reason}
			return nil
		}); err != nil {
			return nil, fmt.Errorf("outbox: %s: %w", st.name, err)
		}
	}
	if tx, ok := q.(pgx.Tx); ok {
		if err := tx.Commit(ctx); err != nil {
			return nil, fmt.Errorf("outbox: record: committing: %w", err)
		}
	}
	for i, r := range results {
		transition := outcomeTransitions[outcomes[i].Kind]
		switch {
		case r.Err != nil:
			s.metrics.staleWrites(transition, 1)
		case r.State == StateUncertain:
			s.metrics.moved("T4", r.State)
		case outcomes[i].Kind == Accepted && r.State != StateAccepted:
			// An error report came while the item was in flight: the
			// accept lands where the report says, T10's way.
			s.metrics.moved("T10", r.State)
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
	return results, nil
}

func (s *Store) acceptArgs(outcomes []Outcome, idx []int) pgx.NamedArgs {
	ids, tokens, refs := make([]int64, len(idx)), make([]int64, len(idx)), make([]string, len(idx))
	for j, i := range idx {
		ids[j], tokens[j], refs[j] = outcomes[i].Lease.ID, outcomes[i].Lease.LeaseToken, outcomes[i].ProviderRef
	}
	return pgx.NamedArgs{"ids": ids, "tokens": tokens, "refs": refs}
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

func (s *Store) settleArgs(outcomes []Outcome, idx []int) pgx.NamedArgs {
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
func (s *Store) record(ctx context.Context, db TxBeginner, o Outcome) (State, error) {
	res, err := s.Record(ctx, db, []Outcome{o})
	if err != nil {
		return "", err
	}
	return res[0].State, res[0].Err
}

// Accept is T2 for one lease.
func (s *Store) Accept(ctx context.Context, db TxBeginner, l Lease, providerRef string) error {
	_, err := s.record(ctx, db, Outcome{Lease: l, Kind: Accepted, ProviderRef: providerRef})
	return err
}

// Retry is T3 for one lease (or T4, past the cap or the horizon); it returns
// the state the item landed in. Refused says the provider refused this
// attempt outright (see Outcome.Refused).
func (s *Store) Retry(ctx context.Context, db TxBeginner, l Lease, e ErrorInfo, refused bool) (State, error) {
	return s.record(ctx, db, Outcome{Lease: l, Kind: Retry, Error: e, Refused: refused})
}

// RetryRateLimited is T3 after a rate-limit answer (or T4, past the cap or
// the horizon).
func (s *Store) RetryRateLimited(ctx context.Context, db TxBeginner, l Lease, e ErrorInfo) (State, error) {
	return s.record(ctx, db, Outcome{Lease: l, Kind: RateLimited, Error: e})
}

// MarkUncertain is T4 for one lease.
func (s *Store) MarkUncertain(ctx context.Context, db TxBeginner, l Lease, e ErrorInfo, refused bool) error {
	_, err := s.record(ctx, db, Outcome{Lease: l, Kind: Uncertain, Error: e, Refused: refused})
	return err
}

// Reject is T5 for one lease. Rejected is terminal.
func (s *Store) Reject(ctx context.Context, db TxBeginner, l Lease, e ErrorInfo) error {
	_, err := s.record(ctx, db, Outcome{Lease: l, Kind: Rejected, Error: e})
	return err
}

// Quarantine is T6 for one lease.
func (s *Store) Quarantine(ctx context.Context, db TxBeginner, l Lease, reason Reason, e ErrorInfo) error {
	_, err := s.record(ctx, db, Outcome{Lease: l, Kind: Quarantined, Reason: reason, Error: e})
	return err
}

// sqlT7Confirm is T7: accepted to confirmed on provider evidence.
const sqlT7Confirm = `
WITH locked AS MATERIALIZED (
    SELECT o.id FROM outbox_items o WHERE o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
)
UPDATE outbox_items o SET state = 'confirmed', confirmed_at = clock_timestamp(), updated_at = clock_timestamp()
WHERE o.id IN (SELECT id FROM locked) AND o.state = 'accepted'
RETURNING o.id`

// Confirm is T7 for a batch: it moves the given accepted items to confirmed.
// It returns the ids confirmed; for every other id it re-reads the item and
// reports a *StateError (or ErrNotFound) in the map, and counts it stale.
func (s *Store) Confirm(ctx context.Context, q Querier, ids []int64) (confirmed []int64, refused map[int64]error, err error) {
	ctx, span := batchSpan(ctx, "confirm", "T7")
	confirmed, refused, err = s.confirm(ctx, q, ids)
	endBatch(span, len(ids), err)
	return confirmed, refused, err
}

func (s *Store) confirm(ctx context.Context, q Querier, ids []int64) (confirmed []int64, refused map[int64]error, err error) {
	if len(ids) == 0 {
		return nil, nil, nil
	}
	rows, err := q.Query(ctx, sqlT7Confirm, pgx.NamedArgs{"ids": ids})
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: T7 confirm: %w", err)
	}
	confirmed, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: T7 confirm: %w", err)
	}
	done := make(map[int64]bool, len(confirmed))
	for _, id := range confirmed {
		done[id] = true
		s.metrics.moved("T7", StateConfirmed)
	}
	var missing []int64
	for _, id := range ids {
		if !done[id] {
			missing = append(missing, id)
		}
	}
	if len(missing) == 0 {
		return confirmed, nil, nil
	}
	refused = make(map[int64]error, len(missing))
	for _, id := range missing {
		refused[id] = s.mismatch(ctx, q, id, "T7", StateAccepted)
	}
	s.metrics.staleWrites("T7", len(missing))
	return confirmed, refused, nil
}

// ProviderFailure is the provider's asynchronous word that it failed an item
// it had accepted (T10): a Stripe meter error report naming the item's
// identifier. The mapping from the provider's error code to To and Reason is
// the exporter's (exporter.ClassifyReport).
type ProviderFailure struct {
	// ID is the item.
	ID int64
	// To is StateQuarantined, for a cause a mapping fix can cure (Reason
	// says which), or StateRejected, for any other refusal: terminal.
	To State
	// Reason is the quarantine reason when To is StateQuarantined, and
	// empty otherwise.
	Reason Reason
	// Error is the provider's error code and message; it is sanitised before
	// it is written. A report answers no request, so it has no HTTP status.
	Error ErrorInfo
}

// sqlT10Fail is T10: accepted to quarantined or rejected on the provider's
// asynchronous error report. The report proves that the event the provider
// received under the item's identifier was not recorded. When at most one
// attempt of the item may have reached the provider (the accepted one), no
// send of it was recorded at all, so refused_attempts := attempts: the item
// may then be re-addressed (T9r). Otherwise another send carried the same
// identifier and may have been recorded, so refused_attempts stays and the
// item keeps its identifier for good (a requeue in place, T9, resends the
// same identifier, which the provider deduplicates). provider_ref and
// accepted_at stay, for the record. No outbox_attempts row: that log holds
// one outcome per claim, and the accepting claim has its outcome already;
// the report itself is kept by the caller (meter_error_evidence).
const sqlT10Fail = `
WITH b AS (
    SELECT * FROM unnest(@ids::bigint[], @states::text[], @reasons::text[],
                         @codes::text[], @statuses::int[], @messages::text[])
        AS b(id, target, reason, code, status, message)
),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_items o WHERE o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
)
UPDATE outbox_items o SET
    state = b.target, quarantine_reason = nullif(b.reason, ''),
    refused_attempts = CASE WHEN o.attempts - o.refused_attempts <= 1 THEN o.attempts ELSE o.refused_attempts END,
    last_error_code = b.code, last_error_status = nullif(b.status, 0), last_error = nullif(b.message, ''),
    updated_at = clock_timestamp()
FROM b
WHERE o.id = ANY(@ids::bigint[]) AND o.id = b.id AND o.id IN (SELECT id FROM locked) AND o.state = 'accepted'
RETURNING o.id, o.state`

// FailAccepted is T10 for a batch: the provider reported, after accepting
// them, that it failed the given items. Each accepted item moves to its
// failure's To (quarantined with its Reason, or rejected) with the
// sanitised error as its last error, in one statement that locks the rows in
// id order. It returns the ids moved; for every other id it re-reads the
// item and reports a *StateError (or ErrNotFound) in the map, counted as a
// stale write, and changes nothing. The error return is for failures of the
// database or of the input (a target other than quarantined or rejected, a
// quarantine without a known reason, one item twice); then nothing was
// written. It runs on q, so a caller can make it part of its transaction.
func (s *Store) FailAccepted(ctx context.Context, q Querier, fs []ProviderFailure) (failed []int64, refused map[int64]error, err error) {
	ctx, span := batchSpan(ctx, "fail_accepted", "T10")
	failed, refused, err = s.failAccepted(ctx, q, fs)
	endBatch(span, len(fs), err)
	return failed, refused, err
}

func (s *Store) failAccepted(ctx context.Context, q Querier, fs []ProviderFailure) (failed []int64, refused map[int64]error, err error) {
	if len(fs) == 0 {
		return nil, nil, nil
	}
	n := len(fs)
	ids, states, reasons := make([]int64, n), make([]string, n), make([]string, n)
	codes, statuses, messages := make([]string, n), make([]int32, n), make([]string, n)
	byID := make(map[int64]ProviderFailure, n)
	for i, f := range fs {
		if _, dup := byID[f.ID]; dup {
			return nil, nil, fmt.Errorf("outbox: T10: item %d appears twice in one batch", f.ID)
		}
		byID[f.ID] = f
		if err := f.check(); err != nil {
			return nil, nil, fmt.Errorf("outbox: T10: %w", err)
		}
		e := f.Error.Sanitized()
		ids[i], states[i], reasons[i] = f.ID, string(f.To), string(f.Reason)
		codes[i], statuses[i], messages[i] = e.Code, int32(e.Status), e.Message
	}
	rows, err := q.Query(ctx, sqlT10Fail, pgx.NamedArgs{
		"ids": ids, "states": states, "reasons": reasons,
		"codes": codes, "statuses": statuses, "messages": messages,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: T10 fail accepted: %w", err)
	}
	var (
		id    int64
		state State
	)
	done := make(map[int64]bool, n)
	if _, err := pgx.ForEachRow(rows, []any{&id, &state}, func() error {
		failed = append(failed, id)
		done[id] = true
		return nil
	}); err != nil {
		return nil, nil, fmt.Errorf("outbox: T10 fail accepted: %w", err)
	}
	for _, id := range failed {
		f := byID[id]
		s.metrics.moved("T10", f.To)
		if f.To == StateQuarantined {
			s.metrics.quarantinedFor(f.Reason)
		}
	}
	var missing []int64
	for _, id := range ids {
		if !done[id] {
			missing = append(missing, id)
		}
	}
	if len(missing) == 0 {
		return failed, nil, nil
	}
	refused = make(map[int64]error, len(missing))
	for _, id := range missing {
		refused[id] = s.mismatch(ctx, q, id, "T10", StateAccepted)
	}
	s.metrics.staleWrites("T10", len(missing))
	return failed, refused, nil
}

// mismatch re-reads an item after a conditional write found nothing and says
// why: ErrNotFound or a *StateError.
func (s *Store) mismatch(ctx context.Context, q Querier, id int64, transition string, expected State) error {
	var (
		state State
		token int64
	)
	err := q.QueryRow(ctx, "SELECT state, lease_token FROM outbox_items WHERE id = $1", id).Scan(&state, &token)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: %d", ErrNotFound, id)
	}
	if err != nil {
		return fmt.Errorf("outbox: %s: re-reading item %d: %w", transition, id, err)
	}
	return &StateError{ID: id, Transition: transition, Expected: expected, Current: state, CurrentLeaseToken: token}
}

// Recovery is what an operator decided about an uncertain item (T8).
type Recovery struct {
	// To is StateAccepted (the provider has it), StatePending (send it again
	// with the same identifier) or StateRejected (abandon it).
	To State
	// ExpectLeaseToken is the lease token of the item as the operator
	// reviewed it; the recovery is refused if the item moved since.
	ExpectLeaseToken int64
	// NotReached, with To = pending, records the operator's finding, from
	// evidence such as reconciliation, that no attempt of the item reached
	// the provider. Only then may it be sent past the horizon, or later be
	// re-addressed; without it, recovery to pending is refused past the
	// horizon (ErrPastHorizon). It needs a Reason.
	NotReached bool
	// ProviderRef is the provider's evidence for To = accepted (optional).
	ProviderRef string
	// Reason explains the decision; it is sanitised and kept as the item's
	// last_error message for rejected and for a NotReached recovery.
	Reason string
}

// ErrPastHorizon refuses a recovery to pending of an item past its horizon
// when an attempt may have reached the provider: a resend could double-bill.
var ErrPastHorizon = errors.New("outbox: past the horizon, a resend could double-bill; recover to pending only with evidence that no attempt reached the provider")

// sqlT8Recover is T8: an operator's decision about an uncertain item. To
// pending it grants a fresh attempt budget (attempts_base := attempts;
// attempts and first_attempt_at do not move), and it is refused past the
// horizon unless no attempt may have reached the provider or the operator
// records that none did (refused_attempts := attempts).
const sqlT8Recover = `
UPDATE outbox_items SET
    state             = @to,
    accepted_at       = CASE WHEN @to = 'accepted' THEN clock_timestamp() ELSE accepted_at END,
    provider_ref      = CASE WHEN @to = 'accepted' THEN coalesce(nullif(@ref, ''), provider_ref) ELSE provider_ref END,
    next_attempt_at   = CASE WHEN @to = 'pending' THEN clock_timestamp() ELSE next_attempt_at END,
    refused_attempts  = CASE WHEN @to = 'pending' AND @not_reached THEN attempts ELSE refused_attempts END,
    attempts_base     = CASE WHEN @to = 'pending' THEN attempts ELSE attempts_base END,
    last_error_code   = CASE WHEN @to = 'rejected' THEN 'operator_rejected'
                             WHEN @not_reached THEN 'operator_not_reached' ELSE last_error_code END,
    last_error_status = CASE WHEN @to = 'rejected' OR @not_reached THEN NULL ELSE last_error_status END,
    last_error        = CASE WHEN @to = 'rejected' OR @not_reached THEN nullif(@reason, '') ELSE last_error END,
    updated_at        = clock_timestamp()
WHERE id = @id AND state = 'uncertain' AND lease_token = @token
  AND (@to <> 'pending' OR @not_reached OR refused_attempts = attempts
       OR first_attempt_at + @horizon::interval > clock_timestamp())`

// Recover is T8. Zero rows affected gives a *StateError carrying the item's
// current state and lease token, ErrNotFound, or ErrPastHorizon; nothing is
// retried.
func (s *Store) Recover(ctx context.Context, q Querier, id int64, r Recovery) error {
	switch r.To {
	case StateAccepted, StatePending, StateRejected:
	default:
		return fmt.Errorf("outbox: recovery to %q: only accepted, pending or rejected", r.To)
	}
	if r.NotReached && r.To != StatePending {
		return errors.New("outbox: recovery: not-reached goes with a recovery to pending only")
	}
	reason := ErrorInfo{Code: "operator", Message: r.Reason}.Sanitized().Message
	if r.NotReached && reason == "" {
		return errors.New("outbox: recovery: a not-reached finding needs a reason")
	}
	tag, err := q.Exec(ctx, sqlT8Recover, pgx.NamedArgs{
		"id": id, "token": r.ExpectLeaseToken, "to": string(r.To), "ref": r.ProviderRef, "reason": reason,
		"not_reached": r.NotReached, "horizon": s.cfg.Horizon,
	})
	if err != nil {
		return fmt.Errorf("outbox: T8 recover item %d: %w", id, err)
	}
	if tag.RowsAffected() == 1 {
		s.metrics.moved("T8", r.To)
		return nil
	}
	s.metrics.staleWrites("T8", 1)
	err = s.mismatch(ctx, q, id, "T8", StateUncertain)
	var se *StateError
	if errors.As(err, &se) && se.Current == StateUncertain && se.CurrentLeaseToken == r.ExpectLeaseToken {
		return fmt.Errorf("%w: item %d", ErrPastHorizon, id)
	}
	return err
}

// sqlT9Requeue is T9: an operator requeues a quarantined item after fixing
// the cause without changing the mapping it was built from (a meter created
// at Stripe, the node's account corrected). It keeps its identity and
// identifier, and gets a fresh attempt budget. Only an item whose payload is
// sendable as it stands may go back: one staged without a customer, a meter
// or an account must be re-addressed (T9r) under a mapping that supplies it.
const sqlT9Requeue = `
UPDATE outbox_items SET
    state = 'pending', quarantine_reason = NULL, next_attempt_at = clock_timestamp(),
    attempts_base = attempts, updated_at = clock_timestamp(),
    reported_state = NULL, reported_reason = NULL, reported_code = NULL, reported_message = NULL
WHERE id = @id AND state = 'quarantined' AND mapping_version = @version
  AND destination_account <> '' AND mapping_version > 0
  AND coalesce(payload ->> 'customer', '') <> '' AND coalesce(payload ->> 'event_name', '') <> ''`

// ErrNotSendable refuses to requeue in place an item staged without a
// customer, a meter event name or an account: nothing could send it. Fix the
// mapping and re-address it (Supersede).
var ErrNotSendable = errors.New("outbox: the item was staged without a customer, meter or account; re-address it under a mapping that supplies them")

// Requeue is T9. It answers ErrMappingChanged when the item was built from
// another mapping version than the one given, ErrNotSendable when its
// payload lacks what a send needs, a *StateError when it is not quarantined,
// ErrNotFound when there is no such item.
func (s *Store) Requeue(ctx context.Context, q Querier, id int64, mappingVersion int) error {
	tag, err := q.Exec(ctx, sqlT9Requeue, pgx.NamedArgs{"id": id, "version": mappingVersion})
	if err != nil {
		return fmt.Errorf("outbox: T9 requeue item %d: %w", id, err)
	}
	if tag.RowsAffected() == 1 {
		s.metrics.moved("T9", StatePending)
		return nil
	}
	s.metrics.staleWrites("T9", 1)
	return s.requeueRefusal(ctx, q, id, "T9", mappingVersion)
}

func (s *Store) requeueRefusal(ctx context.Context, q Querier, id int64, transition string, mappingVersion int) error {
	var (
		state             State
		version           int
		token             int64
		refused, attempts int
		sendable          bool
	)
	err := q.QueryRow(ctx, `SELECT state, mapping_version, lease_token, refused_attempts, attempts,
		    destination_account <> '' AND mapping_version > 0
		    AND coalesce(payload ->> 'customer', '') <> '' AND coalesce(payload ->> 'event_name', '') <> ''
		FROM outbox_items WHERE id = $1`, id).Scan(&state, &version, &token, &refused, &attempts, &sendable)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: %d", ErrNotFound, id)
	case err != nil:
		return fmt.Errorf("outbox: %s: re-reading item %d: %w", transition, id, err)
	case state != StateQuarantined:
		return &StateError{ID: id, Transition: transition, Expected: StateQuarantined, Current: state, CurrentLeaseToken: token}
	case version != mappingVersion:
		return fmt.Errorf("%w: item %d was built from mapping version %d, not %d", ErrMappingChanged, id, version, mappingVersion)
	case transition == "T9" && !sendable:
		return fmt.Errorf("%w: item %d", ErrNotSendable, id)
	case transition == "T9r" && refused != attempts:
		return fmt.Errorf("%w: item %d", ErrMayHaveReached, id)
	}
	return fmt.Errorf("outbox: %s: item %d changed concurrently; read it again", transition, id)
}

// sqlT9rSupersede closes a quarantined item that an operator re-addressed:
// only an item no attempt of which may have reached the provider, in the same
// transaction as its successor's insert.
const sqlT9rSupersede = `
UPDATE outbox_items SET state = 'superseded', superseded_by = @successor, updated_at = clock_timestamp()
WHERE id = @id AND state = 'quarantined' AND mapping_version = @version AND refused_attempts = attempts`

// ErrSuccessorExists refuses a Supersede whose successor identity is already
// an item: re-addressing must create the successor, or usage could be
// counted twice.
var ErrSuccessorExists = errors.New("outbox: the successor identity exists already")

// Supersede is T9r, the requeue that re-addresses: inside the caller's
// transaction it enqueues successor (T0 or T0q) under its new identity and
// closes the quarantined item id (built from mappingVersion) as superseded,
// pointing to the successor, so its usage is counted once. The successor must
// name the same tenant and subject under a different identity (a new mapping
// version, account, mode or exporter, or — when nothing else changed — the
// next re-address generation of its subject ref, ReaddressRef; BaseRef of
// both must agree). Only an item proven not to have reached
// the provider may be re-addressed: otherwise ErrMayHaveReached, and the item
// keeps its identifier for good. On any error the caller must roll back.
func (s *Store) Supersede(ctx context.Context, tx pgx.Tx, id int64, mappingVersion int, successor NewItem) (Enqueued, error) {
	old, err := s.Get(ctx, tx, id)
	if err != nil {
		return Enqueued{}, err
	}
	if successor.TenantKey != old.TenantKey || successor.SubjectKind != old.SubjectKind || BaseRef(successor.SubjectRef) != BaseRef(old.SubjectRef) {
		return Enqueued{}, fmt.Errorf("outbox: T9r: the successor of item %d must carry the same tenant and subject", id)
	}
	if successor.Identity == old.Identity {
		return Enqueued{}, fmt.Errorf("outbox: T9r: the successor of item %d has the same identity; requeue it (T9) instead", id)
	}
	enq, err := s.Enqueue(ctx, tx, successor)
	if err != nil {
		return Enqueued{}, err
	}
	if !enq.Inserted {
		return Enqueued{}, fmt.Errorf("%w: item %d", ErrSuccessorExists, enq.ID)
	}
	tag, err := tx.Exec(ctx, sqlT9rSupersede, pgx.NamedArgs{"id": id, "version": mappingVersion, "successor": enq.ID})
	if err != nil {
		return Enqueued{}, fmt.Errorf("outbox: T9r supersede item %d: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		s.metrics.staleWrites("T9r", 1)
		return Enqueued{}, s.requeueRefusal(ctx, tx, id, "T9r", mappingVersion)
	}
	s.metrics.moved("T9r", StateSuperseded)
	return enq, nil
}
