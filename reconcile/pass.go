package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// runScope is what a run compares, as recorded when it was queued, and
// where it stands: the settle delay, the first hour compared (0: all) and
// the last key done ("" before the first).
type runScope struct {
	settle  time.Duration
	sinceTS int64
	cursor  string
}

// pass works through the run's keys after its cursor.
func (r *Reconciler) pass(ctx context.Context, db DB, id int64) error {
	dest, err := r.cfg.Destination()
	if err != nil {
		return err
	}
	scope, err := readScope(ctx, db, id)
	if err != nil {
		return err
	}
	start := r.calls.Load()
	byEvent, err := r.metersByEvent(ctx)
	if err != nil {
		return err
	}
	// The keys with settled accepted or uncertain items in the run's
	// scope, after its cursor, in order.
	keys, err := r.cfg.Outbox.SettledKeys(ctx, db, outbox.KeyFilter{Account: dest.Account, Mode: dest.Mode,
		Settle: scope.settle, Since: scope.sinceTS, After: scope.cursor})
	if err != nil {
		return err
	}
	if _, err := db.Exec(ctx, `UPDATE reconcile_runs SET destination_account = @account, mode = @mode,
			keys_total = keys_done + @n, stripe_calls = stripe_calls + @calls WHERE id = @id`,
		pgx.NamedArgs{"id": id, "account": dest.Account, "mode": string(dest.Mode), "n": len(keys), "calls": r.calls.Load() - start}); err != nil {
		return fmt.Errorf("reconcile: recording run %d: %w", id, err)
	}

	for _, k := range keys {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := r.reconcileKey(ctx, db, id, dest, byEvent, k, scope.settle, scope.sinceTS); err != nil {
			return err
		}
	}
	return nil
}

// readScope reads run id's settle delay, first hour and cursor.
func readScope(ctx context.Context, db DB, id int64) (runScope, error) {
	var (
		settleSec float64
		since     *time.Time
		s         runScope
	)
	if err := db.QueryRow(ctx, `SELECT extract(epoch FROM settle)::float8, since, cursor FROM reconcile_runs WHERE id = $1`, id).
		Scan(&settleSec, &since, &s.cursor); err != nil {
		return runScope{}, fmt.Errorf("reconcile: reading run %d: %w", id, err)
	}
	s.settle = time.Duration(settleSec * float64(time.Second))
	if since != nil {
		s.sinceTS = since.Unix() - since.Unix()%hour
	}
	return s, nil
}

// metersByEvent reads the account's meters, by event name.
func (r *Reconciler) metersByEvent(ctx context.Context) (map[string]stripeapi.Meter, error) {
	var meters []stripeapi.Meter
	if err := r.read(ctx, func() (err error) { meters, err = r.client.Meters(ctx); return err }); err != nil {
		return nil, err
	}
	byEvent := map[string]stripeapi.Meter{}
	for _, m := range meters {
		// The active meter of an event name wins; else any (the events of
		// a deactivated meter still have summaries).
		if cur, ok := byEvent[m.EventName]; !ok || (cur.Status != "active" && m.Status == "active") {
			byEvent[m.EventName] = m
		}
	}
	return byEvent, nil
}
