package outbox

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// Policy is an ordering policy of the claim (docs/outbox.md, "Ordering
// policies").
type Policy int

// Policies.
const (
	// PerKey is the default: at most one item per ordering key (destination
	// account, customer, meter event name) holds an unexpired lease, across
	// every deliverer using PerKey, and one stuck or slow key never blocks
	// another. It is what Stripe's one-concurrent-call-per-customer-and-meter
	// limit needs.
	PerKey Policy = iota
	// BestEffort claims the oldest due items regardless of key. Opt in only
	// where concurrent calls for one key are harmless.
	BestEffort
)

func (p Policy) String() string {
	switch p {
	case PerKey:
		return "per_key"
	case BestEffort:
		return "best_effort"
	}
	return fmt.Sprintf("Policy(%d)", int(p))
}

// MaxClaim is the most items one claim may take; Claim refuses a larger
// Limit, and the configuration refuses a larger TALLY_DELIVERY_BATCH or
// TALLY_STREAM_BATCH.
const MaxClaim = 1000

// ClaimOptions says who claims how much, how.
type ClaimOptions struct {
	// Owner names the claimer in lease_owner (e.g. "host:pid:worker-3").
	// Required.
	Owner string
	// Limit is the most items to claim. Required, 1 to MaxClaim.
	Limit int
	// Policy is the ordering policy. Defaults to PerKey.
	Policy Policy
	// Lease overrides the Store's lease for this claim when positive; the
	// horizon plus it must stay below the provider's dedup window.
	Lease time.Duration
	// Exporter, when set, claims only items staged for that exporter: each
	// exporter's deliverer claims its own items, under its own policy and
	// flow control. Empty claims every exporter's items.
	Exporter string
	// AcceptPast and AcceptFuture, when positive, are the event timestamps
	// the provider accepts around the database clock at the claim: each
	// lease says whether its payload's timestamp is outside them
	// (Lease.TimestampOutside), decided in the claim's own statement. Zero
	// means unbounded.
	AcceptPast, AcceptFuture time.Duration
	// SkipAccounts are destination accounts whose items this claim leaves
	// alone: accounts Stripe refused the key's access to (Connect), whose
	// items wait pending, without an attempt, until access is back.
	SkipAccounts []string
	// SkipMeters are the event names of destination accounts whose items
	// this claim leaves alone (MeterSkipKey): names whose meters are all
	// deactivated, whose items wait pending, without an attempt, until a
	// meter of the name is active again.
	SkipMeters []string
	// Quiet is, on a distributed database, how long the Store's claims of
	// the same exporter pass over a shard group in which a claim found
	// nothing due, unless a notification names its buckets (Store.Stir).
	// Zero looks in every group at every claim. One server has one group,
	// which is never passed over.
	Quiet time.Duration
}

// MeterSkipKey names the items of one event name of one destination
// account for ClaimOptions.SkipMeters: the first and last parts of their
// ordering key. Neither an account id nor an event name holds "|".
func MeterSkipKey(account, eventName string) string { return account + "|" + eventName }

// perKeyLockSpace is the first key of the two-key advisory locks a PerKey
// claim takes on its keys ("TALY"); the two-key space does not overlap the
// one-key space River and the migrator use.
const perKeyLockSpace int32 = 0x54414c59

// The claim's predicate (docs/outbox.md, "The states"): pending and due, or
// leased with an expired lease, by the statement's time
// (statement_timestamp()): a stable value an index scan can stop at, and
// the one clock a distributed database decides once. "next_attempt_at IS
// NOT NULL" (always true) is the partial index pending_due's predicate too:
// only the picks that say it may read that index.
const (
	pendingDue   = `o.state = 'pending' AND o.next_attempt_at IS NOT NULL AND o.next_attempt_at <= statement_timestamp()`
	leaseExpired = `o.state = 'leased' AND o.lease_expires_at < statement_timestamp()`
)

// withinBudget: inside the attempt cap, and inside the horizon unless no
// attempt may have reached the provider. Items outside the budget are never
// sent again automatically; the maintenance sweep makes them uncertain.
const withinBudget = `o.attempts - o.attempts_base < @max
    AND (o.refused_attempts = o.attempts OR o.first_attempt_at + @horizon::interval > statement_timestamp())
    AND ` + exporterMarker

// earlierInBudget is withinBudget for p, a pending item of the key before
// the one a PerKey claim considers: only an item the claim could take
// keeps its key's later items back.
const earlierInBudget = `p.attempts - p.attempts_base < @max
    AND (p.refused_attempts = p.attempts OR p.first_attempt_at + @horizon::interval > statement_timestamp())
    AND ` + exporterMarkerP

// exporterMarkerP is exporterMarker for the alias p.
const exporterMarkerP = "/*exporter p*/ true"

// exporterMarker stands in every claim statement for the claim's filter
// (claimFilter.apply): o.exporter = '<name>' when ClaimOptions.Exporter is
// set, and the accounts to skip when ClaimOptions.SkipAccounts is; else
// true.
const exporterMarker = "/*exporter*/ true"

// exporterName is what an exporter's name may be (the identity's check):
// safe to write into a statement as a literal.
var exporterName = regexp.MustCompile(`^[a-z][a-z0-9_]*$`)

// claimFilter is what a claim statement is narrowed to: one exporter's
// items (ClaimOptions.Exporter), and none of some destination accounts'
// (ClaimOptions.SkipAccounts) or of some event names of an account
// (ClaimOptions.SkipMeters).
type claimFilter struct {
	exporter string
	skip     bool
	// group narrows every reference to a distributed table to the buckets
	// of one shard group (@buckets), and moves the abandoned attempts out
	// of the statement: the variant a distributed database runs as one
	// shard's statement. Without it the statement names no bucket.
	group bool
}

// inGroup stands in a claim statement for the bucket list of the table
// reference alias, which claimFilter.apply writes in only for a claim of
// one shard group; else it is true, and one server's plans are those of
// a statement without it.
func inGroup(alias string) string { return "/*group " + alias + "*/ true" }

