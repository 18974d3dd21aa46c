package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
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
WHERE o.id IN (
    SELECT p.id FROM unnest(@keys::text[]) AS k(key)
    JOIN LATERAL (
        SELECT p.id FROM outbox_item_states p
        WHERE p.state = 'pending' AND ` + skipRange + `
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
WHERE o.id IN (
    SELECT p.id FROM unnest(@keys::text[]) AS k(key)
    JOIN LATERAL (
        SELECT p.id FROM outbox_item_states p
        WHERE p.state = 'pending' AND ` + skipRange + `
          AND p.exporter = @exporter AND p.next_attempt_at > statement_timestamp()
          AND p.next_attempt_at <= statement_timestamp() + @for::interval
        FOR UPDATE SKIP LOCKED
    ) p ON true)
  AND o.state = 'pending'`

// ParkLimit is the most items one Park moves; a larger backlog takes
// several.
const ParkLimit = 10000

// Park moves the due pending items of exporter's skip keys (accounts, or
// MeterSkipKey's "account|event name") to d from now, at most ParkLimit
// of them, and counts those it moved. Their state, attempts and lease do
// not change; claims that skip the keys no longer read them.
func (s *Store) Park(ctx context.Context, q pgdb.Querier, exporter string, keys []string, d time.Duration) (int64, error) {
	if len(keys) == 0 {
		return 0, nil
	}
	tag, err := q.Exec(ctx, sqlPark, pgx.NamedArgs{"keys": keys, "exporter": exporter, "for": d, "limit": ParkLimit})
	if err != nil {
		return 0, fmt.Errorf("outbox: parking skipped keys: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Unpark makes the pending items of exporter's skip keys that Park moved
// (due within d) due now, and counts them: the keys are skipped no longer.
func (s *Store) Unpark(ctx context.Context, q pgdb.Querier, exporter string, keys []string, d time.Duration) (int64, error) {
	if len(keys) == 0 {
		return 0, nil
	}
	tag, err := q.Exec(ctx, sqlUnpark, pgx.NamedArgs{"keys": keys, "exporter": exporter, "for": d})
	if err != nil {
		return 0, fmt.Errorf("outbox: unparking keys: %w", err)
	}
	return tag.RowsAffected(), nil
}
