package reconcile

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/outbox"
)

// A billing period is open until its end plus the invoice grace (the
// tenant mapping's invoice_grace, else Config.InvoiceGrace): Stripe
// finalizes the invoice then, and what it bills is final. While a key has
// items in an open period, every run reads every hour of that period again,
// confirmed or not, so that Stripe counting more (or less) than Tally after
// an hour was confirmed is a discrepancy. A closed period is not read again.

// span is a range of whole hours [from, to), Unix seconds.
type span struct{ from, to int64 }

// runKey is a key a run compares: settled when it has accepted items older
// than the settle delay or uncertain ones (SettledKey's Earliest and Latest
// are theirs), and the hours of its open billing periods up to the current
// one (open, ascending, not overlapping).
type runKey struct {
	outbox.SettledKey
	settled bool
	open    []span
}

// inOpen says whether hour h is in one of k's open periods.
func (k runKey) inOpen(h int64) bool {
	for _, s := range k.open {
		if h >= s.from && h < s.to {
			return true
		}
	}
	return false
}

// hours is the range of hours the run reads of key k: from the first
// hour of its settled items (not before sinceTS) and of its open periods
// to the end of the last; empty (from >= to) when there is nothing to read.
func (k runKey) hours(sinceTS int64) (from, to int64) {
	from, to = int64(1<<62), int64(-1<<62)
	if k.settled {
		from, to = max(k.Earliest-k.Earliest%hour, sinceTS), k.Latest-k.Latest%hour+hour
	}
	for _, s := range k.open {
		from, to = min(from, s.from), max(to, s.to)
	}
	return from, to
}

// maxOpenSpan is how long after its start a billing period can still be
// open: 31 days of period and Stripe's longest invoice grace, 72 hours.
// Periods that started earlier are closed under any grace.
const maxOpenSpan = "34 days"

// sqlOpenKeys lists, after a key and in byte order, the keys of the
// destination accounts and mode with a billing period still open by the
// database's clock: its end (tally_period_end, by the tenant's anchor)
// plus the tenant's invoice grace, else @grace, is still ahead. Each comes
// with its open periods as whole hours up to the current one (which is not
// over: the next run reads it), first hours and ends in two arrays of
// Unix seconds. It reads the recent rows of reconcile_key_periods alone
// (its period_start index: the bound is a subquery, evaluated once, so
// that the volatile clock can bound an index scan): its cost is the open
// keys', never history's.
const sqlOpenKeys = `
SELECT p.ordering_key, p.customer, p.event_name, p.destination_account,
       array_agg(floor(extract(epoch FROM p.period_start) / 3600)::bigint * 3600 ORDER BY p.period_start),
       array_agg(least(ceil(extract(epoch FROM e.period_end) / 3600)::bigint * 3600, c.hour) ORDER BY p.period_start)
FROM reconcile_key_periods p
LEFT JOIN tenant_mappings t ON t.tenant = p.tenant_key
CROSS JOIN LATERAL (SELECT tally_period_end(p.period_start, coalesce(t.period_anchor, '1970-01-01T00:00:00Z')) AS period_end) e
CROSS JOIN (SELECT floor(extract(epoch FROM clock_timestamp()) / 3600)::bigint * 3600 AS hour) c
WHERE p.period_start > (SELECT clock_timestamp() - interval '` + maxOpenSpan + `')
  AND p.destination_account = ANY(@accounts::text[]) AND p.mode = @mode
  AND p.ordering_key COLLATE "C" > @cursor
  AND e.period_end + coalesce(t.invoice_grace, @grace::interval) > clock_timestamp()
GROUP BY p.ordering_key, p.customer, p.event_name, p.destination_account
ORDER BY p.ordering_key COLLATE "C"`

// sqlPruneKeyPeriods forgets the periods no grace keeps open any more.
const sqlPruneKeyPeriods = `DELETE FROM reconcile_key_periods WHERE period_start <= (SELECT clock_timestamp() - interval '` + maxOpenSpan + `')`