// groupMarker finds inGroup's markers.
var groupMarker = regexp.MustCompile(`/\*group (\w+)\*/ true`)

// apply returns the variant of a claim statement that claims only one
// exporter's items, or every item (exporter empty), and, with skip, none
// of the accounts or account event names of @skip. The name is written as
// a literal, not a parameter, so that even a cached statement's generic
// plan can use the partial indexes of one exporter's items.
// The skipped keys are a parameter, read off the ordering key's first part
// (the item's destination account) and its last (the event name): a
// statement without them is the one every claim runs while nothing is
// stalled or paused.
func (f claimFilter) apply(sql string) string {
	var o, p []string
	if f.exporter != "" {
		o = append(o, "o.exporter = '"+f.exporter+"'")
		p = append(p, "p.exporter = '"+f.exporter+"'")
	}
	if f.skip {
		o = append(o, "split_part(o.ordering_key, '|', 1) <> ALL(@skip::text[])",
			"split_part(o.ordering_key, '|', 1) || '|' || split_part(o.ordering_key, '|', 3) <> ALL(@skip::text[])")
	}
	if len(p) > 0 {
		sql = strings.ReplaceAll(sql, exporterMarkerP, strings.Join(p, " AND "))
	}
	if len(o) > 0 {
		sql = strings.ReplaceAll(sql, exporterMarker, strings.Join(o, " AND "))
	}
	if f.group {
		sql = groupMarker.ReplaceAllString(sql, "$1.bucket = ANY(@buckets::smallint[])")
		for _, a := range []string{"o", "p"} {
			sql = strings.ReplaceAll(sql, a+".first_attempt_at + @horizon::interval > statement_timestamp()",
				a+".first_attempt_at > statement_timestamp() - @horizon::interval")
		}
		sql = strings.Replace(sql, abandonedCTE, "", 1)
		sql = strings.Replace(sql, prevColumns, `,
       o.bucket, p.prev_state = 'leased', p.prev_token, p.prev_owner, p.prev_leased_at`, 1)
		sql = strings.Replace(sql, prevJoin, " JOIN picked p ON p.id = o.id", 1)
	}
	return sql
}

const claimable = `((o.state = 'pending' COLLATE "C" AND o.next_attempt_at <= statement_timestamp())
      OR (o.state = 'leased' COLLATE "C" AND o.lease_expires_at < statement_timestamp()))
    AND ` + withinBudget

// sqlClaimLease is the write half of the claim, shared by both policies:
// the picked rows (already locked FOR UPDATE SKIP LOCKED by the CTE
// "picked") are leased under a new token, consuming an attempt; a claim that
// takes over an expired lease records the abandoned attempt. Only the item's
// state row is written; its body — identity and payload, for the deliverer
// — is joined by primary key after the update. The UPDATE finds its rows by
// primary key from the picked ids (o.id = ANY(ARRAY(…))), and joins
// nothing: joined to "picked", the planner, whose statistics of a large
// table say almost nothing is pending, would compare every picked row with
// every pending or leased item, and the cached statement's generic plan
// every picked row with every other. It compares the state under collation
// "C", which no partial index's predicate uses, as the accept does: with
// "one pending row" in its statistics, the planner would read every pending
// and leased item through a BitmapOr of their partial indexes and filter
// them by id. The previous holder of a taken-over lease is read from
// "picked" for the few rows that had one. The first claim of an item sets
// first_attempt_at with least(), which ignores its NULL, not coalesce:
// Citus refuses a STABLE function inside COALESCE in an UPDATE. A claim
// of one shard group compares the horizon as first_attempt_at > now -
// horizon (claimFilter.apply), as Citus allows no STABLE operator on a
// column in an UPDATE; one server keeps first_attempt_at + horizon > now,
// whose estimate does not read first_attempt_at's statistics (mostly
// NULL: items never attempted) and so leaves the claims' plans as they
// are. The flags of the
// final SELECT are decided on the lease's leased_at, the statement's time
// the UPDATE wrote: a distributed statement's SELECT reads the clock of
// the node it runs on, its UPDATE the coordinator's.
var sqlClaimLease = `
claimed AS (
    UPDATE outbox_item_states o SET
        state            = 'leased',
        lease_token      = o.lease_token + 1,
        attempts         = o.attempts + 1,
        first_attempt_at = least(o.first_attempt_at, statement_timestamp()),
        lease_owner      = @owner,
        per_key_lease    = @per_key,
        leased_at        = statement_timestamp(),
        lease_expires_at = statement_timestamp() + @lease::interval,
        updated_at       = statement_timestamp()
    WHERE ` + inGroup("o") + ` AND o.id = ANY(ARRAY(SELECT id FROM picked)) AND ` + claimable + `
    RETURNING o.*
)` + abandonedCTE + `
SELECT ` + "%s" + `,
       to_timestamp((b.payload ->> 'timestamp')::bigint) NOT BETWEEN o.leased_at - @accept_past::interval
                                                          AND o.leased_at + @accept_future::interval
           AS timestamp_outside,
       coalesce(to_timestamp((b.payload ->> 'cancel_by')::bigint) < o.lease_expires_at, false) AS past_deadline` + prevColumns + `
FROM claimed o JOIN outbox_item_bodies b ON b.id = o.id AND b.bucket = o.bucket AND ` + inGroup("b") + prevJoin + `
ORDER BY o.id`

// abandonedCTE records the abandoned attempt of each lease the claim took
// over, inside the claim's statement on one server. A distributed claim
// leaves it out (an INSERT inside a statement is not one shard's) and
// returns the previous holders instead (prevColumns), whose attempts
// sqlClaimAbandoned writes in the claim's transaction.
const abandonedCTE = `,
abandoned AS (
    INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused, bucket)
    SELECT p.id, p.prev_token, p.prev_owner, p.prev_leased_at, 'abandoned', 'leased', false, c.bucket
    FROM picked p JOIN claimed c ON c.id = p.id WHERE p.prev_state = 'leased'
)`

