package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/outbox"
)

// commitKey commits what the comparison of key k came to, in one
// transaction: the confirmations, the discrepancies, the older
// discrepancies of the hours it looked at cleared, the key's open billing
// periods noted, and the run's progress past the key, with the Stripe
// calls made since start.
func (r *Reconciler) commitKey(ctx context.Context, db pgdb.DB, id int64, dest exporter.Destination, k runKey, kh keyHours,
	out keyOutcome, start int64) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("reconcile: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	confirmed, err := r.confirm(ctx, tx, out.confirm)
	if err != nil {
		return err
	}
	found := 0
	for i := range out.found {
		recorded, err := recordDiscrepancy(ctx, tx, id, &out.found[i])
		if err != nil {
			return err
		}
		if recorded {
			found++
		}
	}
	if err := clearOlder(ctx, tx, id, dest, k.SettledKey, out); err != nil {
		return err
	}
	if err := r.notePeriods(ctx, tx, dest, k.SettledKey, kh.periods); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `UPDATE reconcile_runs SET cursor = @cursor, keys_done = keys_done + 1,
			hours_compared = hours_compared + @compared, hours_matched = hours_matched + @matched,
			hours_skipped = hours_skipped + @skipped, items_confirmed = items_confirmed + @confirmed,
			discrepancies = discrepancies + @found, stripe_calls = stripe_calls + @calls, heartbeat_at = clock_timestamp()
		WHERE id = @id AND status = 'running'`,
		pgx.NamedArgs{"id": id, "cursor": k.OrderingKey, "compared": out.compared, "matched": out.matched, "skipped": out.skipped,
			"confirmed": confirmed, "found": found, "calls": r.calls.Load() - start}); err != nil {
		return fmt.Errorf("reconcile: recording progress: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	r.metrics.confirmed.Add(float64(confirmed))
	r.metrics.discrepancies.Add(float64(found))
	return nil
}

// confirm moves the accepted items ids to confirmed (confirm) through package
// outbox, confirmBatch at a time, and counts those it moved. An item that
// moved since it was read is left as it is.
func (r *Reconciler) confirm(ctx context.Context, tx pgx.Tx, ids []int64) (int, error) {
	confirmed := 0
	for len(ids) > 0 {
		n := min(len(ids), confirmBatch)
		done, refused, err := r.cfg.Outbox.Confirm(ctx, tx, ids[:n])
		if err != nil {
			return 0, err
		}
		confirmed += len(done)
		for itemID, rerr := range refused {
			// The item moved since it was read (an operator recovered it,
			// say): it is left as it is and the next run looks again.
			r.cfg.Logger.Warn("reconcile: an item changed before it could be confirmed", "item", itemID, "error", rerr)
		}
		ids = ids[n:]
	}
	return confirmed, nil
}

// sqlClearOlder marks the discrepancies of earlier runs that the key's
// comparison in this run makes old: those of the hours it looked at, and,
// when it read the key's summaries (or was refused them), the key's
// refusals. One statement per key, through the index of the current
// discrepancies.
const sqlClearOlder = `
UPDATE reconcile_discrepancies SET cleared_by_run = @run
WHERE destination_account = @account AND mode = @mode AND event_name = @event AND customer = @customer
  AND cleared_by_run IS NULL AND run_id < @run
  AND (hour = ANY(@hours::timestamptz[]) OR (@read AND reason = 'summaries_refused'))`

// clearOlder runs sqlClearOlder for key k's outcome out in run id.
func clearOlder(ctx context.Context, tx pgx.Tx, id int64, dest exporter.Destination, k outbox.SettledKey, out keyOutcome) error {
	if len(out.looked) == 0 && !out.read {
		return nil
	}
	hours := make([]time.Time, len(out.looked))
	for i, h := range out.looked {
		hours[i] = time.Unix(h, 0).UTC()
	}
	if _, err := tx.Exec(ctx, sqlClearOlder, pgx.NamedArgs{"run": id, "account": dest.Account, "mode": string(dest.Mode),
		"event": k.EventName, "customer": k.Customer, "hours": hours, "read": out.read}); err != nil {
		return fmt.Errorf("reconcile: clearing older discrepancies: %w", err)
	}
	return nil
}

// sqlResolvedBefore says whether a resolution covers a discrepancy with
// these numbers (resolutionMatches).
const sqlResolvedBefore = `
SELECT EXISTS (SELECT 1 FROM reconcile_resolutions r
    WHERE r.destination_account = @account AND r.mode = @mode AND r.event_name = @event AND r.customer = @customer
      AND r.hour = @hour AND r.reason = @reason AND r.expected = @expected::numeric
      AND r.provider IS NOT DISTINCT FROM @provider::numeric)`

// recordDiscrepancy records d as one of run id's discrepancies, with the
// expected items that Stripe's meter error reports name (its
// ReportedItems, set here), and says whether it did: numbers finance has
// resolved for the hour (Resolve) are not recorded again, nor a
// discrepancy the run recorded already (a resumed run).
func recordDiscrepancy(ctx context.Context, tx pgx.Tx, id int64, d *Discrepancy) (bool, error) {
	var resolved bool
	if err := tx.QueryRow(ctx, sqlResolvedBefore, pgx.NamedArgs{"account": d.Account, "mode": d.Mode, "event": d.EventName,
		"customer": d.Customer, "hour": d.Hour, "reason": d.Reason, "expected": d.Expected, "provider": d.Provider,
	}).Scan(&resolved); err != nil {
		return false, fmt.Errorf("reconcile: reading resolutions: %w", err)
	}
	if resolved {
		return false, nil
	}
	rows, err := tx.Query(ctx, `SELECT DISTINCT item_id FROM meter_error_evidence WHERE item_id = ANY($1) ORDER BY 1`, d.ExpectedItems)
	if err != nil {
		return false, fmt.Errorf("reconcile: reading evidence: %w", err)
	}
	if d.ReportedItems, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
		return false, fmt.Errorf("reconcile: reading evidence: %w", err)
	}
	d.ReportedItems = nonNil(d.ReportedItems)
	var provider, diff *string
	if d.Provider != nil {
		provider, diff = d.Provider, d.Difference
	}
	var errCode *string
	var errStatus *int
	if d.Reason != ReasonMismatch {
		errCode, errStatus = &d.ErrorCode, &d.ErrorStatus
	}
	tag, err := tx.Exec(ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name, meter, customer,
			reason, error_code, error_status, hour, formula, expected, provider, difference, expected_items, uncertain_items,
			explained_by, explanation, reported_items, confirmed_items)
		VALUES (@run, @account, @mode, @event, @meter, @customer, @reason, @error_code, @error_status, @hour, @formula,
			@expected::numeric, @provider::numeric, @diff::numeric, @expected_items, @uncertain_items, @explained_by,
			@explanation, @reported, @confirmed)
		ON CONFLICT DO NOTHING`,
		pgx.NamedArgs{"run": id, "account": d.Account, "mode": d.Mode, "event": d.EventName, "meter": d.Meter,
			"customer": d.Customer, "reason": d.Reason, "error_code": errCode, "error_status": errStatus,
			"hour": d.Hour, "formula": d.Formula, "expected": d.Expected, "provider": provider,
			"diff": diff, "expected_items": d.ExpectedItems, "uncertain_items": d.UncertainItems,
			"explained_by": d.ExplainedBy, "explanation": d.Explanation, "reported": d.ReportedItems,
			"confirmed": nonNil(d.ConfirmedItems)})
	if err != nil {
		return false, fmt.Errorf("reconcile: recording a discrepancy: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}