// sqlKeyPeriods notes, in a key's commit, the billing periods of the key's
// items (tenant and period start) that are still open, so that later runs
// read the key while they are. One statement per key; a period noted
// already is left as it is.
const sqlKeyPeriods = `
INSERT INTO reconcile_key_periods (mode, ordering_key, tenant_key, period_start, destination_account, customer, event_name)
SELECT @mode, @key, p.tenant, p.period_start, @account, @customer, @event
FROM unnest(@tenants::text[], @periods::timestamptz[]) AS p(tenant, period_start)
LEFT JOIN tenant_mappings t ON t.tenant = p.tenant
WHERE tally_period_end(p.period_start, coalesce(t.period_anchor, '1970-01-01T00:00:00Z'))
      + coalesce(t.invoice_grace, @grace::interval) > clock_timestamp()
ON CONFLICT DO NOTHING`

// keysOf lists the keys run id compares after its cursor, in byte order:
// those with settled items (outbox.SettledKeys) and those with an open
// billing period (sqlOpenKeys), merged; a key with neither hours to read
// nor items to confirm is left out.
func (r *Reconciler) keysOf(ctx context.Context, db pgdb.DB, accounts []string, mode outbox.Mode, scope runScope) ([]runKey, error) {
	settled, err := r.cfg.Outbox.SettledKeys(ctx, db, outbox.KeyFilter{Accounts: accounts, Mode: mode,
		Settle: scope.settle, Since: scope.sinceTS, After: scope.cursor})
	if err != nil {
		return nil, err
	}
	if _, err := db.Exec(ctx, sqlPruneKeyPeriods); err != nil {
		return nil, fmt.Errorf("reconcile: forgetting closed periods: %w", err)
	}
	rows, err := db.Query(ctx, sqlOpenKeys, pgx.NamedArgs{"accounts": accounts, "mode": string(mode), "cursor": scope.cursor,
		"grace": r.cfg.InvoiceGrace})
	if err != nil {
		return nil, fmt.Errorf("reconcile: listing the keys of open periods: %w", err)
	}
	open, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (runKey, error) {
		var (
			k        runKey
			from, to []int64
		)
		if err := row.Scan(&k.OrderingKey, &k.Customer, &k.EventName, &k.Account, &from, &to); err != nil {
			return k, err
		}
		for i := range from {
			if s := (span{max(from[i], scope.sinceTS), to[i]}); s.from < s.to {
				k.open = append(k.open, s)
			}
		}
		k.open = mergeSpans(k.open)
		return k, nil
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: listing the keys of open periods: %w", err)
	}
	var keys []runKey
	for i, j := 0, 0; i < len(settled) || j < len(open); {
		switch {
		case j == len(open) || (i < len(settled) && settled[i].OrderingKey < open[j].OrderingKey):
			keys = append(keys, runKey{SettledKey: settled[i], settled: true})
			i++
		case i == len(settled) || open[j].OrderingKey < settled[i].OrderingKey:
			if len(open[j].open) > 0 {
				keys = append(keys, open[j])
			}
			j++
		default:
			keys = append(keys, runKey{SettledKey: settled[i], settled: true, open: open[j].open})
			i, j = i+1, j+1
		}
	}
	return keys, nil
}

// mergeSpans sorts spans and joins those that overlap or touch.
func mergeSpans(spans []span) []span {
	slices.SortFunc(spans, func(a, b span) int { return cmp.Compare(a.from, b.from) })
	var out []span
	for _, s := range spans {
		if n := len(out); n > 0 && s.from <= out[n-1].to {
			out[n-1].to = max(out[n-1].to, s.to)
			continue
		}
		out = append(out, s)
	}
	return out
}

// notePeriods runs sqlKeyPeriods for the billing periods of items, key k's
// in run's destination.
func (r *Reconciler) notePeriods(ctx context.Context, tx pgx.Tx, dest exporter.Destination, k outbox.SettledKey, periods map[keyPeriod]bool) error {
	if len(periods) == 0 {
		return nil
	}
	tenants, starts := make([]string, 0, len(periods)), make([]time.Time, 0, len(periods))
	for p := range periods {
		tenants, starts = append(tenants, p.tenant), append(starts, p.start)
	}
	if _, err := tx.Exec(ctx, sqlKeyPeriods, pgx.NamedArgs{"mode": string(dest.Mode), "key": k.OrderingKey,
		"account": k.Account, "customer": k.Customer, "event": k.EventName, "tenants": tenants, "periods": starts,
		"grace": r.cfg.InvoiceGrace}); err != nil {
		return fmt.Errorf("reconcile: noting the key's open periods: %w", err)
	}
	return nil
}

// keyPeriod is a billing period of a key's items: whose, and its start.
type keyPeriod struct {
	tenant string
	start  time.Time
}
