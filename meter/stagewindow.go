package meter

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// sqlWindowRows locks the unstaged rows of one closed window and reduces them
// in one statement: the window counts as closed when its end plus the grace
// has passed on the database clock.
const sqlWindowRows = `
WITH locked AS (
    SELECT id, value, occurred_at FROM usage_events
    WHERE bucket = @bucket AND tenant = @tenant AND feature = @feature AND item_id IS NULL
      AND occurred_at >= @from AND occurred_at < @to
      AND @to::timestamptz + @grace::interval <= statement_timestamp()
    FOR UPDATE SKIP LOCKED
)
SELECT coalesce(array_agg(id ORDER BY occurred_at, id), '{}'), coalesce(sum(value), 0)::numeric,
       (array_agg(value ORDER BY occurred_at DESC, id DESC))[1], max(occurred_at)
FROM locked`

// stageWindow stages one window's unstaged rows as one item (a supplement
// when the window has items already), in one transaction.
func (s *Stager) stageWindow(ctx context.Context, db pgdb.DB, target Target, tenant, feature string, w Window, version int) (res PassResult, err error) {
	err = pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		pair, ok, err := lockGroup(ctx, tx, tenant, feature)
		if err != nil || !ok {
			return err
		}
		if pair.Feature == nil || pair.Feature.Aggregation.PerEvent() || pair.Version() != version {
			return nil // the mapping moved since the pass began; the next pass stages it
		}
		rows, err := s.lockWindowRows(ctx, tx, tenant, feature, w)
		if err != nil || len(rows.ids) == 0 {
			return err
		}
		if pair.Feature.Aggregation == mappings.Last {
			// Late rows of a last window that are all older than its latest
			// staged row change nothing Stripe should see: they join the item
			// that carries that row. A supplement would re-send an older
			// value as the window's last.
			absorbed, err := absorbLate(ctx, tx, s.distributed(), tenant, feature, w, w.SubjectRef(feature, 0), rows.ids)
			if err != nil || absorbed {
				if err == nil {
					res.Events = len(rows.ids)
				}
				return err
			}
		}
		chunks, err := windowChunks(ctx, tx, pair.Feature.Aggregation, target, tenantbucket.Of(tenant), rows)
		if err != nil {
			return err
		}
		res, err = s.enqueueChunks(ctx, tx, pair, target, tenant, feature, w, chunks)
		return err
	})
	if err != nil {
		return PassResult{}, fmt.Errorf("staging window %s: %w", w.SubjectRef(feature, 0), err)
	}
	return res, nil
}

// windowRows are the unstaged rows of a window, locked and reduced by
// sqlWindowRows: their ids in time order, their exact sum, and the value and
// time of the latest.
type windowRows struct {
	ids  []int64
	sum  pgtype.Numeric
	last *int64
	ts   *time.Time
}

// lockWindowRows locks and reduces window w's unstaged rows, none until the
// window has closed (its end plus the grace).
func (s *Stager) lockWindowRows(ctx context.Context, tx pgx.Tx, tenant, feature string, w Window) (windowRows, error) {
	var r windowRows
	if err := tx.QueryRow(ctx, sqlWindowRows, pgx.NamedArgs{
		"tenant": tenant, "bucket": tenantbucket.Of(tenant), "feature": feature, "from": w.From, "to": w.To, "grace": s.grace(),
	}).Scan(&r.ids, &r.sum, &r.last, &r.ts); err != nil {
		return windowRows{}, fmt.Errorf("locking the window's rows: %w", err)
	}
	return r, nil
}

// windowChunks are the parts of a window its items carry. One item carries
// the window, unless its sum does not fit what the provider accepts
// (Target.MaxValue; a signed 64-bit value at most): then its rows are split,
// in time order, into as few items (supplements) as keep every partial sum
// in range. A last window's item carries its latest value.
func windowChunks(ctx context.Context, tx pgx.Tx, agg mappings.Aggregation, target Target, bucket int16, rows windowRows) ([]chunk, error) {
	chunks := []chunk{{ids: rows.ids, value: *rows.last, at: *rows.ts}}
	if agg != mappings.Sum {
		return chunks, nil
	}
	if v, ok := numericToInt64(rows.sum); ok && target.valueFits(v) {
		chunks[0].value = v
		return chunks, nil
	}
	return splitWindow(ctx, tx, bucket, rows.ids, target.maxValue())
}

// enqueueChunks makes one window item per chunk, numbered after the
// window's items so far (the first is the window's own ref, the others its
// supplements "#n"), and marks each chunk's rows with its item.
func (s *Stager) enqueueChunks(ctx context.Context, tx pgx.Tx, pair mappings.Pair, target Target, tenant, feature string,
	w Window, chunks []chunk) (res PassResult, err error) {
	base := w.SubjectRef(feature, 0)
	// One number per ref: a re-addressed item's successor ("%r<n>")
	// carries its predecessor's number.
	n, err := s.Outbox.WindowItemCount(ctx, tx, tenant, base)
	if err != nil {
		return PassResult{}, err
	}
	checks := make([]stampCheck, len(chunks))
	for k, c := range chunks {
		checks[k] = target.stampCheckOf(pair, c.at, w.PeriodStart)
	}
	verdicts, err := checkStamps(ctx, tx, target, checks)
	if err != nil {
		return PassResult{}, err
	}
	for k, c := range chunks {
		item := s.item(pair, target, tenant, feature, outbox.SubjectUsageWindow, w.SubjectRef(feature, n+k), c.value, c.at, w.PeriodStart)
		verdicts[k].apply(target, &item)
		enq, err := s.Outbox.Enqueue(ctx, tx, item)
		if err != nil {
			return PassResult{}, err
		}
		if !enq.Inserted {
			return PassResult{}, fmt.Errorf("window %s: the item exists already (item %d); not marking rows with it", item.SubjectRef, enq.ID)
		}
		if err := markClosedRows(ctx, tx, tenantbucket.Of(tenant), c.ids, sameItem(enq.ID, len(c.ids)), w.To, s.grace()); err != nil {
			return PassResult{}, err
		}
		res.Items++
		res.Events += len(c.ids)
		if item.Quarantine != "" {
			res.Quarantined++
		}
	}
	return res, nil
}
