package outbox

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// Parking. A claim that skips keys (ClaimOptions.SkipAccounts,
// SkipMeters) reads the index of due pending items in its order and
// filters the skipped ones out: left due, a stalled account's or a paused
// event name's backlog sits at the head of that index, and every claim on
// every node would read past all of it. Park moves the due pending items
// of skipped keys a little into the future — no state changes, no attempt
// is spent — so that claims find the other keys' items first; while the
// keys stay skipped, their deliverer parks them again. Unpark makes a
// key's parked items due at once when it is skipped no longer. Both find
// the items through the index of pending items by key (pending_key): a
// skipped account's range of ordering keys, one account's event name
// filtered within it.

// skipRange is the condition on p, an item of outbox_item_states, that it
// belongs to a skip key k (an account, or "account|event name": see
// MeterSkipKey): its ordering key's first part is the account, and for an
// event name its last part the name. The range of ordering keys ("|" is
// 0x7C, "}" the byte after it) lets the index of pending items by key
// serve it; it is exact under the C collation, and under another one the
// equalities still decide (parking only spares claims a read, so a range
// that finds fewer rows costs time, never correctness).
const skipRange = `p.ordering_key >= split_part(k.key, '|', 1) || '|'
      AND p.ordering_key < split_part(k.key, '|', 1) || '}'
      AND split_part(p.ordering_key, '|', 1) = split_part(k.key, '|', 1)
      AND (strpos(k.key, '|') = 0 OR split_part(p.ordering_key, '|', 3) = split_part(k.key, '|', 2))`

// sqlPark moves the due pending items of @exporter of the skip keys @keys
// to @for from now, at most @limit of them, skipping locked rows.
const sqlPark = `
UPDATE outbox_item_states o SET next_attempt_at = statement_timestamp() + @for::interval, updated_at = statement_timestamp()
WHERE ` + parkBucketsO + `o.id IN (
    SELECT p.id FROM unnest(@keys::text[]) AS k(key)
    JOIN LATERAL (
        SELECT p.id FROM outbox_item_states p
        WHERE ` + parkBucketsP + `p.state = 'pending' AND ` + skipRange + `
          AND p.exporter = @exporter AND p.next_attempt_at <= statement_timestamp()
        LIMIT @limit FOR UPDATE SKIP LOCKED
    ) p ON true
    LIMIT @limit)
  AND o.state = 'pending' AND o.next_attempt_at <= statement_timestamp()`

// sqlUnpark makes the parked pending items of @exporter of the skip keys
// @keys due now: those due within @for (a park's reach), which were parked
// or would be due before long anyway.
const sqlUnpark = `
UPDATE outbox_item_states o SET next_attempt_at = statement_timestamp(), updated_at = statement_timestamp()
WHERE ` + parkBucketsO + `o.id IN (
    SELECT p.id FROM unnest(@keys::text[]) AS k(key)
    JOIN LATERAL (
        SELECT p.id FROM outbox_item_states p
        WHERE ` + parkBucketsP + `p.state = 'pending' AND ` + skipRange + `
          AND p.exporter = @exporter AND p.next_attempt_at > statement_timestamp()
          AND p.next_attempt_at <= statement_timestamp() + @for::interval
        FOR UPDATE SKIP LOCKED
    ) p ON true)
  AND o.state = 'pending'`

// The bucket predicates of park and unpark: on Citus each runs once per
// shard group, every reference to the states with the group's buckets; on
// one server once, without them (parkSQL).
const (
	parkBucketsO = `o.bucket = ANY(@buckets::smallint[]) AND `
	parkBucketsP = `p.bucket = ANY(@buckets::smallint[]) AND `
)

// parkSQL is sql (sqlPark or sqlUnpark) as it runs on shards.
func parkSQL(shards *tenantbucket.Shards, sql string) string {
	if shards.Distributed() {
		return sql
	}
	return strings.ReplaceAll(strings.ReplaceAll(sql, parkBucketsO, ""), parkBucketsP, "")
}

// parkGroups runs sql, park's or unpark's, once per shard group with args
// and the group's buckets, and adds up the rows it moved.
func (s *Store) parkGroups(ctx context.Context, q pgdb.Querier, sql string, args pgx.NamedArgs) (int64, error) {
	shards, err := s.Shards(ctx, q)
	if err != nil {
		return 0, err
	}
	sql = parkSQL(shards, sql)
	var n int64
	for g := range shards.Groups() {
		args["buckets"] = shards.Buckets(g)
		tag, err := q.Exec(ctx, sql, args)
		if err != nil {
			return n, err
		}
		n += tag.RowsAffected()
	}
	return n, nil
}

// ParkLimit is the most items one Park moves in a shard group (on one
// server, in all); a larger backlog takes several.
const ParkLimit = 10000

// Park moves the due pending items of exporter's skip keys (accounts, or
// MeterSkipKey's "account|event name") to d from now, at most ParkLimit
// of them per shard group, and counts those it moved. Their state, attempts and lease do
// not change; claims that skip the keys no longer read them.
func (s *Store) Park(ctx context.Context, q pgdb.Querier, exporter string, keys []string, d time.Duration) (int64, error) {
	if len(keys) == 0 {
		return 0, nil
	}
	n, err := s.parkGroups(ctx, q, sqlPark, pgx.NamedArgs{"keys": keys, "exporter": exporter, "for": d, "limit": ParkLimit})
	if err != nil {
		return n, fmt.Errorf("outbox: parking skipped keys: %w", err)
	}
	return n, nil
}

// Unpark makes the pending items of exporter's skip keys that Park moved
// (due within d) due now, and counts them: the keys are skipped no longer.
func (s *Store) Unpark(ctx context.Context, q pgdb.Querier, exporter string, keys []string, d time.Duration) (int64, error) {
	if len(keys) == 0 {
		return 0, nil
	}
	n, err := s.parkGroups(ctx, q, sqlUnpark, pgx.NamedArgs{"keys": keys, "exporter": exporter, "for": d})
	if err != nil {
		return n, fmt.Errorf("outbox: unparking keys: %w", err)
	}
	return n, nil
}
