package meter

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/pgdb"
)

// A month of the ledger (the partition usage_events_yYYYYmMM) holds the
// events that occurred in it, in UTC. A billing period named by its month
// (as the completeness report and the archive name it) is the periods that
// start in that month, whatever each tenant's anchor, so its events occur
// in that month and the next. Month M's partition therefore holds events
// of periods M-1 and M, and leaves the database only when both are
// archived and verified, and only once month M+1 is over.

// VerifiedPeriod is one verified archive a detach relies on.
type VerifiedPeriod struct {
	// Period is the first day (UTC) of the month the archived billing
	// periods start in.
	Period time.Time
	// MonthEvents counts the archive's ledger rows that occurred in the
	// month being detached, as verify re-read them from the archive files.
	MonthEvents int64
	// Manifest names the archive (its URL or manifest digest), for the
	// audit log.
	Manifest string
}

// DetachProof is what the caller proves before a month leaves the database:
// the verified archives of the periods before and of the month, whose
// ledger rows occurring in the month must be exactly the partition's rows.
type DetachProof struct {
	// Previous is the verified archive of the periods starting the month
	// before; Month that of the periods starting in the month.
	Previous, Month VerifiedPeriod
}

// DetachResult says what DetachMonth did.
type DetachResult struct {
	// Partition is the table detached and dropped.
	Partition string
	// Events counts its rows.
	Events int64
}

// ErrNotArchived is wrapped by DetachMonth's refusals: the proof does not
// cover the month, or the partition holds rows the archives did not count.
var ErrNotArchived = errors.New("meter: the month is not proven archived and verified")

// MonthPartition is the name of the ledger's partition of the month that
// starts at month (UTC).
func MonthPartition(month time.Time) string {
	return fmt.Sprintf("usage_events_y%04dm%02d", month.Year(), int(month.Month()))
}

// DetachMonth takes the ledger's month (its first day, UTC) out of the
// database: it closes the month (ingest refuses its events period_closed
// from then on), detaches its partition concurrently (ingest of other
// months flows meanwhile), counts the detached rows and drops the table
// only if they are exactly the rows proof counts; otherwise the partition
// is attached again and the error wraps ErrNotArchived (archive and verify
// again, then detach again: a closed month stays closed). The month must
// be over, and the next one too. An audit entry by actor records the
// detach. Interrupted, it can be run again. owner is a pool or a
// connection of the role that owns the ledger (the runtime role may not
// detach).
func DetachMonth(ctx context.Context, owner pgdb.DB, month time.Time, proof DetachProof, actor string) (DetachResult, error) {
	month = month.UTC()
	res := DetachResult{Partition: MonthPartition(month)}
	if month.Day() != 1 || month.Hour() != 0 || month.Minute() != 0 || month.Second() != 0 || month.Nanosecond() != 0 {
		return res, fmt.Errorf("meter: %s is not the first instant of a month", month.Format(time.RFC3339))
	}
	prev := month.AddDate(0, -1, 0)
	if !proof.Previous.Period.Equal(prev) || !proof.Month.Period.Equal(month) {
		return res, fmt.Errorf("%w: detaching %s needs the verified archives of the periods of %s and %s",
			ErrNotArchived, month.Format("2006-01"), prev.Format("2006-01"), month.Format("2006-01"))
	}
	proven := proof.Previous.MonthEvents + proof.Month.MonthEvents
	part := pgx.Identifier{res.Partition}.Sanitize()

	var over, exists, attached, pending, closed bool
	if err := owner.QueryRow(ctx, `SELECT $1::timestamptz + interval '2 months' <= now(), to_regclass($2) IS NOT NULL,
			coalesce((SELECT true FROM pg_inherits WHERE inhrelid = to_regclass($2) AND inhparent = 'usage_events'::regclass), false),
			coalesce((SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass($2)), false),
			EXISTS (SELECT FROM usage_closed_months WHERE month = $1::date)`,
		month, res.Partition).Scan(&over, &exists, &attached, &pending, &closed); err != nil {
		return res, fmt.Errorf("meter: reading the ledger's month %s: %w", month.Format("2006-01"), err)
	}
	switch {
	case !over:
		return res, fmt.Errorf("meter: the ledger's month %s is not over with the next one; it stays", month.Format("2006-01"))
	case !exists && closed:
		return res, fmt.Errorf("meter: the ledger's month %s is detached already", month.Format("2006-01"))
	case !exists || (!attached && !closed):
		return res, fmt.Errorf("meter: the ledger has no partition %s", res.Partition)
	case !attached:
		return dropDetached(ctx, owner, month, proof, actor, res) // interrupted after the detach
	}

	// A first count, to refuse a month the archives do not cover before
	// anything changes.
	if err := owner.QueryRow(ctx, "SELECT count(*) FROM "+part).Scan(&res.Events); err != nil {
		return res, fmt.Errorf("meter: counting %s: %w", res.Partition, err)
	}
	if res.Events != proven {
		return res, fmt.Errorf("%w: %s holds %d events, the archives of %s and %s count %d of that month",
			ErrNotArchived, res.Partition, res.Events, prev.Format("2006-01"), month.Format("2006-01"), proven)
	}
	if !closed {
		if _, err := owner.Exec(ctx, `INSERT INTO usage_closed_months (month, events, closed_by) VALUES ($1::date, $2, $3)`,
			month, proven, actor); err != nil {
			return res, fmt.Errorf("meter: closing the ledger's month %s: %w", month.Format("2006-01"), err)
		}
	}
	// An ingest that read the month open before it closed may still be
	// writing to it: the detach waits for it, and the count after sees it.
	detach := "ALTER TABLE usage_events DETACH PARTITION " + part + " CONCURRENTLY"
	if pending {
		detach = "ALTER TABLE usage_events DETACH PARTITION " + part + " FINALIZE"
	}
	if _, err := owner.Exec(ctx, detach); err != nil {
		return res, fmt.Errorf("meter: detaching %s: %w", res.Partition, err)
	}
	return dropDetached(ctx, owner, month, proof, actor, res)
}

