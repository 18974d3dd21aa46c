package quarantine

import (
	"context"
	"encoding/csv"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/reconcile"
)

// Bucket is the usage of one state: how many ledger events, and their value.
type Bucket struct {
	Events int64 `json:"events"`
	Value  Value `json:"value"`
}

// Line is one tenant, feature and billing period of the completeness report.
type Line struct {
	Tenant  string `json:"tenant"`
	Feature string `json:"feature"`
	// Period is the start of the billing period (RFC 3339).
	Period string `json:"period"`
	// Accounts are the Stripe accounts the line's items were staged for,
	// sorted: the node's destination, or the tenant mapping's connected
	// account (Stripe Connect); two when the tenant moved during the
	// period, none while nothing is staged.
	Accounts []string `json:"destination_accounts"`
	// Ingested is every usage event of the period in the ledger.
	Ingested Bucket `json:"ingested"`
	// The buckets, by the state of the item that carries each event now
	// (after any re-addressing). Pending includes leased items and events
	// not yet staged.
	Confirmed   Bucket `json:"confirmed"`
	Accepted    Bucket `json:"accepted"`
	Pending     Bucket `json:"pending"`
	Quarantined Bucket `json:"quarantined"`
	Uncertain   Bucket `json:"uncertain"`
	Rejected    Bucket `json:"rejected"`
	// Cancelled is the usage whose event was cancelled (meter.Cancel),
	// whatever the outcome: withdrawn before any attempt could reach
	// Stripe (in no item that is or will be sent), taken back by an
	// adjustment or a supplement, or refused (a cancellation item
	// quarantined for finance). How each take-back stands is its own
	// item's state, not a part of this line.
	Cancelled Bucket `json:"cancelled"`
	// Unstaged is the part of Pending not yet staged into an item.
	Unstaged Bucket `json:"unstaged"`
	// PeriodClosed is the usage, whatever its state, of items staged after
	// their billing period's invoice closed (the period's end plus the
	// invoice grace): quarantined period_closed, or sent knowingly or under
	// TALLY_LATE_USAGE=send, when Stripe records it on no finalized invoice.
	// A part of the buckets above, not one more.
	PeriodClosed Bucket `json:"period_closed"`
	// InconsistentItems counts items whose value is not the reduction of the
	// events they carry (a sum, the last value, or the event's own value).
	InconsistentItems int64 `json:"inconsistent_items"`
	// Discrepancies counts the open discrepancies (of any reconcile run:
	// unresolved, and not cleared by a later run) that involve this line's
	// usage: hours where Stripe's numbers differ from Tally's, and keys
	// whose summaries Stripe refused. Their accepted items stay accepted
	// until finance resolves them.
	Discrepancies int64 `json:"discrepancies"`
	// DiscrepanciesStripeHasMore counts those where Stripe has more than
	// Tally: the customer may be billed too much.
	DiscrepanciesStripeHasMore int64 `json:"discrepancies_stripe_has_more"`
	// Holds is the conservation identity: ingested = confirmed + accepted +
	// pending + quarantined + uncertain + rejected + cancelled, in events
	// and in value, and every item consistent with its events.
	Holds bool `json:"holds"`
}

// Completeness is the completeness report of one month's periods.
type Completeness struct {
	Period string `json:"period"`
	Lines  []Line `json:"lines"`
	// ReconcileRun is the latest reconcile run that succeeded, for
	// reference (the lines count the open discrepancies of every run); nil
	// before the first.
	ReconcileRun *int64 `json:"reconcile_run"`
	// Holds is true when every line holds.
	Holds bool `json:"holds"`
	// AsOf is when the report's snapshot was taken, by the database's
	// clock (RFC 3339, UTC): it counts everything committed before then.
	// Reports sets it; CompletenessOf, which reads the ledger now, leaves
	// it empty.
	AsOf string `json:"as_of,omitempty"`
	// Archived is true when the month's ledger has left the database: the
	// report is its verified archive's manifest (Reports.Archived).
	Archived bool `json:"archived,omitempty"`
}