// prevColumns and prevJoin stand in the claim's final SELECT for the
// previous holder of each lease, which only a distributed claim returns.
const (
	prevColumns = "/*prev columns*/"
	prevJoin    = "/*prev join*/"
)

// sqlClaimAbandoned writes the abandoned attempts of the leases a
// distributed claim took over, from the previous holders it returned.
const sqlClaimAbandoned = `
INSERT INTO outbox_attempts (item_id, lease_token, lease_owner, leased_at, outcome, state_after, refused, bucket)
SELECT a.id, a.token, a.owner, a.leased_at, 'abandoned', 'leased', false, a.bucket
FROM unnest(@ids::bigint[], @tokens::bigint[], @owners::text[], @leased_ats::timestamptz[], @abandoned_buckets::smallint[])
    AS a(id, token, owner, leased_at, bucket)`

// sqlClaimBestEffort is the claim under BestEffort: the oldest expired
// leases, then the oldest due pending items.
var sqlClaimBestEffort = fmt.Sprintf(`
WITH picked AS (
    SELECT id, state AS prev_state, lease_token AS prev_token, lease_owner AS prev_owner, leased_at AS prev_leased_at
    FROM (
        SELECT * FROM (
            SELECT o.id, o.state, o.lease_token, o.lease_owner, o.leased_at FROM outbox_item_states o
            WHERE `+inGroup("o")+` AND `+leaseExpired+` AND `+withinBudget+`
            ORDER BY o.lease_expires_at, o.id LIMIT @limit FOR UPDATE SKIP LOCKED) expired
        UNION ALL
        SELECT * FROM (
            SELECT o.id, o.state, o.lease_token, o.lease_owner, o.leased_at FROM outbox_item_states o
            WHERE `+inGroup("o")+` AND `+pendingDue+` AND `+withinBudget+`
            ORDER BY o.next_attempt_at, o.id LIMIT @limit FOR UPDATE SKIP LOCKED) due
        LIMIT @limit
    ) c
),`+sqlClaimLease, splitColumns("b", "o"))

// keyHeld is the condition on l, an item of outbox_item_states, that
// makes a key unavailable to a PerKey claim of the item id of that key:
// another item of the key holds an unexpired lease, or a PerKey lease,
// expired or not (a unique index admits one per key; an
// expired one is taken over as the key's first item, or, past the budget,
// settled by the maintenance sweep). The NOT EXISTS that tests it ends in
// OFFSET 0, which keeps it a probe of the key per candidate rather than an
// anti join (sqlClaimPerKeyOne).
func keyHeld(key, id string) string {
	return `l.state = 'leased' AND l.ordering_key = ` + key + ` AND l.id <> ` + id + ` AND ` + inGroup("l") + `
                      AND (l.lease_expires_at >= statement_timestamp() OR l.per_key_lease)`
}

// sqlClaimKeys is the first statement of a PerKey claim. It finds the
// oldest claimable items, and for each key among them its first item (an
// expired lease before a due item, the oldest first), keeps the keys that
// hold no unexpired lease ("cand", oldest first), try-locks them in that
// order for this transaction until it holds @lockmax, and returns the
// candidate keys, the items of the keys it locked, and whether the scan of
// due pending items was cut off by its limit. Then a hot key, leased or
// not, may hide the others in the scan, and sqlClaimKeysLoose looks
// further. Choosing and locking the keys in one statement saves a round
// trip of every PerKey claim; the lease itself (sqlClaimPerKey) must stay
// a statement of its own, whose snapshot is taken after the locks.
var sqlClaimKeys = `
WITH expired AS MATERIALIZED (
    SELECT o.id, o.ordering_key, o.lease_expires_at AS due_at, 0 AS pass FROM outbox_item_states o
    WHERE ` + inGroup("o") + ` AND ` + leaseExpired + ` AND ` + withinBudget + ` AND o.ordering_key <> ALL(@tried::text[])
    ORDER BY o.lease_expires_at, o.id LIMIT @scan
),
due AS MATERIALIZED (
    SELECT o.id, o.ordering_key, o.next_attempt_at AS due_at, 1 AS pass FROM outbox_item_states o
    WHERE ` + inGroup("o") + ` AND ` + pendingDue + ` AND ` + withinBudget + ` AND o.ordering_key <> ALL(@tried::text[])
    ORDER BY o.next_attempt_at, o.id LIMIT @scan
),
firsts AS MATERIALIZED (
    SELECT DISTINCT ON (c.ordering_key) c.ordering_key, c.id, c.due_at
    FROM (SELECT * FROM expired UNION ALL SELECT * FROM due) c
    ORDER BY c.ordering_key, c.pass, c.due_at, c.id
),
cand AS MATERIALIZED (
    SELECT f.ordering_key, f.id FROM firsts f
    WHERE NOT EXISTS (SELECT 1 FROM outbox_item_states l WHERE ` + keyHeld("f.ordering_key", "f.id") + ` OFFSET 0)
    ORDER BY f.due_at, f.ordering_key
),
locked AS MATERIALIZED (
    SELECT k.id FROM cand k
    WHERE pg_try_advisory_xact_lock(@space::int4, hashtext(k.ordering_key))
    LIMIT @lockmax
)
SELECT ARRAY(SELECT ordering_key FROM cand), ARRAY(SELECT id FROM locked),
       (SELECT count(*) FROM due) >= @scan`