// dropDetached counts the rows of month's detached partition and drops it
// if they are the rows proof counts, or attaches it again.
func dropDetached(ctx context.Context, owner pgdb.DB, month time.Time, proof DetachProof, actor string, res DetachResult) (DetachResult, error) {
	part := pgx.Identifier{res.Partition}.Sanitize()
	proven := proof.Previous.MonthEvents + proof.Month.MonthEvents
	tx, err := owner.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("meter: dropping %s: %w", res.Partition, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+part).Scan(&res.Events); err != nil {
		return res, fmt.Errorf("meter: counting %s: %w", res.Partition, err)
	}
	if res.Events != proven {
		if _, aerr := owner.Exec(ctx, fmt.Sprintf("ALTER TABLE usage_events ATTACH PARTITION %s FOR VALUES FROM (%s) TO (%s)",
			part, quoteTime(month), quoteTime(month.AddDate(0, 1, 0)))); aerr != nil {
			return res, fmt.Errorf("meter: %s held %d events after the detach, not %d, and attaching it again failed: %w", res.Partition, res.Events, proven, aerr)
		}
		return res, fmt.Errorf("%w: %s held %d events when detached, the archives count %d: it is attached again and its month stays closed; archive and verify again",
			ErrNotArchived, res.Partition, res.Events, proven)
	}
	if _, err := tx.Exec(ctx, "DROP TABLE "+part); err != nil {
		return res, fmt.Errorf("meter: dropping %s: %w", res.Partition, err)
	}
	if err := audit.Record(ctx, tx, audit.Entry{Actor: actor, Action: audit.ActionLedgerDetach, Subject: "ledger:" + month.Format("2006-01"),
		From: "attached", To: "detached", Details: map[string]any{
			"partition": res.Partition, "events": res.Events,
			"archives": []string{proof.Previous.Manifest, proof.Month.Manifest},
		}}); err != nil {
		return res, err
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("meter: dropping %s: %w", res.Partition, err)
	}
	return res, nil
}

func quoteTime(t time.Time) string { return "'" + t.UTC().Format("2006-01-02 15:04:05+00") + "'" }

// EnsureMonths creates the ledger's month partitions through the month
// ahead months after the current one (usage_events_ensure_months) and
// returns how many it made. A partition missing when an event of its
// month arrives would fail the ingest: the migration makes three months
// ahead and a daily job keeps them so.
func EnsureMonths(ctx context.Context, db pgdb.Querier, ahead int) (int, error) {
	var made int
	err := db.QueryRow(ctx, `SELECT usage_events_ensure_months((date_trunc('month', now(), 'UTC') + make_interval(months => $1))::date)`, ahead).Scan(&made)
	if err != nil {
		return 0, fmt.Errorf("meter: creating the ledger's months ahead: %w", err)
	}
	return made, nil
}

// MonthDetached reports whether the ledger's month (its first day, UTC) is
// closed and its partition gone: what a detach leaves once it is done.
func MonthDetached(ctx context.Context, db pgdb.Querier, month time.Time) (bool, error) {
	var done bool
	err := db.QueryRow(ctx, `SELECT EXISTS (SELECT FROM usage_closed_months WHERE month = $1::date) AND to_regclass($2) IS NULL`,
		month.UTC(), MonthPartition(month.UTC())).Scan(&done)
	if err != nil {
		return false, fmt.Errorf("meter: reading the ledger's month %s: %w", month.UTC().Format("2006-01"), err)
	}
	return done, nil
}