// sqlCompleteness attributes every ledger event of the periods starting in
// [@from, @to) to the state of the item that carries it now. A staged event's
// period is its item's; an unstaged one's is computed from its tenant's
// current anchor. Every event falls in exactly one bucket by construction;
// what can break the identity is an event whose item cannot be followed to a
// live one ("missing": counted in no bucket) or an item whose value is not
// the reduction of its events (InconsistentItems).
//
// Its cost is linear in the month's events and items, whatever plan the
// planner picks from statistics that have not seen the month (a fresh
// month's rows are believed few until the next ANALYZE) or that believe it
// larger than it is:
//   - it runs with nested loops off (CompletenessOf's SET LOCAL), so that
//     no join of two of its parts can be planned as a loop that reads one
//     part once per row of the other: quadratic in the month. The LATERAL
//     subqueries below can only be nested loops, and still are: each reads
//     one index entry a row, or none;
//   - an item's state and body are read as one range of the primary key
//     ("span": from the month's smallest item to its largest) and hashed
//     with the month's items. A month's items are, but for stragglers, a
//     contiguous run of ids (an item is made when its events are staged),
//     so the range holds little else; when it holds more than four times
//     the month's items plus 256, the range is empty and every item is
//     read by a probe of the primary key instead ("near" found nothing), as
//     is an item outside the range (a successor made later). One range
//     read costs what it costs beside any history; a probe an item paid a
//     B-tree descent in a 5-million-row table each, twice an item: the
//     report took 1.19–1.25× its time on an empty database beside 20
//     million ledger rows that way (docs/performance.md, "One range of
//     items, nested loops off"). Never a join without the range: once
//     ANALYZE had seen the month, the planner estimated 15,618 events
//     where there were 400 and merged the month's 100 items with all
//     500,100 states, read in key order: 0.45–0.63 s beside 2 million
//     ledger rows, against 13 ms on an empty database (without JIT, which
//     sessions turn off: internal/pgsession; "Measured once analysed");
//   - the month's events are grouped by the item that carries them first,
//     so that each item is read once, not once per event; a tenant's period
//     anchor is read only for an event not yet staged. The latest event's
//     value is the greatest array of (microsecond, id, value), a plain
//     aggregate that hashes: an ordered one (array_agg … ORDER BY) makes
//     the grouping sort the whole month first;
//   - "chain" follows all the month's items to the ends of their chains of
//     successors in one recursive scan, carrying each item's group along,
//     so nothing has to be joined back to it;
//     most items have no successor, and their period and value come from
//     one body row ("live"); the body of the item the events name is read
//     only for a superseded one;
//   - a line's ingested total is a window sum over its buckets, not a join
//     of two aggregates (the same quadratic join: 1.5 ms of a 4.5 ms report
//     of 100 lines, measured);
//   - the aggregation in force for an item's mapping version is looked up
//     once per feature and version among the month's items, not once per
//     item ("aggregations", one row: a jsonb object an item reads its own
//     key of). A lookup per item (a LATERAL join) cost 1–4 µs an item,
//     whichever plan the planner chose for the small versions table: 1.8
//     ms of a 10.9 ms report of 600 items beside history (EXPLAIN
//     ANALYZE, docs/performance.md), and a join of the items with a set
//     of pairs could be planned as the nested loop above.
//
// Measured beside 2 million ledger rows of history (BenchmarkHistory's
// fixture, 400 events in 100 items this month, 31 interleaved runs): 6.8 ms
// before these changes, 3.8 ms after; 5.7 and 3.6 ms on an empty database.
const sqlCompleteness = `
WITH RECURSIVE ev AS (
    SELECT e.id, e.tenant, e.feature, e.value, e.occurred_at, e.item_id,
           CASE WHEN e.cancelled_at IS NOT NULL
                THEN coalesce((SELECT c.outcome FROM usage_cancellations c WHERE c.event_row = e.id), 'withdrawn') END AS cancel,
           CASE WHEN e.item_id IS NULL THEN tally_period_start(e.occurred_at,
               coalesce((SELECT t.period_anchor FROM tenant_mappings t WHERE t.tenant = e.tenant), '1970-01-01T00:00:00Z'))
           END AS unstaged_period
    FROM usage_events e
    WHERE e.occurred_at >= @from AND e.occurred_at < @to::timestamptz + interval '32 days'
      AND (@tenant = '' OR e.tenant = @tenant)
),
grouped AS MATERIALIZED (
    SELECT tenant, feature, item_id, unstaged_period, coalesce(cancel = 'withdrawn', false) AS gone, count(*) AS n, sum(value) AS v,
           (max(ARRAY[(extract(epoch FROM occurred_at) * 1000000)::bigint, id, value]))[3] AS last_value,
           count(*) FILTER (WHERE cancel IS NOT NULL) AS cn, coalesce(sum(value) FILTER (WHERE cancel IS NOT NULL), 0) AS cv
    FROM ev GROUP BY 1, 2, 3, 4, 5
),
span AS MATERIALIZED (
    SELECT lo, CASE WHEN hi - lo < 4 * n + 256 THEN hi ELSE lo - 1 END AS hi
    FROM (SELECT min(item_id) AS lo, max(item_id) AS hi, count(item_id) AS n FROM grouped) m
),
chain (tenant, feature, start, n, v, last_value, cn, cv, id, next, state, depth) AS (
    SELECT g.tenant, g.feature, g.item_id, g.n, g.v, g.last_value, g.cn, g.cv, s.id, s.superseded_by, s.state, 0
    FROM grouped g
    LEFT JOIN outbox_item_states near ON near.id = g.item_id
        AND near.id BETWEEN (SELECT lo FROM span) AND (SELECT hi FROM span)
    CROSS JOIN LATERAL (SELECT near.id, near.superseded_by, near.state WHERE near.id IS NOT NULL
                        UNION ALL
                        SELECT s.id, s.superseded_by, s.state FROM outbox_item_states s WHERE near.id IS NULL AND s.id = g.item_id) s
    WHERE NOT g.gone
    UNION ALL
    SELECT c.tenant, c.feature, c.start, c.n, c.v, c.last_value, c.cn, c.cv, s.id, s.superseded_by, s.state, c.depth + 1
    FROM chain c
    CROSS JOIN LATERAL (SELECT s.id, s.superseded_by, s.state FROM outbox_item_states s WHERE s.id = c.next LIMIT 1) s
    WHERE c.depth < 1000
),
per_item AS (
    SELECT c.tenant, c.feature, c.start AS item_id, c.n, c.v, c.last_value, c.cn, c.cv, c.state,
           live.subject_kind, live.mapping_version, (live.payload ->> 'value')::numeric AS live_value, live.destination_account,
           coalesce((live.payload ->> 'late')::boolean, false) AS late,
           (CASE WHEN c.id = c.start THEN live.payload ->> 'period'
                 ELSE (SELECT b.payload ->> 'period' FROM outbox_item_bodies b WHERE b.id = c.start) END)::timestamptz AS period
    FROM chain c
    LEFT JOIN outbox_item_bodies near ON near.id = c.id
        AND near.id BETWEEN (SELECT lo FROM span) AND (SELECT hi FROM span)
    CROSS JOIN LATERAL (SELECT near.subject_kind, near.mapping_version, near.payload, near.destination_account
                        WHERE near.id IS NOT NULL
                        UNION ALL
                        SELECT b.subject_kind, b.mapping_version, b.payload, b.destination_account
                        FROM outbox_item_bodies b WHERE near.id IS NULL AND b.id = c.id) live
    WHERE c.next IS NULL
    UNION ALL
    SELECT g.tenant, g.feature, g.item_id, g.n, g.v, g.last_value, 0, 0,
           CASE WHEN g.gone THEN 'cancelled' WHEN g.item_id IS NULL THEN 'unstaged' ELSE 'missing' END,
           NULL, NULL, NULL, NULL, false,
           CASE WHEN g.item_id IS NULL THEN g.unstaged_period
                ELSE (SELECT (b.payload ->> 'period')::timestamptz FROM outbox_item_bodies b WHERE b.id = g.item_id) END
    FROM grouped g
    WHERE g.gone OR g.item_id IS NULL OR NOT EXISTS (SELECT FROM chain c WHERE c.start = g.item_id AND c.next IS NULL)
),
aggregations AS (
    SELECT coalesce(jsonb_object_agg(k.feature || '@' || k.mapping_version,
               (SELECT fv.aggregation FROM feature_mapping_versions fv
                WHERE fv.feature = k.feature AND fv.version <= k.mapping_version
                ORDER BY fv.version DESC LIMIT 1)), '{}') AS of
    FROM (SELECT DISTINCT feature, mapping_version FROM per_item WHERE mapping_version IS NOT NULL) k
),
resolved AS (
    SELECT p.tenant, p.feature, p.period, p.state, p.n, p.v, p.cn, p.cv, p.late, p.destination_account,
           CASE
             WHEN p.subject_kind IS NULL THEN true
             WHEN p.subject_kind = 'usage_event' THEN p.live_value = p.v AND p.n = 1
             WHEN (SELECT of FROM aggregations) ->> (p.feature || '@' || p.mapping_version) = 'last'
               THEN p.live_value = p.last_value
             ELSE p.live_value = p.v
           END AS consistent
    FROM per_item p
    WHERE p.period >= @from AND p.period < @to
),
buckets AS (
    SELECT tenant, feature, period, state, sum(n - cn) AS n, sum(v - cv) AS v, count(*) FILTER (WHERE NOT consistent) AS bad,
           coalesce(sum(n - cn) FILTER (WHERE late), 0) AS late_n, coalesce(sum(v - cv) FILTER (WHERE late), 0) AS late_v,
           coalesce(array_agg(DISTINCT destination_account) FILTER (WHERE destination_account IS NOT NULL), '{}') AS accounts
    FROM resolved GROUP BY 1, 2, 3, 4
    UNION ALL
    SELECT tenant, feature, period, 'cancelled', sum(cn), sum(cv), 0, 0, 0, '{}'
    FROM resolved WHERE cn > 0 GROUP BY 1, 2, 3
)
SELECT tenant, feature, period,
       (sum(n) OVER line)::bigint, (sum(v) OVER line)::text, state, n::bigint, v::text, bad, late_n::bigint, late_v::text, accounts
FROM buckets
WINDOW line AS (PARTITION BY tenant, feature, period)
ORDER BY 1, 2, 3, 6`

