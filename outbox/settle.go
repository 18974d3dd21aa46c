package outbox

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// The transitions out of leased share one predicate (docs/outbox.md, "The
// states"):
//
//	WHERE id = ? AND lease_token = ? AND state = 'leased'
//
// Each is one UPDATE over a batch (unnest of parallel arrays) of one shard
// group: every reference to the states carries the batch's buckets
// (@buckets) and the join the item's own, so that on Citus the statement is
// one task on one shard. It returns what the attempt's row needs; on Citus
// that row is written by a second statement of the same transaction
// (sqlAttempts), as an INSERT inside the UPDATE would send the statement
// through the coordinator; on one server by the statement itself
// (oneServer). Items not returned were fenced out. The "locked" CTE takes
// the batch's row locks in ascending id order, the order every waiting
// writer of this package uses, so that two batches over overlapping items
// (a stale writer's and the sweep's, say) can wait for each other but never
// deadlock. Claims never wait: they skip locked rows. The UPDATE depends on
// "locked" through an uncorrelated count, which the planner runs once as a
// one-time filter before the UPDATE reads its first row: every lock is
// held, in id order, before any row is written, and the join costs one pass
// over the batch (a semi-join against the CTE would compare each row with
// every locked id).
//
// The accept, the statement of every accepted send, is a cached statement
// run with its generic plan (acceptTrip), planned once per connection for
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
WITH b AS (SELECT * FROM unnest(@ids::bigint[], @item_buckets::smallint[], @tokens::bigint[], @refs::text[], @meters::text[])
    AS b(id, bucket, token, ref, meter)),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
)
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
WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = b.id AND o.bucket = b.bucket AND (SELECT count(*) FROM locked) >= 0
  AND o.lease_token = b.token AND o.state = 'leased' COLLATE "C"
RETURNING o.id, o.state, coalesce(o.quarantine_reason, ''), o.lease_owner, o.leased_at`

	// A retry becomes mark_uncertain in the same statement when it is past
	// the cap, or would happen past the horizon (from first_attempt_at) while
	// some attempt, this one included, may have reached the provider: the
	// claim's budget (withinBudget) and the sweep draw the same line. Both
	// sides of the horizon comparison are the database clock, read once in
	// the FROM list ("clock") as a UTC timestamp: the delay and the horizon
	// are timestamp arithmetic, which Citus runs on the shard (it refuses
	// an UPDATE that applies the clock's time-zone-aware arithmetic to a
	// column).
	sqlRetry = `
WITH b AS (
    SELECT * FROM unnest(@ids::bigint[], @item_buckets::smallint[], @tokens::bigint[], @delays::bigint[], @refused::bool[],
                         @kinds::text[], @codes::text[], @statuses::int[], @messages::text[])
        AS b(id, bucket, token, delay_us, refused, kind, code, status, message)
),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
)
UPDATE outbox_item_states o SET
    state = CASE
        WHEN o.attempts - o.attempts_base >= @max THEN 'uncertain'
        WHEN o.refused_attempts + b.refused::int < o.attempts
             AND clock.now_utc + b.delay_us * interval '1 microsecond' > (o.first_attempt_at AT TIME ZONE 'UTC') + @horizon::interval
            THEN 'uncertain'
        ELSE 'pending' END,
    next_attempt_at   = (clock.now_utc + b.delay_us * interval '1 microsecond') AT TIME ZONE 'UTC',
    refused_attempts  = o.refused_attempts + b.refused::int,
    last_error_code   = b.code, last_error_status = nullif(b.status, 0), last_error = nullif(b.message, ''),
    lease_expires_at  = NULL, updated_at = statement_timestamp()
FROM b, unnest(ARRAY[statement_timestamp() AT TIME ZONE 'UTC']) AS clock (now_utc)
WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = ANY(@ids::bigint[]) AND o.id = b.id AND o.bucket = b.bucket
  AND (SELECT count(*) FROM locked) >= 0 AND o.lease_token = b.token AND o.state = 'leased'
