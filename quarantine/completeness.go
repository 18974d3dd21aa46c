package quarantine

import (
	"context"
	"encoding/csv"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

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
	// Unstaged is the part of Pending not yet staged into an item.
	Unstaged Bucket `json:"unstaged"`
	// InconsistentItems counts items whose value is not the reduction of the
	// events they carry (a sum, the last value, or the event's own value).
	InconsistentItems int64 `json:"inconsistent_items"`
	// Discrepancies counts the hours of this line's items where the latest
	// finished reconcile run found Stripe's numbers different from Tally's
	// (see ReconcileRun): their items stay accepted until it is resolved.
	Discrepancies int64 `json:"discrepancies"`
	// Holds is the conservation identity: ingested = confirmed + accepted +
	// pending + quarantined + uncertain + rejected, in events and in value,
	// and every item consistent with its events.
	Holds bool `json:"holds"`
}

// Completeness is the completeness report of one month's periods.
type Completeness struct {
	Period string `json:"period"`
	Lines  []Line `json:"lines"`
	// ReconcileRun is the latest finished reconcile run, whose
	// discrepancies the lines count; nil before the first.
	ReconcileRun *int64 `json:"reconcile_run"`
	// Holds is true when every line holds.
	Holds bool `json:"holds"`
	// AsOf is when the report's snapshot was taken, by the database's
	// clock (RFC 3339, UTC): it counts everything committed before then.
	// Reports sets it; CompletenessOf, which reads the ledger now, leaves
	// it empty.
	AsOf string `json:"as_of,omitempty"`
}

// sqlCompleteness attributes every ledger event of the periods starting in
// [@from, @to) to the state of the item that carries it now. A staged event's
// period is its item's; an unstaged one's is computed from its tenant's
// current anchor. Every event falls in exactly one bucket by construction;
// what can break the identity is an event whose item cannot be followed to a
// live one ("missing": counted in no bucket) or an item whose value is not
// the reduction of its events (InconsistentItems). "resolved" is
// MATERIALIZED: inlined, it was run again for every line of "ingested"
// whenever the planner believed the month's ledger rows few (fresh rows,
// not yet analyzed: every month's first report) — 110 lines × 150 items,
// each following its item's chain, 200 ms for 450 events. An event's
// period is read from its item's body alone (outbox_item_bodies, what never
// changes), not through the outbox_items view, whose join would probe the
// state table too for every event: a third of the report's buffers.
const sqlCompleteness = `
WITH ev AS (
    SELECT e.id, e.tenant, e.feature, e.value, e.occurred_at, e.item_id,
           coalesce((root.payload ->> 'period')::timestamptz,
                    tally_period_start(e.occurred_at, coalesce(t.period_anchor, '1970-01-01T00:00:00Z'))) AS period
    FROM usage_events e
    LEFT JOIN tenant_mappings t ON t.tenant = e.tenant
    LEFT JOIN outbox_item_bodies root ON root.id = e.item_id
    WHERE e.occurred_at >= @from AND e.occurred_at < @to::timestamptz + interval '32 days'
      AND (@tenant = '' OR e.tenant = @tenant)
),
in_period AS (SELECT * FROM ev WHERE period >= @from AND period < @to),
per_item AS (
    SELECT tenant, feature, period, item_id, count(*) AS n, sum(value) AS v,
           (array_agg(value ORDER BY occurred_at DESC, id DESC))[1] AS last_value
    FROM in_period GROUP BY 1, 2, 3, 4
),
resolved AS MATERIALIZED (
    SELECT p.*, CASE WHEN p.item_id IS NULL THEN 'unstaged' ELSE coalesce(live.state, 'missing') END AS state,
           CASE
             WHEN live.id IS NULL THEN true
             WHEN live.subject_kind = 'usage_event' THEN (live.payload ->> 'value')::numeric = p.v AND p.n = 1
             WHEN agg.aggregation = 'last' THEN (live.payload ->> 'value')::numeric = p.last_value
             ELSE (live.payload ->> 'value')::numeric = p.v
           END AS consistent
    FROM per_item p
    LEFT JOIN outbox_items live ON live.id = tally_live_item(p.item_id)
    LEFT JOIN LATERAL (
        SELECT aggregation FROM feature_mapping_versions fv
        WHERE fv.feature = p.feature AND fv.version <= live.mapping_version
        ORDER BY fv.version DESC LIMIT 1
    ) agg ON true
),
ingested AS (
    SELECT tenant, feature, period, count(*) AS n, sum(value) AS v FROM in_period GROUP BY 1, 2, 3
)
SELECT i.tenant, i.feature, i.period, i.n, i.v::text,
       coalesce(r.state, 'missing'), coalesce(sum(r.n), 0), coalesce(sum(r.v), 0)::text, count(*) FILTER (WHERE NOT r.consistent)
FROM ingested i
LEFT JOIN resolved r ON (r.tenant, r.feature, r.period) = (i.tenant, i.feature, i.period)
GROUP BY i.tenant, i.feature, i.period, i.n, i.v, r.state
ORDER BY 1, 2, 3, 6`