// sqlClaimKeysLoose finds the keys of due pending items, and the oldest due
// item of each, by a loose index scan over the distinct keys (one index
// probe per key with pending items, not one per item), for when the oldest
// due items all belong to a few hot keys that already hold leases or fill
// the batch: no key can crowd out the rest.
var sqlClaimKeysLoose = `
WITH RECURSIVE keys(ordering_key) AS (
    (SELECT o.ordering_key FROM outbox_item_states o WHERE ` + inGroup("o") + ` AND o.state = 'pending' ORDER BY o.ordering_key LIMIT 1)
    UNION ALL
    SELECT (SELECT o.ordering_key FROM outbox_item_states o
            WHERE ` + inGroup("o") + ` AND o.state = 'pending' AND o.ordering_key > k.ordering_key
            ORDER BY o.ordering_key LIMIT 1)
    FROM keys k WHERE k.ordering_key IS NOT NULL
)
SELECT k.ordering_key, h.id FROM keys k
CROSS JOIN LATERAL (
    SELECT o.id, o.next_attempt_at AS due_at FROM outbox_item_states o
    WHERE ` + inGroup("o") + ` AND o.ordering_key = k.ordering_key AND ` + pendingDue + ` AND ` + withinBudget + `
    ORDER BY o.next_attempt_at, o.id LIMIT 1
) h
WHERE k.ordering_key IS NOT NULL AND k.ordering_key <> ALL(@tried::text[])
  AND NOT EXISTS (SELECT 1 FROM outbox_item_states l WHERE ` + keyHeld("k.ordering_key", "h.id") + ` OFFSET 0)
ORDER BY h.due_at, k.ordering_key
LIMIT @scan`

// sqlClaimLockKeys try-locks the candidate keys in order, for this transaction,
// until it holds @lockmax of them, so that concurrent PerKey claimers never
// work on one key at once and never wait for each other. The locks are
// released when the claim commits. It takes up to twice the keys it needs:
// a key whose last holder committed since the candidates were read may turn
// out to hold a lease. sqlClaimKeys does the same for the keys it finds;
// this statement locks those of the loose scan.
const sqlClaimLockKeys = `
SELECT k FROM unnest(@keys::text[]) AS k
WHERE pg_try_advisory_xact_lock(@space::int4, hashtext(k))
LIMIT @lockmax`

// sqlClaimLockGroupKeys is sqlClaimLockKeys for a claim of one shard
// group: it locks the keys through the loose scan's items (@ids) in the
// group's shard, so that the locks are taken on the node that holds the
// shard, where sqlClaimKeys takes its own, not on the coordinator. The keys
// are locked in the order the shard reads the items.
const sqlClaimLockGroupKeys = `
SELECT o.ordering_key FROM outbox_item_states o
WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = ANY(@ids::bigint[])
  AND o.ordering_key = ANY(@keys::text[])
  AND pg_try_advisory_xact_lock(@space::int4, hashtext(o.ordering_key))
LIMIT @lockmax`

// sqlClaimPerKey is the second statement of a PerKey claim: of the items
// step 1 chose for the keys this transaction holds, in their order, each
// one that is still claimable while its key holds no unexpired lease. It
// runs as its own statement so that its snapshot, taken after the key
// locks, sees every claim committed before: a claimer that leased an item
// of the key and committed between step 1's snapshot and the lock makes
// NOT EXISTS false here. Taking the items by primary key, rather than
// looking for each key's oldest again, costs one index probe an item
// instead of three.
var sqlClaimPerKey = fmt.Sprintf(`
WITH picked AS (
    SELECT o.id, o.state AS prev_state, o.lease_token AS prev_token, o.lease_owner AS prev_owner,
           o.leased_at AS prev_leased_at
    FROM unnest(@ids::bigint[]) WITH ORDINALITY AS k(id, n)
    JOIN outbox_item_states o ON o.id = k.id
    WHERE `+inGroup("o")+` AND ((`+leaseExpired+`) OR (`+pendingDue+`)) AND `+withinBudget+`
      AND NOT EXISTS (SELECT 1 FROM outbox_item_states l WHERE `+keyHeld("o.ordering_key", "o.id")+` OFFSET 0)
    ORDER BY k.n
    LIMIT @limit
    FOR UPDATE OF o SKIP LOCKED
),`+sqlClaimLease, splitColumns("b", "o"))

// sqlClaimPerKeyOne is a PerKey claim in one statement, the first try of
// every PerKey claim, shaped like BestEffort's: the oldest expired leases,
// then the oldest due pending items, locked FOR UPDATE SKIP LOCKED, of
// which it takes only each key's first — an expired lease whose key no
// other item holds (a live lease, a PerKey lease, or an expired lease
// older than it), and a due item whose key holds no lease at all and has
// no pending item before it (within the budget and for the same
// exporter). No sort, no advisory lock: concurrent claimers skip each
// other's locked rows and, as their snapshots see an earlier pending item
// of the key, never pick a later one. A claimer whose snapshot missed a
// key's lease committed by another may still pick an item of that key, and
// its lease then fails on the per-key unique index (a unique violation:
// the claim is retried). The expired leases and the due items are each
// locked in a subquery, at most @scan of them, and tested after (the
// expired ones come from the range scan of the leased_expiry index, not by
// reading the leased_key index whole): tested first, each row a concurrent
// claimer holds would be probed twice before it was skipped; a key's later
// items locked and dropped stay locked only until this claim commits. The
// probes (a key's leases, its earlier pending items) and the unique index's
// entry are what a PerKey claim pays beyond BestEffort's. Each NOT EXISTS
// ends in OFFSET 0, which keeps it a probe of the key's index entries per
// candidate: without it the planner turns it into an anti join, and a
// cached generic plan, which expects one leased item, compares every
// candidate with every leased item, or every earlier pending item with
// every candidate.
var sqlClaimPerKeyOne = fmt.Sprintf(`
WITH picked AS (
    SELECT id, state AS prev_state, lease_token AS prev_token, lease_owner AS prev_owner, leased_at AS prev_leased_at
    FROM (
        SELECT o.id, o.state, o.lease_token, o.lease_owner, o.leased_at FROM (
            SELECT o.id, o.state, o.lease_token, o.lease_owner, o.leased_at, o.ordering_key, o.lease_expires_at
            FROM outbox_item_states o
            WHERE `+inGroup("o")+` AND `+leaseExpired+` AND `+withinBudget+`
            ORDER BY o.lease_expires_at, o.id LIMIT @scan FOR UPDATE SKIP LOCKED) o
        WHERE NOT EXISTS (SELECT 1 FROM outbox_item_states l WHERE l.state = 'leased' AND l.ordering_key = o.ordering_key
                          AND `+inGroup("l")+` AND l.id <> o.id AND (l.lease_expires_at >= statement_timestamp() OR l.per_key_lease
                                                OR (l.lease_expires_at, l.id) < (o.lease_expires_at, o.id)) OFFSET 0)
        UNION ALL
        SELECT o.id, o.state, o.lease_token, o.lease_owner, o.leased_at FROM (
            SELECT o.id, o.state, o.lease_token, o.lease_owner, o.leased_at, o.ordering_key, o.next_attempt_at
            FROM outbox_item_states o
            WHERE `+inGroup("o")+` AND `+pendingDue+` AND `+withinBudget+`
            ORDER BY o.next_attempt_at, o.id LIMIT @scan FOR UPDATE SKIP LOCKED) o
        WHERE NOT EXISTS (SELECT 1 FROM outbox_item_states l WHERE l.state = 'leased' AND l.ordering_key = o.ordering_key
                          AND `+inGroup("l")+` OFFSET 0)
          AND NOT EXISTS (SELECT 1 FROM outbox_item_states p WHERE p.state = 'pending' AND p.ordering_key = o.ordering_key
                          AND `+inGroup("p")+` AND (p.next_attempt_at, p.id) < (o.next_attempt_at, o.id)
                          AND `+earlierInBudget+` OFFSET 0)
        LIMIT @limit
    ) c
),`+sqlClaimLease, splitColumns("b", "o"))

