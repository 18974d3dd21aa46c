package quarantine

import (
	"cmp"
	"context"
	"encoding/csv"
	"fmt"
	"io"
	"math/big"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// Value is an exact sum of usage values. Sums of int64 values can leave
// int64, so it is a big integer, written in JSON as a plain number. A Value
// is immutable: every operation makes a new one, so copies never alias.
type Value struct{ i *big.Int }

// ValueOf is n as a Value.
func ValueOf(n int64) Value { return Value{big.NewInt(n)} }

func (v Value) int() *big.Int {
	if v.i == nil {
		return new(big.Int)
	}
	return v.i
}

// ValueOfBig is n as a Value (a copy).
func ValueOfBig(n *big.Int) Value { return Value{new(big.Int).Set(n)} }

// Big is v as a new big.Int.
func (v Value) Big() *big.Int { return new(big.Int).Set(v.int()) }

// String is the value in decimal.
func (v Value) String() string { return v.int().String() }

// Cmp compares v and w like big.Int.Cmp.
func (v Value) Cmp(w Value) int { return v.int().Cmp(w.int()) }

// Plus returns v + w.
func (v Value) Plus(w Value) Value { return Value{new(big.Int).Add(v.int(), w.int())} }

// MarshalJSON writes the value as a JSON number.
func (v Value) MarshalJSON() ([]byte, error) { return []byte(v.String()), nil }

// UnmarshalJSON reads a JSON number.
func (v *Value) UnmarshalJSON(b []byte) error {
	n, ok := new(big.Int).SetString(string(b), 10)
	if !ok {
		return fmt.Errorf("not a whole number: %s", b)
	}
	v.i = n
	return nil
}

// ScanText lets pgx scan a numeric::text column into a Value.
func (v *Value) ScanText(t pgtype.Text) error {
	if !t.Valid {
		v.i = nil
		return nil
	}
	n, ok := new(big.Int).SetString(t.String, 10)
	if !ok {
		return fmt.Errorf("quarantine: %q is not a whole number", t.String)
	}
	v.i = n
	return nil
}

// Filter narrows a report; empty fields match everything.
type Filter struct {
	Reason  string
	Tenant  string
	Feature string
	// Period is "YYYY-MM": the billing periods that start in that month.
	Period string
}

var periodPattern = regexp.MustCompile(`^[0-9]{4}-(0[1-9]|1[0-2])$`)

// ParsePeriod turns "YYYY-MM" into the half-open month [from, to) in UTC.
func ParsePeriod(s string) (from, to time.Time, err error) {
	if !periodPattern.MatchString(s) {
		return time.Time{}, time.Time{}, fmt.Errorf("period %q: want YYYY-MM", s)
	}
	from, err = time.Parse("2006-01", s)
	if err != nil {
		return time.Time{}, time.Time{}, fmt.Errorf("period %q: %w", s, err)
	}
	return from, from.AddDate(0, 1, 0), nil
}

// Group is the quarantined items of one reason, tenant, feature and period.
type Group struct {
	Reason  string `json:"reason"`
	Tenant  string `json:"tenant"`
	Feature string `json:"feature"`
	// Period is the start of the billing period (RFC 3339).
	Period string `json:"period"`
	// Items counts the quarantined items, Events the usage events they
	// carry, Value the sum of the items' values.
	Items  int64 `json:"items"`
	Events int64 `json:"events"`
	Value  Value `json:"value"`
}

// ReasonTotal sums a reason's groups.
type ReasonTotal struct {
	Reason string `json:"reason"`
	Items  int64  `json:"items"`
	Events int64  `json:"events"`
	Value  Value  `json:"value"`
}

// Report is the quarantine report.
type Report struct {
	Groups []Group       `json:"groups"`
	Totals []ReasonTotal `json:"totals"`
}

// sqlReport groups the quarantined items and counts the usage events each
// carries: the ledger rows name the item at the root of its chain of
// predecessors, which a successor shares its bucket with. On a distributed
// database it runs once per bucket that holds quarantined items, every
// table read through that bucket (reportBuckets): Citus runs a recursive CTE
// only on one shard, and a list of buckets does not tell it which.
const sqlReport = `
SELECT o.quarantine_reason, o.tenant_key, o.payload ->> 'feature', o.payload ->> 'period',
       count(*), coalesce(sum(ev.n), 0), coalesce(sum((o.payload ->> 'value')::numeric), 0)::text
FROM outbox_items o
CROSS JOIN LATERAL (
    WITH RECURSIVE chain (id, depth) AS (
        SELECT o.id, 0
        UNION ALL
        SELECT s.id, c.depth + 1 FROM outbox_item_states s JOIN chain c ON s.superseded_by = c.id
        WHERE ` + reportBucketS + `c.depth < 1000
    )
    SELECT count(*) AS n FROM usage_events e
    WHERE ` + reportBucketE + `e.item_id = (SELECT id FROM chain ORDER BY depth DESC LIMIT 1)) ev
WHERE ` + reportBucketO + `o.state = 'quarantined'
  AND (@reason = '' OR o.quarantine_reason = @reason)
  AND (@tenant = '' OR o.tenant_key = @tenant)
  AND (@feature = '' OR o.payload ->> 'feature' = @feature)
  AND (@from::timestamptz IS NULL OR ((o.payload ->> 'period')::timestamptz >= @from AND (o.payload ->> 'period')::timestamptz < @to))
GROUP BY 1, 2, 3, 4`

// The bucket predicates of sqlReport: one bucket on a distributed
// database, none on one server.
const (
	reportBucketO = `o.bucket = @bucket::smallint AND `
	reportBucketS = `s.bucket = @bucket::smallint AND `
	reportBucketE = `e.bucket = @bucket::smallint AND `
)

// sqlQuarantinedBuckets lists the buckets that hold quarantined items,
// through the index of quarantined items of every shard.
const sqlQuarantinedBuckets = `SELECT DISTINCT bucket FROM outbox_item_states WHERE state = 'quarantined'`

// reportBuckets is the buckets sqlReport runs for, and its text: on one
// server one run without buckets; on a distributed database the tenant's
// bucket, or every bucket that holds quarantined items.
func reportBuckets(ctx context.Context, db pgdb.Beginner, tenant string) ([]int16, string, error) {
	shards, err := tenantbucket.ReadShards(ctx, db)
	if err != nil {
		return nil, "", err
	}
	if !shards.Distributed() {
		return []int16{0}, strings.NewReplacer(reportBucketO, "", reportBucketS, "", reportBucketE, "").Replace(sqlReport), nil
	}
	if tenant != "" {
		return []int16{tenantbucket.Of(tenant)}, sqlReport, nil
	}
	buckets, err := tenantbucket.ReadAcross(ctx, db, sqlQuarantinedBuckets)
	return buckets, sqlReport, err
}

// Quarantined reads the quarantine report, its groups ordered by reason,
// tenant, feature and period. On a distributed database it is one
// statement per bucket that holds quarantined items (the tenant's alone,
// for one tenant).
func Quarantined(ctx context.Context, db pgdb.Beginner, f Filter) (Report, error) {
	args := pgx.NamedArgs{"reason": f.Reason, "tenant": f.Tenant, "feature": f.Feature, "from": nil, "to": nil}
	if f.Period != "" {
		from, to, err := ParsePeriod(f.Period)
		if err != nil {
			return Report{}, err
		}
		args["from"], args["to"] = from, to
	}
	buckets, sql, err := reportBuckets(ctx, db, f.Tenant)
	if err != nil {
		return Report{}, fmt.Errorf("quarantine: reading the report: %w", err)
	}
	r := Report{Groups: []Group{}, Totals: []ReasonTotal{}}
	for _, bucket := range buckets {
		args["bucket"] = bucket
		rows, err := db.Query(ctx, sql, args)
		if err != nil {
			return Report{}, fmt.Errorf("quarantine: reading the report: %w", err)
		}
		var g Group
		if _, err := pgx.ForEachRow(rows, []any{&g.Reason, &g.Tenant, &g.Feature, &g.Period, &g.Items, &g.Events, &g.Value}, func() error {
			r.Groups = append(r.Groups, g)
			return nil
		}); err != nil {
			return Report{}, fmt.Errorf("quarantine: reading the report: %w", err)
		}
	}
	slices.SortFunc(r.Groups, func(a, b Group) int {
		return cmp.Or(strings.Compare(a.Reason, b.Reason), strings.Compare(a.Tenant, b.Tenant),
			strings.Compare(a.Feature, b.Feature), strings.Compare(a.Period, b.Period))
	})
	index := map[string]int{}
	for _, g := range r.Groups {
		i, ok := index[g.Reason]
		if !ok {
			i = len(r.Totals)
			index[g.Reason] = i
			r.Totals = append(r.Totals, ReasonTotal{Reason: g.Reason})
		}
		r.Totals[i].Items += g.Items
		r.Totals[i].Events += g.Events
		r.Totals[i].Value = r.Totals[i].Value.Plus(g.Value)
	}
	return r, nil
}

// CSV writes the report's groups as CSV, one row a group, every text cell
// safe against spreadsheet formula injection.
func (r Report) CSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"reason", "tenant", "feature", "period", "items", "events", "value"})
	for _, g := range r.Groups {
		_ = cw.Write([]string{SafeCell(g.Reason), SafeCell(g.Tenant), SafeCell(g.Feature), SafeCell(g.Period),
			strconv.FormatInt(g.Items, 10), strconv.FormatInt(g.Events, 10), g.Value.String()})
	}
	cw.Flush()
	return cw.Error()
}

// Table writes the report for a terminal.
func (r Report) Table(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "REASON\tTENANT\tFEATURE\tPERIOD\tITEMS\tEVENTS\tVALUE\t")
	for _, g := range r.Groups {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%s\t\n", g.Reason, g.Tenant, g.Feature, g.Period, g.Items, g.Events, g.Value)
	}
	for _, t := range r.Totals {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%s\t\n", t.Reason, "(all)", "", "total", t.Items, t.Events, t.Value)
	}
	return tw.Flush()
}

// SafeCell neutralises a text cell a spreadsheet would read as a formula: a
// cell starting with =, +, -, @, a tab or a carriage return gets a leading
// apostrophe (OWASP's advice for CSV injection).
func SafeCell(s string) string {
	if s != "" && strings.ContainsRune("=+-@\t\r", rune(s[0])) {
		return "'" + s
	}
	return s
}