// sqlNoNestedLoops keeps the planner from joining by nested loops for the
// rest of the (sub)transaction; see sqlCompleteness.
const sqlNoNestedLoops = `SET LOCAL enable_nestloop = off`

// sqlFullWorkMem lets the full computation group a month's events by item
// in memory (a hash of the month's items) rather than sort the month on
// disk. It is one statement a night or an operator's command, never a
// request's.
const sqlFullWorkMem = `SET LOCAL work_mem = '512MB'`

// LedgerCompletenessOf computes the completeness report for the billing
// periods that start in the month period ("YYYY-MM"), for one tenant or
// all, from the ledger and the outbox: the full computation, whose cost
// grows with the month's events. It is the auditor of the counters that
// CompletenessOf reads (Audit), never what a request is answered from.
func LedgerCompletenessOf(ctx context.Context, q pgdb.Beginner, period, tenant string) (Completeness, error) {
	from, to, err := ParsePeriod(period)
	if err != nil {
		return Completeness{}, err
	}
	c := Completeness{Period: period, Lines: []Line{}, Holds: true}
	index, err := c.readLines(ctx, q, from, to, tenant)
	if err != nil {
		return Completeness{}, fmt.Errorf("quarantine: reading completeness: %w", err)
	}
	return c.finish(ctx, q, from, to, tenant, index)
}

