package quarantine

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// LineFilter names the items behind one line of the completeness report:
// its tenant, feature and billing period, and the ordering key its items
// carry under the current mappings (destination account, customer, meter
// event name).
type LineFilter struct {
	Tenant, Feature string
	// Period is the start of the billing period.
	Period time.Time
	// Accounts are the line's destination accounts (Line.Accounts);
	// Customer and EventName the mappings' current ones.
	Accounts            []string
	Customer, EventName string
	// States are the item states listed; pending lists leased items too.
	States []string
}

// LineItem is an item behind a line of the completeness report.
type LineItem struct {
	ID    int64
	State string
	// Value is the payload's value as the payload holds it.
	Value string
	// At is the payload's event time (a window's start).
	At time.Time
	// Reason is the quarantine reason, empty outside the quarantine.
	Reason string
}

// sqlLineItems reads the items of a line's ordering keys (one an account) in one billing period's
// time range (the key-and-time index of the bodies), narrowed to the line's
// tenant, feature, period and states, by id. Its cost is the key's items in
// the period, never the month's other items or the ledger.
const sqlLineItems = `
SELECT b.id, s.state, coalesce(b.payload ->> 'value', ''), (b.payload ->> 'timestamp')::bigint, coalesce(s.quarantine_reason, '')
FROM outbox_item_bodies b JOIN outbox_item_states s ON s.id = b.id
WHERE b.ordering_key = ANY(@keys)
  AND (b.payload ->> 'timestamp')::bigint >= @from AND (b.payload ->> 'timestamp')::bigint < @to
  AND b.tenant_key = @tenant AND b.payload ->> 'feature' = @feature
  AND (b.payload ->> 'period')::timestamptz = @period
  AND s.state = ANY(@states)
ORDER BY b.id
LIMIT @limit`

// LineItems reads at most limit items behind a line of the completeness
// report: those of f's states carrying the line's usage under its current
// ordering key. Items staged under an earlier mapping (another customer or
// meter) are not among them, nor is usage not yet staged.
func LineItems(ctx context.Context, q pgdb.Querier, f LineFilter, limit int) ([]LineItem, error) {
	states := f.States
	for _, s := range f.States {
		if s == "pending" {
			states = append(append([]string{}, f.States...), "leased")
			break
		}
	}
	// A period's usage lies in its month from its start; the week after
	// covers a month longer than the start's (an anchor on the 31st).
	from, to := f.Period.Unix(), f.Period.AddDate(0, 1, 7).Unix()
	keys := make([]string, len(f.Accounts))
	for i, a := range f.Accounts {
		keys[i] = a + "|" + f.Customer + "|" + f.EventName
	}
	rows, err := q.Query(ctx, sqlLineItems, pgx.NamedArgs{"keys": keys,
		"from": from, "to": to, "tenant": f.Tenant, "feature": f.Feature, "period": f.Period, "states": states, "limit": limit})
	if err != nil {
		return nil, fmt.Errorf("quarantine: reading a line's items: %w", err)
	}
	items, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (LineItem, error) {
		var (
			it LineItem
			ts int64
		)
		err := row.Scan(&it.ID, &it.State, &it.Value, &ts, &it.Reason)
		it.At = time.Unix(ts, 0).UTC()
		return it, err
	})
	if err != nil {
		return nil, fmt.Errorf("quarantine: reading a line's items: %w", err)
	}
	return items, nil
}