// Claim is the claim transition: it claims up to opts.Limit items in one READ
// COMMITTED transaction of its own, committed before it returns (under
// BestEffort sent in one round trip, claimTrip), and returns their leases.
// Each claimed item's lease_token and attempts are incremented, its
// first_attempt_at set if this is its first claim, and its lease_expires_at
// set from the database clock. An empty result is not an error: nothing was
// due, or somebody else holds it. On a distributed database the claim is
// one such transaction per shard group it reads (claimGroups).
func (s *Store) Claim(ctx context.Context, db pgdb.DB, opts ClaimOptions) ([]Lease, error) {
	ctx, span := batchSpan(ctx, "claim", TransitionClaim)
	leases, err := s.claim(ctx, db, opts)
	endBatch(span, len(leases), err)
	return leases, err
}

func (s *Store) claim(ctx context.Context, db pgdb.DB, opts ClaimOptions) ([]Lease, error) {
	if err := refuseOpenTx(db); err != nil {
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	if opts.Owner == "" {
		return nil, errors.New("outbox: claim needs an owner")
	}
	if opts.Limit < 1 || opts.Limit > MaxClaim {
		return nil, fmt.Errorf("outbox: claim limit %d is outside 1..%d", opts.Limit, MaxClaim)
	}
	lease := s.cfg.Lease
	if opts.Lease > 0 {
		lease = opts.Lease
	}
	if opts.Lease < 0 || s.cfg.Horizon+lease >= s.cfg.DedupWindow {
		return nil, fmt.Errorf("outbox: claim lease %s is negative or reaches past the provider's dedup window with the horizon", opts.Lease)
	}
	unbounded := func(d time.Duration) time.Duration {
		if d <= 0 {
			return 100 * 365 * 24 * time.Hour
		}
		return d
	}
	args := pgx.NamedArgs{
		"owner":         opts.Owner,
		"limit":         opts.Limit,
		"lease":         lease,
		"max":           s.cfg.MaxAttempts,
		"horizon":       s.cfg.Horizon,
		"accept_past":   unbounded(opts.AcceptPast),
		"accept_future": unbounded(opts.AcceptFuture),
	}
	if opts.Exporter != "" && !exporterName.MatchString(opts.Exporter) {
		return nil, fmt.Errorf("outbox: claim: %q is not an exporter name", opts.Exporter)
	}
	filtered := claimFilter{exporter: opts.Exporter, skip: len(opts.SkipAccounts)+len(opts.SkipMeters) > 0}
	if filtered.skip {
		args["skip"] = slices.Concat(opts.SkipAccounts, opts.SkipMeters)
	}

	if opts.Policy != BestEffort && opts.Policy != PerKey {
		return nil, fmt.Errorf("outbox: unknown claim policy %v", opts.Policy)
	}
	shards, err := s.Shards(ctx, db)
	if err != nil {
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	if !shards.Distributed() {
		return s.claimGroup(ctx, db, opts.Policy, args, opts.Limit, filtered)
	}
	leases, err := s.claimGroups(ctx, db, shards, opts, args, filtered)
	if spansShards(err) {
		// The shards were split since the placement was read: the claim
		// runs again over the groups read now.
		if shards, err = s.Shards(ctx, db); err != nil {
			return nil, fmt.Errorf("outbox: claim: %w", err)
		}
		leases, err = s.claimGroups(ctx, db, shards, opts, args, filtered)
	}
	return leases, err
}

// claimGroups is a claim on a distributed database: it runs over one shard
// group at a time, each run a transaction of one shard, until it has Limit
// items or has tried every group. The group it starts with turns with
// every claim, so that a group whose items fill every claim does not keep
// the others' waiting; a group found empty is passed over for opts.Quiet
// (quietGroups). A run refused as spanning shards makes the Store
// read the placement again.
func (s *Store) claimGroups(ctx context.Context, db pgdb.DB, shards *tenantbucket.Shards, opts ClaimOptions, args pgx.NamedArgs, filtered claimFilter) ([]Lease, error) {
	filtered.group = true
	groups := shards.Groups()
	first := int(claimTurn.Add(1) % uint64(groups))
	if opts.Quiet > 0 {
		s.probeQuiet(ctx, db, shards, opts, args, filtered)
	}
	var leases []Lease
	for i := 0; i < groups && len(leases) < opts.Limit; i++ {
		g := (first + i) % groups
		if opts.Quiet > 0 && s.quiet.quiet(shards, opts.Exporter, g) {
			continue
		}
		args["buckets"] = shards.Buckets(g)
		got, err := s.claimGroup(ctx, db, opts.Policy, args, opts.Limit-len(leases), filtered)
		leases = append(leases, got...)
		if err == nil && len(got) == 0 {
			s.quiet.hush(shards, opts.Exporter, g, opts.Quiet)
		}
		if err != nil {
			if spansShards(err) {
				s.ForgetShards()
			}
			if len(leases) > 0 {
				// What is leased is committed and must reach the
				// deliverer; the next claim meets the error again if it
				// persists.
				return leases, nil
			}
			return nil, err
		}
	}
	return leases, nil
}

// sqlClaimProbe finds which of the buckets of shard groups whose quiet
// has lapsed hold an item a claim would take: one read of their shards,
// without locks, in place of a claim transaction per group. It is the
// claim path's one statement over many shards; it runs at most once per
// ClaimOptions.Quiet per exporter and process, and reads the due items of
// groups that had none a moment ago.
var sqlClaimProbe = `
SELECT DISTINCT o.bucket FROM outbox_item_states o
WHERE ` + inGroup("o") + ` AND ((` + pendingDue + `) OR (` + leaseExpired + `)) AND ` + withinBudget

// probeQuiet asks sqlClaimProbe about the groups whose quiet has lapsed:
// those with an item due are claimed from again, the others stay quiet
// for another opts.Quiet. If the probe fails (a worker is down), every
// lapsed group is claimed from, each by its own statements, so that the
// groups of the workers that answer are not kept waiting.
func (s *Store) probeQuiet(ctx context.Context, db pgdb.DB, shards *tenantbucket.Shards, opts ClaimOptions, args pgx.NamedArgs, filtered claimFilter) {
	lapsed := s.quiet.lapsed(shards, opts.Exporter, opts.Quiet)
	if len(lapsed) == 0 {
		return
	}
	var buckets []int16
	for _, g := range lapsed {
		buckets = append(buckets, shards.Buckets(g)...)
	}
	probe := pgx.NamedArgs{"buckets": buckets, "max": args["max"], "horizon": args["horizon"]}
	if filtered.skip {
		probe["skip"] = args["skip"]
	}
	due, err := tenantbucket.ReadAcross(ctx, db, filtered.apply(sqlClaimProbe), probe)
	loud := make(map[int]bool, len(due))
	for _, b := range due {
		loud[shards.GroupOf(b)] = true
	}
	for _, g := range lapsed {
		if loud[g] || err != nil {
			s.quiet.wake(shards, opts.Exporter, g)
		} else {
			s.quiet.hush(shards, opts.Exporter, g, opts.Quiet)
		}
	}
}

// claimTurn turns the group a distributed claim starts with.
var claimTurn atomic.Uint64

// spansShards reports whether err is Citus refusing a claim statement whose
// bucket list is no longer one shard's (the shards were split): the
// placement must be read again. Every group's claim starts with a
// statement that locks its picks FOR UPDATE, which is how Citus refuses it.
func spansShards(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "0A000" &&
		strings.HasPrefix(pgErr.Message, "could not run distributed query with FOR UPDATE/SHARE commands")
}

// claimGroup claims up to limit items under policy: on one server every
// item, on a distributed database those of the buckets of args' group.
func (s *Store) claimGroup(ctx context.Context, db pgdb.DB, policy Policy, args pgx.NamedArgs, limit int, filtered claimFilter) ([]Lease, error) {
	if policy == BestEffort {
		args["per_key"], args["limit"] = false, limit
		leases, err := claimStatement(ctx, db, filtered.apply(sqlClaimBestEffort), args, filtered)
		if err != nil {
			return nil, fmt.Errorf("outbox: claim: %w", err)
		}
		s.claimed(leases)
		return leases, nil
	}
	args["per_key"] = true
	leases, err := s.claimPerKeyOne(ctx, db, args, limit, filtered)
	if err != nil {
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	s.claimed(leases)
	if len(leases) == limit {
		return leases, nil
	}
	// Short: nothing more is due, or the oldest due items belong to keys
	// held by others, or concurrent claimers took the keys this one
	// picked. The statements of claimPerKey look further (over keys not
	// tried, and by the loose scan past hot keys), in a transaction of
	// their own; the leases above are committed, and their keys held.
	// Their keys are left out: a lease of try 1 that expired meanwhile (a
	// short lease on a slow machine) would otherwise be taken over here,
	// and the claim return two leases of one item.
	held := make([]string, len(leases))
	for i, l := range leases {
		held[i] = l.OrderingKey
	}
	more, err := s.claimPerKeyRounds(ctx, db, args, limit-len(leases), held, filtered)
	if err != nil {
		if len(leases) > 0 {
			// What is leased is committed and must reach the deliverer;
			// the next claim meets the error again if it persists.
			return leases, nil
		}
		return nil, fmt.Errorf("outbox: claim: %w", err)
	}
	s.claimed(more)
	return append(leases, more...), nil
}

// claimed counts claimed items.
func (s *Store) claimed(leases []Lease) {
	for range leases {
		s.metrics.moved(TransitionClaim, StateLeased)
	}
}

// keyConflicts bounds how often claimPerKeyOne retries after losing a key
// to a concurrent claimer (a unique violation of the per-key index).
const keyConflicts = 3

// isKeyConflict reports whether err is a PerKey lease refused by the per-key
// unique index: another claimer leased an item of the key first.
func isKeyConflict(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" {
		return false
	}
	// A shard's index is named after the table's, with the shard's id.
	name, shard, _ := strings.Cut(pgErr.ConstraintName, "outbox_item_states_per_key_lease")
	return name == "" && (shard == "" || strings.Trim(shard, "_0123456789") == "")
}

// claimPerKeyOne runs sqlClaimPerKeyOne as a transaction in one round trip
// (claimTrip). A key conflict leases nothing; it is counted as the claim's
// stale write (somebody else has it) and the statement runs again with a new
// snapshot, at most keyConflicts times, after which the claim gets nothing
// here and claimPerKeyRounds looks for itself.
func (s *Store) claimPerKeyOne(ctx context.Context, db pgdb.DB, args pgx.NamedArgs, limit int, filtered claimFilter) ([]Lease, error) {
	args["limit"], args["scan"] = limit, limit*s.cfg.ClaimScan
	sql := filtered.apply(sqlClaimPerKeyOne)
	for range keyConflicts {
		leases, err := claimStatement(ctx, db, sql, args, filtered)
		if !isKeyConflict(err) {
			return leases, err
		}
		s.metrics.staleWrites(TransitionClaim, 1)
	}
	return nil, nil
}

// claimPerKeyRounds claims up to limit items with claimPerKey's statements
// in a READ COMMITTED transaction of its own. A key conflict there (a
// claimPerKeyOne of another claimer took a key this one locked, in the
// window before its snapshot) ends it with nothing: the claim's "somebody
// else has it", not an error.
func (s *Store) claimPerKeyRounds(ctx context.Context, db pgdb.DB, args pgx.NamedArgs, limit int, held []string, filtered claimFilter) ([]Lease, error) {
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	leases, err := s.claimPerKey(ctx, tx, args, limit, held, filtered)
	if isKeyConflict(err) {
		s.metrics.staleWrites(TransitionClaim, 1)
		return nil, nil
	}
	if err != nil || len(leases) == 0 {
		return nil, err
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("committing: %w", err)
	}
	return leases, nil
}

// claimTrip runs a BestEffort claim, one statement, as a READ COMMITTED
// transaction sent in one round trip: BEGIN ISOLATION LEVEL READ
// COMMITTED, the statement and COMMIT queued in one pipeline, not three
// round trips. The leases count only once COMMIT has answered: if the
// statement fails, the server skips the rest, COMMIT included, and the
// transaction is rolled back here on a connection, or by the pool, which
// never reuses a connection left inside a transaction. A PerKey claim
// stays a transaction of statements sent one by one: a PerKey claim this
// fast would make the v1 deliverer claim smaller batches, and move fewer
// items.
func claimTrip(ctx context.Context, db pgdb.DB, sql string, args pgx.NamedArgs) (leases []Lease, err error) {
	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	b.Queue(sql, args)
	b.Queue("COMMIT")
	br := db.SendBatch(ctx, b)
	leases, err = readClaimTrip(br)
	if cerr := br.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		rollbackLeftOpen(db)
		return nil, err
	}
	if len(leases) == 0 {
		return nil, nil
	}
	return leases, nil
}

// readClaimTrip reads the answers of claimTrip's pipeline in order.
func readClaimTrip(br pgx.BatchResults) ([]Lease, error) {
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("beginning: %w", err)
	}
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	leases, err := scanLeases(rows)
	if err != nil {
		return nil, err
	}
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("committing: %w", err)
	}
	return leases, nil
}