// finish counts each line's discrepancies and decides whether each line,
// and the report, holds.
func (c Completeness) finish(ctx context.Context, q pgdb.Querier, from, to time.Time, tenant string, index map[[3]string]int) (Completeness, error) {
	if err := c.addDiscrepancies(ctx, q, from, to, tenant, index); err != nil {
		return Completeness{}, err
	}
	for i := range c.Lines {
		l := &c.Lines[i]
		sum := Bucket{}
		for _, b := range []Bucket{l.Confirmed, l.Accepted, l.Pending, l.Quarantined, l.Uncertain, l.Rejected, l.Cancelled} {
			sum = add(sum, b)
		}
		l.Holds = sum.Events == l.Ingested.Events && sum.Value.Cmp(l.Ingested.Value) == 0 && l.InconsistentItems == 0
		c.Holds = c.Holds && l.Holds
	}
	return c, nil
}

// readLines runs sqlCompleteness and adds its rows to c's lines, which it
// indexes by tenant, feature and period. The statement runs in a
// transaction of its own, or a savepoint of the caller's, that turns
// nested loops off and is always rolled back: rolling back is what undoes
// SET LOCAL in a savepoint (releasing it would keep the setting for the
// rest of the caller's transaction), and the report writes nothing.
func (c *Completeness) readLines(ctx context.Context, q pgdb.Beginner, from, to time.Time, tenant string) (map[[3]string]int, error) {
	tx, err := q.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for _, set := range []string{sqlNoNestedLoops, sqlFullWorkMem} {
		if _, err := tx.Exec(ctx, set); err != nil {
			return nil, err
		}
	}
	// Planned for this month's bounds every time (an unnamed statement), not
	// by a cached generic plan: a month is 400 events or 40 million, and
	// only the bounds tell the planner which (see sqlCompleteness).
	rows, err := tx.Query(ctx, sqlCompleteness, pgx.QueryExecModeExec, pgx.NamedArgs{"from": from, "to": to, "tenant": tenant})
	if err != nil {
		return nil, err
	}
	var (
		tenantName, feature, state string
		ingN, n, bad, lateN        int64
		ingV, v, lateV             Value
		per                        time.Time
		accounts                   []string
	)
	index := map[[3]string]int{}
	if _, err := pgx.ForEachRow(rows, []any{&tenantName, &feature, &per, &ingN, &ingV, &state, &n, &v, &bad, &lateN, &lateV, &accounts}, func() error {
		perText := per.UTC().Format(time.RFC3339)
		key := [3]string{tenantName, feature, perText}
		i, ok := index[key]
		if !ok {
			i = len(c.Lines)
			index[key] = i
			c.Lines = append(c.Lines, Line{Tenant: tenantName, Feature: feature, Period: perText, Accounts: []string{},
				Ingested: Bucket{Events: ingN, Value: ingV}})
		}
		l := &c.Lines[i]
		for _, a := range accounts {
			if !slices.Contains(l.Accounts, a) {
				l.Accounts = append(l.Accounts, a)
			}
		}
		slices.Sort(l.Accounts)
		b := Bucket{Events: n, Value: v}
		switch state {
		case "confirmed":
			l.Confirmed = add(l.Confirmed, b)
		case "accepted":
			l.Accepted = add(l.Accepted, b)
		case "pending", "leased":
			l.Pending = add(l.Pending, b)
		case "unstaged":
			l.Pending, l.Unstaged = add(l.Pending, b), add(l.Unstaged, b)
		case "quarantined":
			l.Quarantined = add(l.Quarantined, b)
		case "uncertain":
			l.Uncertain = add(l.Uncertain, b)
		case "rejected":
			l.Rejected = add(l.Rejected, b)
		case "cancelled":
			l.Cancelled = add(l.Cancelled, b)
		default:
			// superseded cannot be live; anything else breaks the identity below
		}
		l.InconsistentItems += bad
		l.PeriodClosed = add(l.PeriodClosed, Bucket{Events: lateN, Value: lateV})
		return nil
	}); err != nil {
		return nil, err
	}
	return index, nil
}

