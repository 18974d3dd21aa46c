package outbox

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// Items known by id only. The statements of the transitions that take ids
// (confirm, fail_accepted, the error report's note, recover, requeue) name
// the items' buckets, @buckets, those of one shard group, so that on Citus
// each is one task on one shard. On Citus the ids' buckets are read first
// (sqlBucketsOf, a read of every shard: the id is not the distribution
// column), at the rate of reconciliation, of the provider's error reports
// and of operators, never per send. On one server nothing is read: the
// statements run without the bucket predicate (unrouted), as one group.

// sqlBucketsOf reads the bucket of each item of @ids that exists.
const sqlBucketsOf = `SELECT id, bucket FROM outbox_item_states WHERE id = ANY(@ids::bigint[])`

// bucketsPredicate is the bucket predicate of the states (alias o) and the
// bodies (alias b) in the statements that take ids; unrouted drops it.
const (
	bucketsPredicateO = `o.bucket = ANY(@buckets::smallint[]) AND `
	bucketsPredicateB = `b.bucket = ANY(@buckets::smallint[]) AND `
)

// unrouted is sql without its bucket predicates: the statement of one
// server, where the placement needs none.
func unrouted(sql string) string {
	return strings.ReplaceAll(strings.ReplaceAll(sql, bucketsPredicateO, ""), bucketsPredicateB, "")
}

// idGroup is ids of one shard group, with their distinct buckets.
type idGroup struct {
	ids     []int64
	buckets []int16
}

// groupIDs cuts ids by shard group, the groups in the placement's order,
// and returns the statement text to run with each: sql itself on Citus,
// unrouted(sql) on one server, where ids make one group. An id no item has
// is in no group.
func (s *Store) groupIDs(ctx context.Context, q pgdb.Querier, ids []int64, sql string) ([]idGroup, string, error) {
	shards, err := s.Shards(ctx, q)
	if err != nil {
		return nil, "", err
	}
	if !shards.Distributed() {
		return []idGroup{{ids: ids}}, unrouted(sql), nil
	}
	rows, err := q.Query(ctx, sqlBucketsOf, pgx.NamedArgs{"ids": ids})
	if err != nil {
		return nil, "", fmt.Errorf("outbox: reading the items' buckets: %w", err)
	}
	type idBucket struct {
		ID     int64
		Bucket int16
	}
	found, err := pgx.CollectRows(rows, pgx.RowToStructByPos[idBucket])
	if err != nil {
		return nil, "", fmt.Errorf("outbox: reading the items' buckets: %w", err)
	}
	runs := tenantbucket.Split(shards, found, func(f idBucket) int16 { return f.Bucket })
	slices.SortFunc(runs, func(a, b []idBucket) int {
		return shards.GroupOf(a[0].Bucket) - shards.GroupOf(b[0].Bucket)
	})
	var groups []idGroup
	for _, run := range runs {
		if len(run) == 0 {
			continue
		}
		var g idGroup
		for _, f := range run {
			g.ids = append(g.ids, f.ID)
			if !slices.Contains(g.buckets, f.Bucket) {
				g.buckets = append(g.buckets, f.Bucket)
			}
		}
		groups = append(groups, g)
	}
	return groups, sql, nil
}

// queryCustom runs sql on q and collects its rows with scan.
func queryCustom[T any](ctx context.Context, q pgdb.Querier, sql string, args any, scan pgx.RowToFunc[T]) ([]T, error) {
	rows, err := q.Query(ctx, sql, args)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, scan)
}

// sqlConfirm is the confirm: accepted to confirmed on provider evidence.
const sqlConfirm = `
WITH locked AS MATERIALIZED (
    SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
)
UPDATE outbox_item_states o SET state = 'confirmed', confirmed_at = statement_timestamp(), updated_at = statement_timestamp()
WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id IN (SELECT id FROM locked) AND o.state = 'accepted'
RETURNING o.id`