// errOpenTx is refuseOpenTx's answer.
var errOpenTx = errors.New("the connection is inside a transaction: Claim and Record run transactions of their own, which would commit the caller's (pass a pool or an idle connection)")

// refuseOpenTx refuses a connection (*pgx.Conn) that is inside a
// transaction: the BEGIN of a claim or a batch of outcomes would only draw
// a warning from the server, and its COMMIT would commit the caller's
// transaction, with whatever the caller meant to roll back. A pool hands
// out idle connections only.
func refuseOpenTx(db pgdb.DB) error {
	c, ok := db.(interface{ PgConn() *pgconn.PgConn })
	if ok && !c.PgConn().IsClosed() && c.PgConn().TxStatus() != 'I' {
		return errOpenTx
	}
	return nil
}

// rollbackLeftOpen ends the transaction a failed claimTrip left open on a
// connection (*pgx.Conn). A pool's connection is closed on release instead
// when it is inside a transaction, so a pool needs nothing here.
func rollbackLeftOpen(db pgdb.DB) {
	c, ok := db.(interface{ PgConn() *pgconn.PgConn })
	if !ok || c.PgConn().IsClosed() || c.PgConn().TxStatus() == 'I' {
		return
	}
	// The claim's context may be what ended it: the rollback gets a short
	// one of its own.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = db.Exec(ctx, "ROLLBACK")
}