// addDiscrepancies counts on each line the open discrepancies that involve
// its usage, and names the latest succeeded reconcile run.
func (c *Completeness) addDiscrepancies(ctx context.Context, q pgdb.Querier, from, to time.Time, tenant string, index map[[3]string]int) error {
	run, ok, err := reconcile.LatestSucceeded(ctx, q)
	if err != nil {
		return err
	}
	if ok {
		c.ReconcileRun = &run
	}
	per, err := reconcile.DiscrepanciesByPeriod(ctx, q, from, to, tenant)
	if err != nil {
		return err
	}
	for _, d := range per {
		if i, ok := index[[3]string{d.Tenant, d.Feature, d.Period.UTC().Format(time.RFC3339)}]; ok {
			c.Lines[i].Discrepancies += d.Hours
			c.Lines[i].DiscrepanciesStripeHasMore += d.StripeHasMore
		}
	}
	return nil
}

func add(a, b Bucket) Bucket {
	return Bucket{Events: a.Events + b.Events, Value: a.Value.Plus(b.Value)}
}

// completenessColumns are the CSV's columns: each bucket as events and
// value.
var completenessColumns = []string{"tenant", "feature", "period", "destination_accounts",
	"ingested_events", "ingested_value", "confirmed_events", "confirmed_value", "accepted_events", "accepted_value",
	"pending_events", "pending_value", "quarantined_events", "quarantined_value", "uncertain_events", "uncertain_value",
	"rejected_events", "rejected_value", "cancelled_events", "cancelled_value", "unstaged_events", "unstaged_value",
	"period_closed_events", "period_closed_value", "inconsistent_items", "discrepancies", "discrepancies_stripe_has_more",
	"holds", "as_of"}

