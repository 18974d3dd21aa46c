package quarantine

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// sqlCounters reads the month's completeness counters: one row per line and
// destination account, the slots summed. Its cost grows with the month's
// keys (tenants × features × accounts × slots written), not with its
// events: the primary key's range on period.
//
// The counters are written by triggers in the transaction of every write
// that moves usage (docs/reports.md), and by the tenant mapping's writer
// when a distributed database has no anchor trigger.
//
// It reads every tenant's counters: on a distributed database every
// shard's, grouped there and merged on the coordinator (O(counter rows),
// never the ledger). sqlTenantCounters reads one tenant's.
const sqlCounters = `
SELECT tenant, feature, period, account,
       sum(ingested_events)::bigint, sum(ingested_value)::text,
       sum(confirmed_events)::bigint, sum(confirmed_value)::text,
       sum(accepted_events)::bigint, sum(accepted_value)::text,
       sum(pending_events)::bigint, sum(pending_value)::text,
       sum(unstaged_events)::bigint, sum(unstaged_value)::text,
       sum(quarantined_events)::bigint, sum(quarantined_value)::text,
       sum(uncertain_events)::bigint, sum(uncertain_value)::text,
       sum(rejected_events)::bigint, sum(rejected_value)::text,
       sum(cancelled_events)::bigint, sum(cancelled_value)::text,
       sum(period_closed_events)::bigint, sum(period_closed_value)::text,
       sum(items)::bigint, sum(inconsistent)::bigint
FROM completeness_counters
WHERE period >= @from AND period < @to
GROUP BY tenant, feature, period, account
ORDER BY tenant, feature, period, account`

// sqlTenantCounters is sqlCounters for one tenant. Its bucket names its
// shard on a distributed database; on one server it is one more equality
// on a column of the primary key, whose range on period it reads.
var sqlTenantCounters = strings.Replace(sqlCounters, "WHERE period >= @from AND period < @to",
	"WHERE period >= @from AND period < @to AND tenant = @tenant AND bucket = @bucket", 1)

// CompletenessOf reads the completeness report for the billing periods that
// start in the month period ("YYYY-MM"), for one tenant or all, from the
// completeness counters: O(keys), whatever the month's volume. It answers
// what LedgerCompletenessOf computes from the ledger (Audit compares the
// two): a line's buckets, accounts and inconsistent items as the triggers
// keep them, and it holds when the ingested counter equals the sum of the
// buckets and no item is inconsistent.
func CompletenessOf(ctx context.Context, q pgdb.Beginner, period, tenant string) (Completeness, error) {
	from, to, err := ParsePeriod(period)
	if err != nil {
		return Completeness{}, err
	}
	c := Completeness{Period: period, Lines: []Line{}, Holds: true}
	index, err := c.readCounters(ctx, q, from, to, tenant)
	if err != nil {
		return Completeness{}, fmt.Errorf("quarantine: reading the completeness counters: %w", err)
	}
	return c.finish(ctx, q, from, to, tenant, index)
}

// readCounters runs sqlCounters and adds its rows to c's lines, which it
// indexes by tenant, feature and period. A line is every counter row of
// its key; an account is listed while an item with usage has it.
func (c *Completeness) readCounters(ctx context.Context, q pgdb.Querier, from, to time.Time, tenant string) (map[[3]string]int, error) {
	sql, args := sqlCounters, pgx.NamedArgs{"from": from, "to": to}
	if tenant != "" {
		sql, args["tenant"], args["bucket"] = sqlTenantCounters, tenant, tenantbucket.Of(tenant)
	}
	rows, err := q.Query(ctx, sql, args)
	if err != nil {
		return nil, err
	}
	var (
		tenantName, feature, account string
		per                          time.Time
		b                            [10]Bucket // ingested, the buckets, unstaged, period closed
		items, bad                   int64
	)
	dest := []any{&tenantName, &feature, &per, &account}
	for i := range b {
		dest = append(dest, &b[i].Events, &b[i].Value)
	}
	dest = append(dest, &items, &bad)
	index := map[[3]string]int{}
	if _, err := pgx.ForEachRow(rows, dest, func() error {
		if items == 0 && bad == 0 && allZero(b[:]) {
			return nil // a row whose usage moved away
		}
		perText := per.UTC().Format(time.RFC3339)
		key := [3]string{tenantName, feature, perText}
		i, ok := index[key]
		if !ok {
			i = len(c.Lines)
			index[key] = i
			c.Lines = append(c.Lines, Line{Tenant: tenantName, Feature: feature, Period: perText, Accounts: []string{}})
		}
		l := &c.Lines[i]
		if items > 0 && !slices.Contains(l.Accounts, account) {
			l.Accounts = append(l.Accounts, account)
			slices.Sort(l.Accounts)
		}
		for i, to := range []*Bucket{&l.Ingested, &l.Confirmed, &l.Accepted, &l.Pending, &l.Unstaged, &l.Quarantined,
			&l.Uncertain, &l.Rejected, &l.Cancelled, &l.PeriodClosed} {
			if !allZero(b[i : i+1]) {
				*to = add(*to, b[i])
			}
		}
		if !allZero(b[4:5]) {
			l.Pending = add(l.Pending, b[4]) // unstaged is a part of pending
		}
		l.InconsistentItems += bad
		return nil
	}); err != nil {
		return nil, err
	}
	return index, nil
}

func allZero(bs []Bucket) bool {
	for _, b := range bs {
		if b.Events != 0 || b.Value.int().Sign() != 0 {
			return false
		}
	}
	return true
}