// claimStatement runs a claim statement as a READ COMMITTED transaction of
// its own: on one server in one round trip (claimTrip); a shard group's
// claim in a transaction that writes the abandoned attempts of the leases
// it took over after the statement (collectLeases).
func claimStatement(ctx context.Context, db pgdb.DB, sql string, args pgx.NamedArgs, filtered claimFilter) ([]Lease, error) {
	if !filtered.group {
		return claimTrip(ctx, db, sql, args)
	}
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return nil, fmt.Errorf("beginning: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	leases, err := collectLeases(ctx, tx, sql, args, filtered)
	if err != nil || len(leases) == 0 {
		return nil, err
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("committing: %w", err)
	}
	return leases, nil
}

// collectLeases runs a claim statement and collects its leases. A shard
// group's claim returns the previous holders of the leases it took over,
// and their abandoned attempts are written here, in the claim's
// transaction.
func collectLeases(ctx context.Context, tx pgx.Tx, sql string, args pgx.NamedArgs, filtered claimFilter) ([]Lease, error) {
	rows, err := tx.Query(ctx, sql, args)
	if err != nil {
		return nil, err
	}
	if !filtered.group {
		return scanLeases(rows)
	}
	var ab struct {
		ids, tokens []int64
		owners      []string
		leasedAt    []time.Time
		buckets     []int16
	}
	leases, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Lease, error) {
		var (
			l         Lease
			bucket    int16
			takenOver bool
			token     *int64
			owner     *string
			leasedAt  *time.Time
		)
		it, err := scanItem(rowWithExtra{row, []any{&l.TimestampOutside, &l.PastDeadline, &bucket, &takenOver, &token, &owner, &leasedAt}})
		l.Item = it
		if err == nil && takenOver {
			if token == nil || owner == nil || leasedAt == nil {
				return l, fmt.Errorf("the lease of item %d taken over has no holder", it.ID)
			}
			ab.ids, ab.tokens, ab.owners = append(ab.ids, it.ID), append(ab.tokens, *token), append(ab.owners, *owner)
			ab.leasedAt, ab.buckets = append(ab.leasedAt, *leasedAt), append(ab.buckets, bucket)
		}
		return l, err
	})
	if err != nil || len(ab.ids) == 0 {
		return leases, err
	}
	_, err = tx.Exec(ctx, sqlClaimAbandoned, pgx.NamedArgs{
		"ids": ab.ids, "tokens": ab.tokens, "owners": ab.owners, "leased_ats": ab.leasedAt, "abandoned_buckets": ab.buckets,
	})
	if err != nil {
		return nil, fmt.Errorf("recording the abandoned attempts: %w", err)
	}
	return leases, nil
}