// CompletenessOf reads the completeness report for the billing periods that
// start in the month period ("YYYY-MM"), for one tenant or all.
func CompletenessOf(ctx context.Context, q Querier, period, tenant string) (Completeness, error) {
	from, to, err := ParsePeriod(period)
	if err != nil {
		return Completeness{}, err
	}
	rows, err := q.Query(ctx, sqlCompleteness, pgx.NamedArgs{"from": from, "to": to, "tenant": tenant})
	if err != nil {
		return Completeness{}, fmt.Errorf("quarantine: reading completeness: %w", err)
	}
	c := Completeness{Period: period, Lines: []Line{}, Holds: true}
	var (
		tenantName, feature, state string
		ingN, n, bad               int64
		ingV, v                    Value
		per                        time.Time
	)
	index := map[[3]string]int{}
	if _, err := pgx.ForEachRow(rows, []any{&tenantName, &feature, &per, &ingN, &ingV, &state, &n, &v, &bad}, func() error {
		perText := per.UTC().Format(time.RFC3339)
		key := [3]string{tenantName, feature, perText}
		i, ok := index[key]
		if !ok {
			i = len(c.Lines)
			index[key] = i
			c.Lines = append(c.Lines, Line{Tenant: tenantName, Feature: feature, Period: perText,
				Ingested: Bucket{Events: ingN, Value: ingV}})
		}
		l := &c.Lines[i]
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
		default:
			// superseded cannot be live; anything else breaks the identity below
		}
		l.InconsistentItems += bad
		return nil
	}); err != nil {
		return Completeness{}, fmt.Errorf("quarantine: reading completeness: %w", err)
	}
	if err := c.addDiscrepancies(ctx, q, from, to, tenant, index); err != nil {
		return Completeness{}, err
	}
	for i := range c.Lines {
		l := &c.Lines[i]
		sum := Bucket{}
		for _, b := range []Bucket{l.Confirmed, l.Accepted, l.Pending, l.Quarantined, l.Uncertain, l.Rejected} {
			sum = add(sum, b)
		}
		l.Holds = sum.Events == l.Ingested.Events && sum.Value.Cmp(l.Ingested.Value) == 0 && l.InconsistentItems == 0
		c.Holds = c.Holds && l.Holds
	}
	return c, nil
}

// addDiscrepancies counts on each line the discrepancy hours of the latest
// succeeded reconcile run that involve its items, and names the run.
func (c *Completeness) addDiscrepancies(ctx context.Context, q Querier, from, to time.Time, tenant string, index map[[3]string]int) error {
	run, ok, err := reconcile.LatestSucceeded(ctx, q)
	if err != nil || !ok {
		return err
	}
	c.ReconcileRun = &run
	per, err := reconcile.DiscrepanciesByPeriod(ctx, q, run, from, to, tenant)
	if err != nil {
		return err
	}
	for _, d := range per {
		if i, ok := index[[3]string{d.Tenant, d.Feature, d.Period.UTC().Format(time.RFC3339)}]; ok {
			c.Lines[i].Discrepancies += d.Hours
		}
	}
	return nil
}

func add(a, b Bucket) Bucket {
	return Bucket{Events: a.Events + b.Events, Value: a.Value.Plus(b.Value)}
}

// completenessColumns are the CSV's columns: each bucket as events and
// value.
var completenessColumns = []string{"tenant", "feature", "period",
	"ingested_events", "ingested_value", "confirmed_events", "confirmed_value", "accepted_events", "accepted_value",
	"pending_events", "pending_value", "quarantined_events", "quarantined_value", "uncertain_events", "uncertain_value",
	"rejected_events", "rejected_value", "unstaged_events", "unstaged_value",
	"inconsistent_items", "discrepancies", "holds", "as_of"}

// CSV writes the report's lines as CSV, one row a tenant, feature and
// period, every bucket as events and value, and the snapshot's as_of on
// every row (a spreadsheet keeps it beside the numbers); every text cell is
// safe against spreadsheet formula injection.
func (c Completeness) CSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	_ = cw.Write(completenessColumns)
	for _, l := range c.Lines {
		row := []string{SafeCell(l.Tenant), SafeCell(l.Feature), SafeCell(l.Period)}
		for _, b := range []Bucket{l.Ingested, l.Confirmed, l.Accepted, l.Pending, l.Quarantined, l.Uncertain, l.Rejected, l.Unstaged} {
			row = append(row, strconv.FormatInt(b.Events, 10), b.Value.String())
		}
		row = append(row, strconv.FormatInt(l.InconsistentItems, 10), strconv.FormatInt(l.Discrepancies, 10),
			strconv.FormatBool(l.Holds), SafeCell(c.AsOf))
		_ = cw.Write(row)
	}
	cw.Flush()
	return cw.Error()
}

// Table writes the report for a terminal.
func (c Completeness) Table(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "TENANT\tFEATURE\tPERIOD\tINGESTED\tCONFIRMED\tACCEPTED\tPENDING\tQUARANTINED\tUNCERTAIN\tREJECTED\tDISCREPANCIES\tHOLDS\t")
	for _, l := range c.Lines {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%v\t\n", l.Tenant, l.Feature, l.Period,
			l.Ingested.Value, l.Confirmed.Value, l.Accepted.Value, l.Pending.Value, l.Quarantined.Value,
			l.Uncertain.Value, l.Rejected.Value, l.Discrepancies, l.Holds)
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