RETURNING o.id, o.state, ''::text, o.lease_owner, o.leased_at`

	// sqlSettleFailure is mark_uncertain, reject and quarantine, the
	// failures that end automatic delivery: the same predicate, a target
	// state per row.
	sqlSettleFailure = `
WITH b AS (
    SELECT * FROM unnest(@ids::bigint[], @item_buckets::smallint[], @tokens::bigint[], @states::text[], @reasons::text[], @refused::bool[],
                         @codes::text[], @statuses::int[], @messages::text[])
        AS b(id, bucket, token, target, reason, refused, code, status, message)
),
locked AS MATERIALIZED (
    SELECT o.id FROM outbox_item_states o WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
)
UPDATE outbox_item_states o SET
    state = b.target, quarantine_reason = nullif(b.reason, ''),
    refused_attempts = o.refused_attempts + b.refused::int,
    last_error_code = b.code, last_error_status = nullif(b.status, 0), last_error = nullif(b.message, ''),
    lease_expires_at = NULL, updated_at = statement_timestamp()
FROM b
WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = ANY(@ids::bigint[]) AND o.id = b.id AND o.bucket = b.bucket
  AND (SELECT count(*) FROM locked) >= 0 AND o.lease_token = b.token AND o.state = 'leased'
RETURNING o.id, o.state, coalesce(o.quarantine_reason, ''), o.lease_owner, o.leased_at`

	// sqlAttempts appends the outcomes of a batch of one shard group to
	// outbox_attempts, one row per claim: the transition's statement
	// returned the lease's owner and time and the state it left the item
	// in, the caller knows the rest.
	sqlAttempts = `
INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused,
                             provider_ref, error_code, error_status, error_message, bucket)
