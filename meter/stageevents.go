package meter

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// sqlEventRows locks up to a batch of unstaged rows of a per-event or an
// unmapped feature. Rows that would be quarantined for a missing
// destination account wait for their default window (one hour) plus the
// grace to close, which gives an operator the time to supply it before
// they are quarantined one by one. Rows of an unmapped feature or tenant
// do not wait: they are quarantined at the next pass, where finance sees
// them (the quarantine report), and a mapping made later re-addresses them
// on requeue. Rows timestamped further ahead than the provider accepts
// wait until they are not.
const sqlEventRows = `
SELECT id, event_id, value, occurred_at FROM usage_events
WHERE bucket = @bucket AND tenant = @tenant AND feature = @feature AND item_id IS NULL
  AND (NOT @wait OR date_bin(interval '1 hour', occurred_at, @origin::timestamptz) + interval '1 hour' + @grace::interval
                    <= statement_timestamp())
  AND occurred_at <= statement_timestamp() + @future::interval
ORDER BY id LIMIT @limit
FOR UPDATE SKIP LOCKED`

// stageEvents stages up to a batch of a per-event (or unmapped) feature's
// rows, one item each, in one transaction; more says another batch may
// follow.
func (s *Stager) stageEvents(ctx context.Context, db pgdb.DB, target Target, tenant, feature string) (res PassResult, more bool, err error) {
	err = pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		pair, ok, err := lockGroup(ctx, tx, tenant, feature)
		if err != nil || !ok {
			return err
		}
		if pair.Feature != nil && !pair.Feature.Aggregation.PerEvent() {
			return nil // mapped to a windowed aggregation meanwhile
		}
		rows, err := tx.Query(ctx, sqlEventRows, pgx.NamedArgs{
			"tenant": tenant, "bucket": tenantbucket.Of(tenant), "feature": feature, "wait": waits(pair, target),
			"origin": gridOrigin, "grace": s.grace(), "future": target.AcceptFuture, "limit": perEventBatch,
		})
		if err != nil {
			return err
		}
		var evs []stagedEvent
		var e stagedEvent
		if _, err := pgx.ForEachRow(rows, []any{&e.rowID, &e.eventID, &e.value, &e.at}, func() error {
			evs = append(evs, e)
			return nil
		}); err != nil {
			return err
		}
		if len(evs) == 0 {
			return nil
		}
		more = len(evs) == perEventBatch
		res, err = s.enqueueEvents(ctx, tx, target, tenant, feature, pair, evs)
		return err
	})
	if err != nil {
		return PassResult{}, false, fmt.Errorf("staging events: %w", err)
	}
	return res, more, nil
}

type stagedEvent struct {
	rowID   int64
	eventID string
	value   int64
	at      time.Time
}

// enqueueEvents makes one item per event and marks each row with its item.
func (s *Stager) enqueueEvents(ctx context.Context, tx pgx.Tx, target Target, tenant, feature string, pair mappings.Pair, evs []stagedEvent) (PassResult, error) {
	checks := make([]stampCheck, len(evs))
	for i, e := range evs {
		checks[i] = target.stampCheckOf(pair, e.at, e.at)
	}
	verdicts, err := checkStamps(ctx, tx, target, checks)
	if err != nil {
		return PassResult{}, err
	}
	items := make([]outbox.NewItem, len(evs))
	var res PassResult
	for i, e := range evs {
		items[i] = s.item(pair, target, tenant, feature, outbox.SubjectUsageEvent, EventSubjectRef(feature, e.eventID),
			e.value, e.at, PeriodStart(e.at, anchorOf(pair)))
		verdicts[i].apply(target, &items[i])
		if items[i].Quarantine != "" {
			res.Quarantined++
		}
	}
	enq, err := s.Outbox.EnqueueBatch(ctx, tx, items)
	if err != nil {
		return PassResult{}, err
	}
	rowIDs, itemIDs := make([]int64, len(evs)), make([]int64, len(evs))
	for i := range evs {
		if !enq[i].Inserted {
			return PassResult{}, fmt.Errorf("event %s: its item exists already (item %d); not marking the row with it", evs[i].eventID, enq[i].ID)
		}
		rowIDs[i], itemIDs[i] = evs[i].rowID, enq[i].ID
	}
	if err := markEventRows(ctx, tx, tenantbucket.Of(tenant), rowIDs, itemIDs); err != nil {
		return PassResult{}, err
	}
	res.Items, res.Events = len(evs), len(evs)
	return res, nil
}

// stageNewEvents stages, inside the ingest transaction, the new events of
// features mapped per event. Everything else waits for the stager.
func (s *Stager) stageNewEvents(ctx context.Context, tx pgx.Tx, events []Event, unique []int, inserted map[eventKey]insertedRow, maps map[[2]string]mappings.Pair) error {
	target, ok := s.Target(ctx)
	if !ok {
		return nil
	}
	if err := target.validate(); err != nil {
		return err
	}
	groups := map[[2]string][]stagedEvent{}
	for _, i := range unique {
		ev := events[i]
		k := [2]string{ev.Tenant, ev.Feature}
		p := maps[k]
		row, ok := inserted[eventKey{ev.Tenant, ev.ID}]
		if !ok || p.Feature == nil || !p.Feature.Aggregation.PerEvent() || waits(p, target) {
			continue // the stager stages it, after the wait sqlEventRows describes
		}
		groups[k] = append(groups[k], stagedEvent{rowID: row.id, eventID: ev.ID, value: ev.Value, at: row.occurredAt})
	}
	for k, evs := range groups {
		// Events timestamped further ahead than the provider accepts wait
		// for the stager too, rather than being quarantined now.
		ahead, err := timestampsAhead(ctx, tx, target, evs)
		if err != nil {
			return err
		}
		kept := evs[:0]
		for i, e := range evs {
			if !ahead[i] {
				kept = append(kept, e)
			}
		}
		if evs = kept; len(evs) == 0 {
			continue
		}
		if ok, err := tryLock(ctx, tx, k[0], k[1]); err != nil {
			return err
		} else if !ok {
			continue // a stager holds this feature right now; it, or the next pass, stages these
		}
		if _, err := s.enqueueEvents(ctx, tx, target, k[0], k[1], maps[k], evs); err != nil {
			return err
		}
	}
	return nil
}

// waits reports whether a per-event or unmapped feature's rows wait for
// their default window and the grace before they are staged: while they
// would be quarantined for a destination account an operator can still
// supply. A missing feature or tenant mapping does not wait (see
// sqlEventRows).
func waits(pair mappings.Pair, target Target) bool {
	return target.accountOf(pair) == ""
}