// Confirm is the confirm transition for a batch: it moves the given accepted
// items to confirmed. It returns the ids confirmed; for every other id it
// re-reads the item and reports a *StateError (or ErrNotFound) in the map,
// and counts it stale.
func (s *Store) Confirm(ctx context.Context, q pgdb.Querier, ids []int64) (confirmed []int64, refused map[int64]error, err error) {
	ctx, span := batchSpan(ctx, "confirm", TransitionConfirm)
	confirmed, refused, err = s.confirm(ctx, q, ids)
	endBatch(span, len(ids), err)
	return confirmed, refused, err
}

func (s *Store) confirm(ctx context.Context, q pgdb.Querier, ids []int64) (confirmed []int64, refused map[int64]error, err error) {
	if len(ids) == 0 {
		return nil, nil, nil
	}
	groups, sql, err := s.groupIDs(ctx, q, ids, sqlConfirm)
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: confirm: %w", err)
	}
	for _, g := range groups {
		// On one server on its generic plan, as KeyItems: the reconciler
		// runs it once per key, and beside a long history the plan cache
		// would keep a custom plan, planned again at every call. Citus
		// refuses a generic plan of it, and plans each task on its shard.
		run := queryOnGenericPlan[int64]
		if g.buckets != nil {
			run = queryCustom[int64]
		}
		done, err := run(ctx, q, sql, pgx.NamedArgs{"ids": g.ids, "buckets": g.buckets}, pgx.RowTo[int64])
		if err != nil {
			return nil, nil, fmt.Errorf("outbox: confirm: %w", err)
		}
		confirmed = append(confirmed, done...)
	}
	done := make(map[int64]bool, len(confirmed))
	for _, id := range confirmed {
		done[id] = true
		s.metrics.moved(TransitionConfirm, StateConfirmed)
	}
	return confirmed, s.refuseMissing(ctx, q, ids, done, TransitionConfirm, StateAccepted), nil
}

