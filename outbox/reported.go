package outbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// sqlNoteFailures notes the provider's error report on items still in
// flight — pending (a retry after an attempt that may have reached the
// provider), leased (the report overtook the answer) or uncertain — so that
// the accept recorded for them afterwards (T2) lands where the report says.
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
    SELECT o.id FROM outbox_items o WHERE o.id = ANY(@ids::bigint[]) ORDER BY o.id FOR UPDATE
)
UPDATE outbox_items o SET
    reported_state   = b.target,
    reported_reason  = nullif(b.reason, ''),
    reported_code    = b.code,
    reported_message = nullif(b.message, '')
FROM b
WHERE o.id = ANY(@ids::bigint[]) AND o.id = b.id AND o.id IN (SELECT id FROM locked)
  AND o.state IN ('pending', 'leased', 'uncertain')
  AND (o.reported_state IS NULL OR (o.reported_state = 'quarantined' AND b.target = 'rejected'))
RETURNING o.id`

// NoteFailures records the provider's asynchronous word that it failed the
// given items while they are still in flight (pending, leased or
// uncertain): the next accept of each (T2) lands in the failure's To with
// its reason and error instead of accepted. Without the note, a report that
// overtakes the answer to the request it is about would be lost, and the
// item would sit accepted with nothing counted. It returns the ids noted;
// an item in another state, or already noted with an equal or stronger
// verdict, is left as it is. The input is checked as FailAccepted's. It runs
// on q, so a caller can make it part of its transaction.
func (s *Store) NoteFailures(ctx context.Context, q Querier, fs []ProviderFailure) ([]int64, error) {
	if len(fs) == 0 {
		return nil, nil
	}
	n := len(fs)
	ids, states, reasons := make([]int64, n), make([]string, n), make([]string, n)
	codes, messages := make([]string, n), make([]string, n)
	seen := make(map[int64]bool, n)
	for i, f := range fs {
		if seen[f.ID] {
			return nil, fmt.Errorf("outbox: noting a failure: item %d appears twice in one batch", f.ID)
		}
		seen[f.ID] = true
		if err := f.check(); err != nil {
			return nil, fmt.Errorf("outbox: noting a failure: %w", err)
		}
		e := f.Error.Sanitized()
		ids[i], states[i], reasons[i] = f.ID, string(f.To), string(f.Reason)
		codes[i], messages[i] = e.Code, e.Message
	}
	rows, err := q.Query(ctx, sqlNoteFailures, pgx.NamedArgs{
		"ids": ids, "states": states, "reasons": reasons, "codes": codes, "messages": messages,
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: noting failures: %w", err)
	}
	noted, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("outbox: noting failures: %w", err)
	}
	return noted, nil
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