// CSV writes the report's lines as CSV, one row a tenant, feature and
// period with its destination accounts (space-separated), every bucket as events and value, and the snapshot's as_of on
// every row (a spreadsheet keeps it beside the numbers); every text cell is
// safe against spreadsheet formula injection.
func (c Completeness) CSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	_ = cw.Write(completenessColumns)
	for _, l := range c.Lines {
		row := []string{SafeCell(l.Tenant), SafeCell(l.Feature), SafeCell(l.Period), SafeCell(strings.Join(l.Accounts, " "))}
		for _, b := range []Bucket{l.Ingested, l.Confirmed, l.Accepted, l.Pending, l.Quarantined, l.Uncertain, l.Rejected, l.Cancelled, l.Unstaged, l.PeriodClosed} {
			row = append(row, strconv.FormatInt(b.Events, 10), b.Value.String())
		}
		row = append(row, strconv.FormatInt(l.InconsistentItems, 10), strconv.FormatInt(l.Discrepancies, 10),
			strconv.FormatInt(l.DiscrepanciesStripeHasMore, 10), strconv.FormatBool(l.Holds), SafeCell(c.AsOf))
		_ = cw.Write(row)
	}
	cw.Flush()
	return cw.Error()
}

// Table writes the report for a terminal.
func (c Completeness) Table(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "TENANT\tFEATURE\tPERIOD\tINGESTED\tCONFIRMED\tACCEPTED\tPENDING\tQUARANTINED\tUNCERTAIN\tREJECTED\tCANCELLED\tPERIOD CLOSED\tDISCREPANCIES\tSTRIPE HAS MORE\tHOLDS\t")
	for _, l := range c.Lines {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%v\t\n", l.Tenant, l.Feature, l.Period,
			l.Ingested.Value, l.Confirmed.Value, l.Accepted.Value, l.Pending.Value, l.Quarantined.Value,
			l.Uncertain.Value, l.Rejected.Value, l.Cancelled.Value, l.PeriodClosed.Value, l.Discrepancies,
			l.DiscrepanciesStripeHasMore, l.Holds)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if c.AsOf != "" {
		_, err := fmt.Fprintf(w, "as of %s\n", c.AsOf)
		return err
	}
	return nil
}
