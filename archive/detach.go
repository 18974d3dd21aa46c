package archive

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/quarantine"
)

// Detached is what Detach did.
type Detached struct {
	// Partition is the ledger's month detached and dropped, and Events its
	// rows; empty when the month had left already.
	Partition string `json:"partition,omitempty"`
	Events    int64  `json:"events"`
	// Periods are the archived periods whose every ledger row has now left
	// the database: marked detached, their report answered from the
	// manifest from now on.
	Periods []string `json:"periods"`
}

// Detach takes the ledger's month named by period out of the database. A
// month of the ledger holds the events that occurred in it, which belong to
// the periods starting in it and in the month before; so both archives
// must be verified, and they must count exactly the month's rows
// (meter.DetachMonth checks it, and keeps the month otherwise). A period
// is marked detached once both months its events occur in have left. pool
// must connect as the ledger's owner. Run again after an interruption, it
// finishes what is left.
func Detach(ctx context.Context, pool *pgxpool.Pool, period, by string) (Detached, error) {
	month, _, err := quarantine.ParsePeriod(period)
	if err != nil {
		return Detached{}, err
	}
	prevMonth := month.AddDate(0, -1, 0)
	prev := prevMonth.Format("2006-01")
	res := Detached{Periods: []string{}}
	// No archive or verify of either period meanwhile: the proofs hold
	// until the drop.
	_, release, err := holdPeriods(ctx, pool, prev, period)
	if err != nil {
		return res, err
	}
	defer release()
	done, err := meter.MonthDetached(ctx, pool, month)
	if err != nil {
		return res, err
	}
	if !done {
		pp, err := Verified(ctx, pool, prev)
		if err != nil {
			return res, fmt.Errorf("the ledger's month %s holds events of the periods of %s too: %w", period, prev, err)
		}
		cp, err := Verified(ctx, pool, period)
		if err != nil {
			return res, err
		}
		d, err := meter.DetachMonth(ctx, pool, month, meter.DetachProof{
			Previous: meter.VerifiedPeriod{Period: prevMonth, MonthEvents: pp.LedgerMonths[period], Manifest: pp.Location},
			Month:    meter.VerifiedPeriod{Period: month, MonthEvents: cp.LedgerMonths[period], Manifest: cp.Location},
		}, by)
		if err != nil {
			return res, err
		}
		res.Partition, res.Events = d.Partition, d.Events
	}
	for _, p := range []string{prev, period} {
		if n, err := monthsLeft(ctx, pool, p); err != nil {
			return res, err
		} else if n < 2 {
			continue
		}
		rec, err := latestArchive(ctx, pool, p)
		if err != nil {
			return res, err
		}
		if rec == nil || rec.State != StateVerified {
			continue
		}
		proof, err := Verified(ctx, pool, p)
		if err != nil {
			return res, err
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			return res, fmt.Errorf("archive: %w", err)
		}
		if err := MarkDetached(ctx, tx, proof, by); err != nil {
			_ = tx.Rollback(ctx)
			return res, err
		}
		if err := tx.Commit(ctx); err != nil {
			return res, fmt.Errorf("archive: %w", err)
		}
		res.Periods = append(res.Periods, p)
	}
	return res, nil
}

// monthsLeft counts the months the events of period occur in (the month
// it names and the next) that have left the ledger: 0 while the database
// holds the period whole, 2 once all of it has left.
func monthsLeft(ctx context.Context, q pgdb.Querier, period string) (int, error) {
	from, _, err := quarantine.ParsePeriod(period)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, m := range []int{0, 1} {
		done, err := meter.MonthDetached(ctx, q, from.AddDate(0, m, 0))
		if err != nil {
			return 0, err
		}
		if done {
			n++
		}
	}
	return n, nil
}