// scanLeases collects the leases a claim statement returns.
func scanLeases(rows pgx.Rows) ([]Lease, error) {
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Lease, error) {
		var l Lease
		it, err := scanItem(rowWithExtra{row, []any{&l.TimestampOutside, &l.PastDeadline}})
		l.Item = it
		return l, err
	})
}

// perKeyRounds bounds how often one PerKey claim reads candidates again
// after losing keys to concurrent claimers.
const perKeyRounds = 3

// claimPerKey claims up to limit items, one per key, in rounds: choose
// candidate keys and an item of each, try-lock some keys, lease the items of
// the locked keys that hold no live lease. A round that comes up short (its
// keys were taken by concurrent claimers that committed meanwhile) is
// followed by another over keys not yet tried, so contention does not make a
// claim return empty while work is due. Keys in held (leased by this claim
// already, in claimPerKeyOne) count as tried from the start.
func (s *Store) claimPerKey(ctx context.Context, tx pgx.Tx, args pgx.NamedArgs, limit int, held []string, filtered claimFilter) ([]Lease, error) {
	var (
		leases []Lease
		tried  = append([]string{}, held...)
	)
	args["space"] = perKeyLockSpace
	for round := 0; round < perKeyRounds && len(leases) < limit; round++ {
		want := limit - len(leases)
		args["limit"], args["lockmax"], args["scan"], args["tried"] = want, 2*want, want*s.cfg.ClaimScan, tried
		cand, ids, err := s.lockKeys(ctx, tx, args, want, filtered)
		if err != nil {
			return nil, fmt.Errorf("choosing keys: %w", err)
		}
		if len(cand) == 0 {
			break
		}
		tried = append(tried, cand...)
		if len(ids) == 0 {
			continue
		}
		args["ids"] = ids
		got, err := collectLeases(ctx, tx, filtered.apply(sqlClaimPerKey), args, filtered)
		if err != nil {
			return nil, err
		}
		leases = append(leases, got...)
	}
	return leases, nil
}

// lockKeys returns the keys a PerKey round may try (cand), oldest first,
// and the chosen items of those it locked for this transaction, at most
// args' lockmax: from the scan of the oldest claimable items
// (sqlClaimKeys, which locks as it finds), and, when that scan was cut off
// before it found want keys, from the loose scan over all keys
// (sqlClaimKeysLoose, then sqlClaimLockKeys for the rest of lockmax).
func (s *Store) lockKeys(ctx context.Context, tx pgx.Tx, args pgx.NamedArgs, want int, filtered claimFilter) (cand []string, ids []int64, err error) {
	var saturated bool
	if err := tx.QueryRow(ctx, filtered.apply(sqlClaimKeys), args).Scan(&cand, &ids, &saturated); err != nil {
		return nil, nil, err
	}
	if !saturated || len(cand) >= want {
		return cand, ids, nil
	}
	rows, err := tx.Query(ctx, filtered.apply(sqlClaimKeysLoose), args)
	if err != nil {
		return nil, nil, err
	}
	type keyItem struct {
		Key string
		ID  int64
	}
	more, err := pgx.CollectRows(rows, pgx.RowToStructByPos[keyItem])
	if err != nil {
		return nil, nil, err
	}
	seen := make(map[string]bool, len(cand))
	for _, k := range cand {
		seen[k] = true
	}
	var extra []string
	itemOf := make(map[string]int64, len(more))
	for _, m := range more {
		if !seen[m.Key] {
			extra = append(extra, m.Key)
			itemOf[m.Key] = m.ID
		}
	}
	cand = append(cand, extra...)
	room := args["lockmax"].(int) - len(ids)
	if len(extra) == 0 || room <= 0 {
		return cand, ids, nil
	}
	lockArgs := pgx.NamedArgs{"keys": extra, "space": args["space"], "lockmax": room}
	lockSQL := sqlClaimLockKeys
	if filtered.group {
		lockSQL = sqlClaimLockGroupKeys
		lockIDs := make([]int64, len(extra))
		for i, k := range extra {
			lockIDs[i] = itemOf[k]
		}
		lockArgs["ids"], lockArgs["buckets"] = lockIDs, args["buckets"]
	}
	rows, err = tx.Query(ctx, lockSQL, lockArgs)
	if err != nil {
		return nil, nil, fmt.Errorf("locking keys: %w", err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, nil, fmt.Errorf("locking keys: %w", err)
	}
	for _, k := range got {
		ids = append(ids, itemOf[k])
	}
	return cand, ids, nil
}

// rowWithExtra scans an item's columns followed by more values.
type rowWithExtra struct {
	row   pgx.Row
	extra []any
}

func (r rowWithExtra) Scan(dest ...any) error { return r.row.Scan(append(dest, r.extra...)...) }