// refuseMissing says why a batch write moved none of ids that are not done:
// it re-reads each such item (mismatch) and counts it as a stale write of
// transition. It returns nil when every id is done.
func (s *Store) refuseMissing(ctx context.Context, q pgdb.Querier, ids []int64, done map[int64]bool, transition Transition, expected State) map[int64]error {
	var missing []int64
	for _, id := range ids {
		if !done[id] {
			missing = append(missing, id)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	refused := make(map[int64]error, len(missing))
	for _, id := range missing {
		refused[id] = s.mismatch(ctx, q, id, transition, expected)
	}
	s.metrics.staleWrites(transition, len(missing))
	return refused
}

// ProviderFailure is the provider's asynchronous word that it failed an item
// it had accepted (fail_accepted): a Stripe meter error report naming the item's
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

// check validates a failure's target: quarantined with a known reason, or
// rejected without one.
func (f ProviderFailure) check() error {
	switch {
	case f.To == StateQuarantined && !f.Reason.valid():
		return fmt.Errorf("item %d: quarantine needs a known reason, got %q", f.ID, f.Reason)
	case f.To == StateRejected && f.Reason != "":
		return fmt.Errorf("item %d: a rejection carries no quarantine reason", f.ID)
	case f.To != StateQuarantined && f.To != StateRejected:
		return fmt.Errorf("item %d: to %q: only quarantined or rejected", f.ID, f.To)
	}
	return nil
}

// failureBatch is a checked batch of provider failures as the parallel
// arrays the statements unnest, their errors sanitised.
type failureBatch struct {
	ids                              []int64
	states, reasons, codes, messages []string
	statuses                         []int32
	byID                             map[int64]ProviderFailure
}

// newFailureBatch checks every failure (check) and that no item appears
// twice, and lays the batch out for its statement.
func newFailureBatch(fs []ProviderFailure) (failureBatch, error) {
	n := len(fs)
	b := failureBatch{
		ids: make([]int64, n), states: make([]string, n), reasons: make([]string, n),
		codes: make([]string, n), statuses: make([]int32, n), messages: make([]string, n),
		byID: make(map[int64]ProviderFailure, n),
	}
	for i, f := range fs {
		if _, dup := b.byID[f.ID]; dup {
			return failureBatch{}, fmt.Errorf("item %d appears twice in one batch", f.ID)
		}
		b.byID[f.ID] = f
		if err := f.check(); err != nil {
			return failureBatch{}, err
		}
		e := f.Error.Sanitized()
		b.ids[i], b.states[i], b.reasons[i] = f.ID, string(f.To), string(f.Reason)
		b.codes[i], b.statuses[i], b.messages[i] = e.Code, int32(e.Status), e.Message
	}
	return b, nil
}

// sqlFailAccepted is the fail_accepted transition: accepted to quarantined or
// rejected on the provider's asynchronous error report. The report proves
// that the event the provider received under the item's identifier was not
// recorded. When at most one attempt of the item may have reached the
// provider (the accepted one), no send of it was recorded at all, so
// refused_attempts := attempts: the item may then be re-addressed
// (supersede). Otherwise another send carried the same identifier and may
// have been recorded, so refused_attempts stays and the item keeps its
// identifier for good (a requeue in place resends the same identifier,
// which the provider deduplicates). provider_ref and accepted_at stay, for the
// record. No outbox_attempts row: that log holds one outcome per claim, and the
// accepting claim has its outcome already; the report itself is kept by the
// caller (meter_error_evidence).
const sqlFailAccepted = `
WITH b AS (
    SELECT * FROM unnest(@ids::bigint[], @states::text[], @reasons::text[],
                         @codes::text[], @statuses::int[], @messages::text[])
        AS b(id, target, reason, code, status, message)
),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
)
UPDATE outbox_item_states o SET
    state = b.target, quarantine_reason = nullif(b.reason, ''),
    refused_attempts = CASE WHEN o.attempts - o.refused_attempts <= 1 THEN o.attempts ELSE o.refused_attempts END,
    last_error_code = b.code, last_error_status = nullif(b.status, 0), last_error = nullif(b.message, ''),
    updated_at = statement_timestamp()
FROM b
WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = ANY(@ids::bigint[]) AND o.id = b.id AND o.id IN (SELECT id FROM locked)
  AND o.state = 'accepted'
RETURNING o.id, o.state`

// FailAccepted is the fail_accepted transition for a batch: the provider
// reported, after accepting them, that it failed the given items. Each
// accepted item moves to its failure's To (quarantined with its Reason, or
// rejected) with the sanitised error as its last error, in one statement that
// locks the rows in id order. It returns the ids moved; for every other id it
// re-reads the item and reports a *StateError (or ErrNotFound) in the map,
// counted as a stale write, and changes nothing. The error return is for
// failures of the database or of the input (a target other than quarantined
// or rejected, a quarantine without a known reason, one item twice); then
// nothing was written. It runs on q, so a caller can make it part of its
// transaction.
func (s *Store) FailAccepted(ctx context.Context, q pgdb.Querier, fs []ProviderFailure) (failed []int64, refused map[int64]error, err error) {
	ctx, span := batchSpan(ctx, "fail_accepted", TransitionFailAccepted)
	failed, refused, err = s.failAccepted(ctx, q, fs)
	endBatch(span, len(fs), err)
	return failed, refused, err
}

func (s *Store) failAccepted(ctx context.Context, q pgdb.Querier, fs []ProviderFailure) (failed []int64, refused map[int64]error, err error) {
	if len(fs) == 0 {
		return nil, nil, nil
	}
	b, err := newFailureBatch(fs)
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: fail accepted: %w", err)
	}
	groups, sql, err := s.groupIDs(ctx, q, b.ids, sqlFailAccepted)
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: fail accepted: %w", err)
	}
	var (
		id    int64
		state State
	)
	done := make(map[int64]bool, len(fs))
	for _, g := range groups {
		// The batch whole in the arrays; the group's buckets pick its rows.
		rows, err := q.Query(ctx, sql, pgx.NamedArgs{
			"ids": b.ids, "states": b.states, "reasons": b.reasons,
			"codes": b.codes, "statuses": b.statuses, "messages": b.messages, "buckets": g.buckets,
		})
		if err != nil {
			return nil, nil, fmt.Errorf("outbox: fail accepted: %w", err)
		}
		if _, err := pgx.ForEachRow(rows, []any{&id, &state}, func() error {
			failed = append(failed, id)
			done[id] = true
			return nil
		}); err != nil {
			return nil, nil, fmt.Errorf("outbox: fail accepted: %w", err)
		}
	}
	for _, id := range failed {
		f := b.byID[id]
		s.metrics.moved(TransitionFailAccepted, f.To)
		if f.To == StateQuarantined {
			s.metrics.quarantinedFor(f.Reason)
		}
	}
	return failed, s.refuseMissing(ctx, q, b.ids, done, TransitionFailAccepted, StateAccepted), nil
}