SELECT id, token, owner, leased_at, outcome, state_after, refused, nullif(ref, ''), code, nullif(status, 0), nullif(message, ''), bucket
FROM unnest(@ids::bigint[], @tokens::bigint[], @owners::text[], @leased_at::timestamptz[], @outcomes::text[], @states::text[],
            @refused::bool[], @refs::text[], @codes::text[], @statuses::int[], @messages::text[], @item_buckets::smallint[])
    AS a(id, token, owner, leased_at, outcome, state_after, refused, ref, code, status, message, bucket)`
)

// On one server a transition writes its attempts' rows itself, in a "log"
// CTE over the rows it updated: one statement, one round trip, as a batch
// of outcomes always took. oneServer makes that statement from the routed
// one: its UPDATE becomes the CTE "t", returning what the log needs.
var (
	sqlAcceptOneServer = oneServer(sqlAccept,
		`o.id, o.state, coalesce(o.quarantine_reason, '') AS reason, o.lease_owner, o.leased_at, o.lease_token, o.provider_ref, o.bucket`,
		`INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused, provider_ref, bucket)
    SELECT id, lease_token, lease_owner, leased_at, 'accepted', state, false, provider_ref, bucket FROM t`)
	sqlRetryOneServer = oneServer(sqlRetry,
		`o.id, o.state, ''::text AS reason, o.lease_owner, o.leased_at, o.lease_token, o.bucket, b.kind, b.refused, b.code, b.status, b.message`,
		`INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused,
                                 error_code, error_status, error_message, bucket)
    SELECT id, lease_token, lease_owner, leased_at, kind, state, refused, code, nullif(status, 0), nullif(message, ''), bucket FROM t`)
	sqlSettleFailureOneServer = oneServer(sqlSettleFailure,
		`o.id, o.state, coalesce(o.quarantine_reason, '') AS reason, o.lease_owner, o.leased_at, o.lease_token, o.bucket, b.refused, b.code, b.status, b.message`,
		`INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused,
                                 error_code, error_status, error_message, bucket)
    SELECT id, lease_token, lease_owner, leased_at, state, state, refused, code, nullif(status, 0), nullif(message, ''), bucket FROM t`)
)

// oneServer is a routed transition, sql, with its attempts' rows written
// by a "log" CTE: the UPDATE becomes the CTE "t", returning returning,
// and the statement returns what sql returns.
func oneServer(sql, returning, log string) string {
	i, j := strings.Index(sql, "\nUPDATE "), strings.Index(sql, "\nRETURNING ")
	return sql[:i] + ",\nt AS (" + strings.ReplaceAll(sql[i:j], "\n", "\n    ") + "\n    RETURNING " + returning + "\n),\nlog AS (\n    " +
		log + "\n)\nSELECT id, state, reason, lease_owner, leased_at FROM t"
}

// oneShot runs a batch statement (the retry's and the failures'; the accept
// has acceptTrip) as an unnamed statement, planned for the arrays it is
// given: a cached prepared statement would switch to a generic plan after
// five runs, and the generic plan of these joins over unnest() scans a
// partial index's every entry — dead ones too — growing with every batch.
const oneShot = pgx.QueryExecModeExec

// sqlLockBatch takes the row locks of a batch of outcomes of one shard
// group up front, in ascending id order, so that the per-transition
// statements that follow in the same transaction never wait on one
// another's rows in another order.
const sqlLockBatch = `SELECT id FROM outbox_item_states WHERE bucket = ANY(@buckets::smallint[]) AND id = ANY(@ids::bigint[]) ORDER BY id FOR UPDATE`

// Record writes the outcomes of attempts (accept, retry, mark_uncertain,
// reject, quarantine), batched, one statement per transition present and
// shard group, each followed by the attempts' rows. Each outcome lands or
// is fenced out on its own; a fenced outcome's Result carries
// ErrStaleLease, is counted by the stale-writer metric and must not be
// retried. Every statement pair runs in one READ COMMITTED transaction of
// its own; a batch of several transitions or shard groups first locks
// every row of the batch, a group after another in the placement's order
// and each in id order, so concurrent writers never deadlock. The error
// return is for failures of the database or of the input (an outcome kind
// unknown, one item twice, a quarantine without a reason); then nothing of
// the batch was written.
func (s *Store) Record(ctx context.Context, db pgdb.DB, outcomes []Outcome) ([]Result, error) {
	ctx, span := batchSpan(ctx, "settle", TransitionAccept, TransitionRetry, TransitionMarkUncertain,
		TransitionReject, TransitionQuarantine)
	res, err := s.recordBatch(ctx, db, outcomes)
	endBatch(span, len(outcomes), err)
	return res, err
}

// recordBatch checks a batch of outcomes, cuts it by shard group, runs the
// statements of each transition present, and counts where every outcome
// landed.
func (s *Store) recordBatch(ctx context.Context, db pgdb.DB, outcomes []Outcome) ([]Result, error) {
	if err := refuseOpenTx(db); err != nil {
		return nil, fmt.Errorf("outbox: record: %w", err)
	}
	if err := checkOutcomes(outcomes); err != nil || len(outcomes) == 0 {
		return nil, err
	}
	shards, err := s.Shards(ctx, db)
	if err != nil {
		return nil, err
	}
	buckets := make([]int16, len(outcomes))
	idx := make([]int, len(outcomes))
	for i, o := range outcomes {
		buckets[i], idx[i] = tenantbucket.Of(o.Lease.TenantKey), i
	}
	runs := tenantbucket.Split(shards, idx, func(i int) int16 { return buckets[i] })
	slices.SortFunc(runs, func(a, b []int) int { return shards.GroupOf(buckets[a[0]]) - shards.GroupOf(buckets[b[0]]) })
	groups := make([]settleGroup, len(runs))
	for g, run := range runs {
		groups[g] = s.settleGroup(outcomes, buckets, run, !shards.Distributed())
	}
	results, err := settle(ctx, db, outcomes, groups)
	if err != nil {
		return nil, err
	}
	s.countSettled(outcomes, results)
	if shards.Distributed() {
		// A settled lease frees its key: the key's next item is claimable
		// now, in a group a claim may have found empty while it was leased.
		s.quiet.stir(buckets)
	}
	return results, nil
}

// checkOutcomes refuses a batch naming an item twice, an unknown kind of
// outcome, or a quarantine without a known reason.
func checkOutcomes(outcomes []Outcome) error {
	seen := make(map[int64]bool, len(outcomes))
	for _, o := range outcomes {
		if seen[o.Lease.ID] {
			return fmt.Errorf("outbox: item %d appears twice in one batch of outcomes", o.Lease.ID)
		}
		seen[o.Lease.ID] = true
		switch o.Kind {
		case Accepted, Retry, RateLimited, Uncertain, Rejected:
		case Quarantined:
			if !o.Reason.valid() {
				return fmt.Errorf("outbox: item %d: quarantine needs a known reason, got %q", o.Lease.ID, o.Reason)
			}
		default:
			return fmt.Errorf("outbox: item %d: unknown outcome kind %v", o.Lease.ID, o.Kind)
		}
	}
	return nil
}

// settleGroup is the part of a batch of outcomes in one shard group: its
// items (indexes into the batch and their buckets), the batch's distinct
// buckets, and the statement of each transition present.
type settleGroup struct {
	idx     []int
	ids     []int64
	buckets []int16 // distinct
	steps   []settleStep
}

// settleStep is one statement of a group of outcomes: the transition that
// settles the outcomes of some kinds, with their arguments.
type settleStep struct {
	name string
	sql  string
	args pgx.NamedArgs
	// cached runs the statement as a cached prepared statement, not
	// oneShot; generic, with its generic plan (on one server: Citus plans
	// each task on its shard, and refuses a generic plan of the accept).
	cached, generic bool
	// logged says the statement writes its attempts' rows itself (one
	// server: oneServer); else they are sqlAttempts, after it.
	logged bool
}

// settleGroup returns the statements that settle the outcomes at run, all
// of one shard group: accepts, retries (or mark_uncertain past the cap or
// the horizon) and the failures that end automatic delivery
// (mark_uncertain, reject, quarantine).
func (s *Store) settleGroup(outcomes []Outcome, buckets []int16, run []int, single bool) settleGroup {
	g := settleGroup{idx: run, ids: make([]int64, len(run))}
	var accept, retry, failure []int
	for j, i := range run {
		g.ids[j] = outcomes[i].Lease.ID
		if !slices.Contains(g.buckets, buckets[i]) {
			g.buckets = append(g.buckets, buckets[i])
		}
		switch outcomes[i].Kind {
		case Accepted:
			accept = append(accept, i)
		case Retry, RateLimited:
			retry = append(retry, i)
		default:
			failure = append(failure, i)
		}
	}
	add := func(name, sql string, args pgx.NamedArgs, idx []int, cached bool) {
		item := make([]int16, len(idx))
		for j, i := range idx {
			item[j] = buckets[i]
		}
		args["item_buckets"], args["buckets"] = item, g.buckets
		g.steps = append(g.steps, settleStep{name: name, sql: sql, args: args, cached: cached, generic: cached && single, logged: single})
	}
	pick := func(routed, one string) string {
		if single {
			return one
		}
		return routed
	}
	if len(accept) > 0 {
		add("accept", pick(sqlAccept, sqlAcceptOneServer), s.acceptArgs(outcomes, accept), accept, true)
	}
	if len(retry) > 0 {
		add("retry", pick(sqlRetry, sqlRetryOneServer), s.retryArgs(outcomes, retry), retry, false)
	}
	if len(failure) > 0 {
		add("mark_uncertain/reject/quarantine", pick(sqlSettleFailure, sqlSettleFailureOneServer), s.failureArgs(outcomes, failure), failure, false)
	}
	return g
}

// settle runs the groups of a batch and returns each outcome's Result.
// One accept alone (the common batch) is acceptTrip's; anything else runs
// in one READ COMMITTED transaction that first locks, group after group,
// every row of the batch in id order when it holds more than one
// statement, and is committed before settle returns.
func settle(ctx context.Context, db pgdb.DB, outcomes []Outcome, groups []settleGroup) ([]Result, error) {
	results := make([]Result, len(outcomes))
	index := make(map[int64]int, len(outcomes))
	for i, o := range outcomes {
		results[i] = Result{ID: o.Lease.ID, Err: ErrStaleLease}
		index[o.Lease.ID] = i
	}
	if len(groups) == 1 && len(groups[0].steps) == 1 && (groups[0].steps[0].cached || groups[0].steps[0].logged) {
		// One statement: the accept in a transaction of its own, in one
		// round trip on one server (two on Citus); on one server a retry
		// or a failure as a statement alone.
		g, st := groups[0], groups[0].steps[0]
		att := newAttemptRows(len(g.idx))
		each := func(rows pgx.Rows) error { return landed(rows, outcomes, index, results, att) }
		var err error
		if st.cached {
			err = acceptTrip(ctx, db, st, each, att)
		} else {
			var rows pgx.Rows
			if rows, err = db.Query(ctx, st.sql, oneShot, st.args); err == nil {
				err = each(rows)
			}
		}
		if err != nil {
			return nil, fmt.Errorf("outbox: %s: %w", st.name, err)
		}
		return results, nil
	}
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return nil, fmt.Errorf("outbox: record: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if len(groups) > 1 || len(groups[0].steps) > 1 {
		for _, g := range groups {
			if _, err := tx.Exec(ctx, sqlLockBatch, pgx.NamedArgs{"buckets": g.buckets, "ids": g.ids}); err != nil {
				return nil, fmt.Errorf("outbox: record: locking the batch: %w", err)
			}
		}
	}
	for _, g := range groups {
		att := newAttemptRows(len(g.idx))
		for _, st := range g.steps {
			logTo := att
			if st.logged {
				logTo = nil
			}
			each := func(rows pgx.Rows) error { return landed(rows, outcomes, index, results, logTo) }
			var rows pgx.Rows
			switch {
			case st.generic:
				err = genericInTx(ctx, tx, st, each)
			case st.cached:
				if rows, err = tx.Query(ctx, st.sql, st.args); err == nil {
					err = each(rows)
				}
			default:
				if rows, err = tx.Query(ctx, st.sql, oneShot, st.args); err == nil {
					err = each(rows)
				}
			}
			if err != nil {
				return nil, fmt.Errorf("outbox: %s: %w", st.name, err)
			}
		}
		if err := att.write(ctx, tx); err != nil {
			return nil, err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("outbox: record: committing: %w", err)
	}
	return results, nil
}

// landed reads a transition's returned rows: each is an outcome that
// landed, whose Result it sets and whose attempt it adds to att (unless
// nil: the statement wrote it).
func landed(rows pgx.Rows, outcomes []Outcome, index map[int64]int, results []Result, att *attemptRows) error {
	var (
		id       int64
		state    State
		reason   Reason
		owner    *string
		leasedAt *time.Time
	)
	_, err := pgx.ForEachRow(rows, []any{&id, &state, &reason, &owner, &leasedAt}, func() error {
		i := index[id]
		results[i] = Result{ID: id, State: state, Reason: reason}
		if att != nil {
			att.addOutcome(outcomes[i], state, owner, leasedAt)
		}
		return nil
	})
	return err
}

// attemptRows are the rows of outbox_attempts a group's transitions
// write, as sqlAttempts' parallel arrays.
type attemptRows struct {
	ids, tokens      []int64
	owners           []*string
	leasedAt         []*time.Time
	outcomes, states []string
	refused          []bool
	refs, messages   []string
	codes            []*string
	statuses         []int32
	buckets          []int16
}

func newAttemptRows(n int) *attemptRows {
	return &attemptRows{
		ids: make([]int64, 0, n), tokens: make([]int64, 0, n), owners: make([]*string, 0, n),
		leasedAt: make([]*time.Time, 0, n), outcomes: make([]string, 0, n), states: make([]string, 0, n),
		refused: make([]bool, 0, n), refs: make([]string, 0, n), messages: make([]string, 0, n),
		codes: make([]*string, 0, n), statuses: make([]int32, 0, n), buckets: make([]int16, 0, n),
	}
}

// add appends one attempt's row.
func (a *attemptRows) add(id, token int64, bucket int16, owner *string, leasedAt *time.Time, outcome string, after State,
	refused bool, ref string, code *string, status int, message string) {
	a.ids, a.tokens, a.buckets = append(a.ids, id), append(a.tokens, token), append(a.buckets, bucket)
	a.owners, a.leasedAt = append(a.owners, owner), append(a.leasedAt, leasedAt)
	a.outcomes, a.states, a.refused = append(a.outcomes, outcome), append(a.states, string(after)), append(a.refused, refused)
	a.refs, a.codes = append(a.refs, ref), append(a.codes, code)
	a.statuses, a.messages = append(a.statuses, int32(status)), append(a.messages, message)
}

// addOutcome appends the attempt of an outcome that landed in state after:
// an accept's outcome is "accepted" with its provider reference; a retry's
// its kind (retry, rate_limited), a failure's the state it ended in, each
// with the sanitised error.
func (a *attemptRows) addOutcome(o Outcome, after State, owner *string, leasedAt *time.Time) {
	l, bucket := o.Lease, tenantbucket.Of(o.Lease.TenantKey)
	if o.Kind == Accepted {
		a.add(l.ID, l.LeaseToken, bucket, owner, leasedAt, "accepted", after, false, o.ProviderRef, nil, 0, "")
		return
	}
	e := o.Error.Sanitized()
	outcome, refused := string(after), o.Refused
	switch o.Kind {
	case Retry, RateLimited:
		outcome, refused = o.Kind.String(), o.Refused || o.Kind == RateLimited
	case Rejected, Quarantined:
		refused = true
	}
	a.add(l.ID, l.LeaseToken, bucket, owner, leasedAt, outcome, after, refused, "", &e.Code, e.Status, e.Message)
}

// args are sqlAttempts' arguments.
func (a *attemptRows) args() pgx.NamedArgs {
	return pgx.NamedArgs{
		"ids": a.ids, "tokens": a.tokens, "owners": a.owners, "leased_at": a.leasedAt, "outcomes": a.outcomes,
		"states": a.states, "refused": a.refused, "refs": a.refs, "codes": a.codes, "statuses": a.statuses,
		"messages": a.messages, "item_buckets": a.buckets,
	}
}

// write inserts the rows, if any, on q (the transaction of the transitions
// that returned them).
func (a *attemptRows) write(ctx context.Context, q pgdb.Querier) error {
	if len(a.ids) == 0 {
		return nil
	}
	if _, err := q.Exec(ctx, sqlAttempts, a.args()); err != nil {
		return fmt.Errorf("outbox: recording the attempts: %w", err)
	}
	return nil
}

// Around a cached step: its plan is the cache's generic plan from the first
// run (plan_cache_mode force_generic_plan), never one of the five custom
// plans the cache tries first. A custom plan of the accept knows the batch's
// size and, with the state compared under collation "C", no estimate of how
// many items are leased: for a large batch it can read the whole table and
// compare every leased item with every outcome. The setting is saved and
// restored around the step (set_config, local to the transaction): the
// attempts' INSERT that follows runs under the session's own, as Citus
// refuses a forced generic plan of an INSERT … SELECT.
const (
	sqlGenericOnly    = `SELECT set_config('tally.saved_plan_cache_mode', current_setting('plan_cache_mode'), true), set_config('plan_cache_mode', 'force_generic_plan', true)`
	sqlGenericRestore = `SELECT set_config('plan_cache_mode', current_setting('tally.saved_plan_cache_mode'), true)`
)

// acceptTrip runs an accept of one shard group in a READ COMMITTED
// transaction of its own: BEGIN, the generic plan chosen (st.generic), the
// statement, whose rows each reads, the plan cache's mode restored and
// COMMIT in one round trip when the statement writes its attempts' rows
// itself (st.logged); else on one connection of db in two, the attempts'
// rows (att) and COMMIT in the second.
// A failure leaves the transaction to be rolled back as claimTrip's is
// (rollbackLeftOpen; a pool's connection in a transaction is closed on
// release).
func acceptTrip(ctx context.Context, db pgdb.DB, st settleStep, each func(pgx.Rows) error, att *attemptRows) error {
	q, release := pgdb.DB(db), func() {}
	if !st.logged {
		var err error
		if q, release, err = oneConn(ctx, db); err != nil {
			return err
		}
	}
	defer release()
	err := func() error {
		b := &pgx.Batch{}
		b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
		steps := []string{"beginning"}
		if st.generic {
			b.Queue(sqlGenericOnly)
			steps = append(steps, "choosing the generic plan")
		}
		b.Queue(st.sql, st.args)
		var after []string
		if st.logged {
			after = finish(b, st.generic, nil)
		}
		br := q.SendBatch(ctx, b)
		err := readTrip(br, func() error {
			if err := eachRow(br, each); err != nil {
				return err
			}
			return readTrip(br, nil, after...)
		}, steps...)
		if cerr := br.Close(); err == nil && cerr != nil {
			err = cerr
		}
		if err != nil || st.logged {
			return err
		}
		b = &pgx.Batch{}
		after = finish(b, st.generic, att)
		br = q.SendBatch(ctx, b)
		err = readTrip(br, nil, after...)
		if cerr := br.Close(); err == nil && cerr != nil {
			err = cerr
		}
		return err
	}()
	if err != nil {
		rollbackLeftOpen(q)
	}
	return err
}

// finish queues the end of acceptTrip's transaction on b — the plan
// cache's mode restored when generic, att's rows when there are any, and
// COMMIT — and returns the names of the steps queued.
func finish(b *pgx.Batch, generic bool, att *attemptRows) []string {
	var steps []string
	if generic {
		b.Queue(sqlGenericRestore)
		steps = append(steps, "restoring plan_cache_mode")
	}
	if att != nil && len(att.ids) > 0 {
		b.Queue(sqlAttempts, att.args())
		steps = append(steps, "recording the attempts")
	}
	b.Queue("COMMIT")
	return append(steps, "committing")
}

// readTrip reads a pipeline's answers in order: one Exec per step named,
// then read, if any.
func readTrip(br pgx.BatchResults, read func() error, steps ...string) error {
	for _, s := range steps {
		if _, err := br.Exec(); err != nil {
			return fmt.Errorf("%s: %w", s, err)
		}
	}
	if read != nil {
		return read()
	}
	return nil
}

// oneConn is db itself, or, for a pool, one of its connections (released
// by the returned func), so that the round trips of acceptTrip share one
// session.
func oneConn(ctx context.Context, db pgdb.DB) (pgdb.DB, func(), error) {
	p, ok := db.(*pgxpool.Pool)
	if !ok {
		return db, func() {}, nil
	}
	c, err := p.Acquire(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: record: %w", err)
	}
	return c, c.Release, nil
}

// eachRow hands the rows of br's next result to each.
func eachRow(br pgx.BatchResults, each func(pgx.Rows) error) error {
	rows, err := br.Query()
	if err != nil {
		return err
	}
	return each(rows)
}

// genericInTx runs a cached step with its generic plan inside tx, between
// sqlGenericOnly and sqlGenericRestore, in one round trip.
func genericInTx(ctx context.Context, tx pgx.Tx, st settleStep, each func(pgx.Rows) error) error {
	b := &pgx.Batch{}
	b.Queue(sqlGenericOnly)
	b.Queue(st.sql, st.args)
	b.Queue(sqlGenericRestore)
	br := tx.SendBatch(ctx, b)
	err := readTrip(br, func() error {
		if err := eachRow(br, each); err != nil {
			return err
		}
		if _, err := br.Exec(); err != nil {
			return fmt.Errorf("restoring plan_cache_mode: %w", err)
		}
		return nil
	}, "choosing the generic plan")
	if cerr := br.Close(); err == nil && cerr != nil {
		err = cerr
	}
	return err
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
		refused[j], kinds[j] = o.Refused || o.Kind == RateLimited, o.Kind.String()
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
