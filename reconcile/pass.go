package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
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
func (r *Reconciler) pass(ctx context.Context, db pgdb.DB, id int64) error {
	dest, err := r.cfg.Destination()
	if err != nil {
		return err
	}
	scope, err := readScope(ctx, db, id)
	if err != nil {
		return err
	}
	start := r.calls.Load()
	// The node's own destination and the connected accounts tenant
	// mappings have named: a run compares each account's items with that
	// account's summaries.
	accounts := []string{dest.Account}
	if r.cfg.Connected != nil {
		more, err := r.cfg.Connected(ctx, db)
		if err != nil {
			return fmt.Errorf("reconcile: reading the connected accounts: %w", err)
		}
		for _, a := range more {
			if a != dest.Account {
				accounts = append(accounts, a)
			}
		}
	}
	// The keys with settled accepted or uncertain items in the run's
	// scope, or with an open billing period, after its cursor, in order.
	keys, err := r.keysOf(ctx, db, accounts, dest.Mode, scope)
	if err != nil {
		return err
	}
	if _, err := db.Exec(ctx, `UPDATE reconcile_runs SET destination_account = @account, mode = @mode,
			keys_total = keys_done + @n, stripe_calls = stripe_calls + @calls WHERE id = @id`,
		pgx.NamedArgs{"id": id, "account": dest.Account, "mode": string(dest.Mode), "n": len(keys), "calls": r.calls.Load() - start}); err != nil {
		return fmt.Errorf("reconcile: recording run %d: %w", id, err)
	}

	// Each account's meters, read once a run when its first key comes up:
	// a meter's id differs from one account to the next.
	meters := map[string]map[string]stripeapi.Meter{}
	for _, k := range keys {
		if err := ctx.Err(); err != nil {
			return err
		}
		kdest := dest
		kdest.Account = k.Account
		keyStart := r.calls.Load()
		client, err := r.clientFor(k.Account, dest)
		if err != nil {
			return err
		}
		byEvent, ok := meters[k.Account]
		if !ok {
			byEvent, err = r.metersByEvent(ctx, client)
			switch {
			case err != nil && ctx.Err() == nil && k.Account != dest.Account && stripeapi.AccessRefused(err):
				// Stripe refuses the platform's access to this connected
				// account (the exporter stalls it too): its keys' hours are
				// skipped, visibly, and the other accounts are compared.
				code, status, _ := stripeapi.Describe(err)
				r.cfg.Logger.Warn("reconcile: Stripe refuses the connected account; its keys are skipped this run",
					"account", k.Account, "code", code, "status", status)
				byEvent = nil
			case err != nil:
				return err
			}
			meters[k.Account] = byEvent
		}
		if err := r.reconcileKey(ctx, db, id, kdest, client, byEvent, k, scope, keyStart); err != nil {
			return err
		}
	}
	return nil
}

// clientFor is the client of calls about account's items: the reconciler's
// own for the node's destination, else one that sends Stripe-Account.
func (r *Reconciler) clientFor(account string, dest exporter.Destination) (*stripeapi.Client, error) {
	if account == dest.Account {
		return r.client, nil
	}
	return r.client.For(account)
}

// readScope reads run id's settle delay, first hour and cursor.
func readScope(ctx context.Context, db pgdb.DB, id int64) (runScope, error) {
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

// metersByEvent reads the meters of client's account, by event name.
func (r *Reconciler) metersByEvent(ctx context.Context, client *stripeapi.Client) (map[string]stripeapi.Meter, error) {
	var meters []stripeapi.Meter
	if err := r.read(ctx, func() (err error) { meters, err = client.Meters(ctx); return err }); err != nil {
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