// sqlNoteFailures notes the provider's error report on items still in
// flight — pending (a retry after an attempt that may have reached the
// provider), leased (the report overtook the answer) or uncertain — so that
// the accept recorded for them afterwards lands where the report says.
// It changes no state: the item's next transition does. Of two reports, a
// rejection outranks a quarantine (a mapping fix would not cure the item);
// otherwise the first note stays. Rows are locked in ascending id order, the
// order of every waiting writer of this package.
const sqlNoteFailures = `
WITH b AS (
    SELECT * FROM unnest(@ids::bigint[], @states::text[], @reasons::text[], @codes::text[], @messages::text[])
        AS b(id, target, reason, code, message)
),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
)
UPDATE outbox_item_states o SET
    reported_state   = b.target,
    reported_reason  = nullif(b.reason, ''),
    reported_code    = b.code,
    reported_message = nullif(b.message, '')
FROM b
WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = ANY(@ids::bigint[]) AND o.id = b.id AND o.id IN (SELECT id FROM locked)
  AND o.state IN ('pending', 'leased', 'uncertain')
  AND (o.reported_state IS NULL OR (o.reported_state = 'quarantined' AND b.target = 'rejected'))
RETURNING o.id`

// NoteFailures records the provider's asynchronous word that it failed the
// given items while they are still in flight (pending, leased or
// uncertain): the next accept of each lands in the failure's To with
// its reason and error instead of accepted. Without the note, a report that
// overtakes the answer to the request it is about would be lost, and the
// item would sit accepted with nothing counted. It returns the ids noted;
// an item in another state, or already noted with an equal or stronger
// verdict, is left as it is. The input is checked as FailAccepted's. It runs
// on q, so a caller can make it part of its transaction.
func (s *Store) NoteFailures(ctx context.Context, q pgdb.Querier, fs []ProviderFailure) ([]int64, error) {
	if len(fs) == 0 {
		return nil, nil
	}
	b, err := newFailureBatch(fs)
	if err != nil {
		return nil, fmt.Errorf("outbox: noting a failure: %w", err)
	}
	groups, sql, err := s.groupIDs(ctx, q, b.ids, sqlNoteFailures)
	if err != nil {
		return nil, fmt.Errorf("outbox: noting failures: %w", err)
	}
	var noted []int64
	for _, g := range groups {
		rows, err := q.Query(ctx, sql, pgx.NamedArgs{
			"ids": b.ids, "states": b.states, "reasons": b.reasons, "codes": b.codes, "messages": b.messages,
			"buckets": g.buckets,
		})
		if err != nil {
			return nil, fmt.Errorf("outbox: noting failures: %w", err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return nil, fmt.Errorf("outbox: noting failures: %w", err)
		}
		noted = append(noted, ids...)
	}
	return noted, nil
}
