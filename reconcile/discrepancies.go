package reconcile

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// resolutionMatches is the condition under which resolution r covers
// discrepancy d: the same hour of the same key, the same reason, and the
// same numbers (Tally's value, and Stripe's or none).
const resolutionMatches = `r.destination_account = d.destination_account AND r.mode = d.mode
	AND r.event_name = d.event_name AND r.customer = d.customer AND r.hour = d.hour AND r.reason = d.reason
	AND r.expected = d.expected AND r.provider IS NOT DISTINCT FROM d.provider`

// isOpen is the condition under which discrepancy d is open: no later run
// cleared it, and no resolution covers it.
const isOpen = `d.cleared_by_run IS NULL
	AND NOT EXISTS (SELECT 1 FROM reconcile_resolutions r WHERE ` + resolutionMatches + `)`

// kindOrder orders discrepancies by kind as Kinds lists them: Stripe has
// more (a customer may be billed too much) first.
const kindOrder = `CASE d.kind WHEN 'stripe_has_more' THEN 0 WHEN 'stripe_has_less' THEN 1 ELSE 2 END`

// sqlDiscrepancies reads discrepancies (the caller adds the WHERE clause on
// d), each with the resolution that covers it, if any; Stripe-has-more
// first, then by meter, customer, hour and run. A discrepancy that names
// no item (an hour Stripe has and Tally has nothing of) is the tenants'
// whose mapping names its customer (in its account) and the features
// mapped to its event name; the tenants and features of one that names
// items are those of its items, which sqlDiscrepancyItems reads apart (the
// discrepancies are the coordinator's, the items a distributed database's
// shards').
const sqlDiscrepancies = `
SELECT d.id, d.run_id, d.destination_account, d.mode, d.event_name, d.meter, d.customer, d.reason, d.kind,
       coalesce(d.error_code, ''), coalesce(d.error_status, 0), d.hour, d.formula,
       d.expected::text, d.provider::text, d.difference::text, d.expected_items, d.uncertain_items, d.confirmed_items,
       d.explained_by, d.explanation, d.reported_items,
       coalesce(m.tenants, '{}'), coalesce(m.features, '{}'), d.cleared_by_run,
       r.id, r.discrepancy_id, r.resolution, r.note, r.resolved_by, r.resolved_at, r.settled_items
FROM reconcile_discrepancies d
LEFT JOIN LATERAL (
    SELECT (SELECT array_agg(t.tenant ORDER BY t.tenant) FROM tenant_mappings t
            WHERE t.stripe_customer_id = d.customer AND (t.stripe_account IS NULL OR t.stripe_account = d.destination_account)) AS tenants,
           (SELECT array_agg(f.feature ORDER BY f.feature) FROM feature_mappings f WHERE f.event_name = d.event_name) AS features
    WHERE cardinality(d.expected_items) + cardinality(d.uncertain_items) = 0
) m ON true
LEFT JOIN reconcile_resolutions r ON ` + resolutionMatches + `
/*where*/
/*order*/`

// sqlDiscrepancyItems reads the tenants and features of the items of
// discrepancies: for each discrepancy (@ns, once per item it names as
// expected or uncertain, @item_ids), its items' tenants and features,
// distinct and in order. The items are read by id first; on a distributed
// database that is an index probe of every shard.
const sqlDiscrepancyItems = `
WITH o AS MATERIALIZED (
    SELECT id, tenant_key, payload ->> 'feature' AS feature FROM outbox_items WHERE id = ANY(@ids::bigint[])
)
SELECT d.n, array_agg(DISTINCT o.tenant_key ORDER BY o.tenant_key),
       coalesce(array_agg(DISTINCT o.feature ORDER BY o.feature) FILTER (WHERE o.feature IS NOT NULL), '{}')
FROM unnest(@ns::integer[], @item_ids::bigint[]) AS d (n, id) JOIN o ON o.id = d.id
GROUP BY d.n`

// itemsOfDiscrepancies sets the Tenants and Features of each discrepancy
// of ds that names items from its items (sqlDiscrepancyItems); none found
// leaves them empty.
func itemsOfDiscrepancies(ctx context.Context, q pgdb.Querier, ds []Discrepancy) error {
	var (
		ns       []int32
		itemIDs  []int64
		distinct []int64
		seen     = map[int64]bool{}
	)
	for i, d := range ds {
		for _, id := range append(slices.Clone(d.ExpectedItems), d.UncertainItems...) {
			ns, itemIDs = append(ns, int32(i)), append(itemIDs, id)
			if !seen[id] {
				seen[id] = true
				distinct = append(distinct, id)
			}
		}
	}
	if len(ns) == 0 {
		return nil
	}
	rows, err := q.Query(ctx, sqlDiscrepancyItems, pgx.NamedArgs{"ids": distinct, "ns": ns, "item_ids": itemIDs})
	if err != nil {
		return err
	}
	var (
		n                 int32
		tenants, features []string
	)
	_, err = pgx.ForEachRow(rows, []any{&n, &tenants, &features}, func() error {
		ds[n].Tenants, ds[n].Features = tenants, features
		tenants, features = nil, nil // the next row's scan makes its own
		return nil
	})
	return err
}

// discrepancyOrder is the order lists show discrepancies in: by kind, then
// by meter, customer, hour and run.
const discrepancyOrder = `ORDER BY ` + kindOrder + `, d.event_name, d.customer, d.hour, d.run_id`

// readDiscrepancies runs sqlDiscrepancies with the WHERE clause where, in
// discrepancyOrder.
func readDiscrepancies(ctx context.Context, q pgdb.Querier, where string, args pgx.NamedArgs) ([]Discrepancy, error) {
	return readDiscrepanciesIn(ctx, q, where, discrepancyOrder, args)
}

// readDiscrepanciesIn runs sqlDiscrepancies with the WHERE clause where and
// the ORDER BY (and LIMIT) clause order.
func readDiscrepanciesIn(ctx context.Context, q pgdb.Querier, where, order string, args pgx.NamedArgs) ([]Discrepancy, error) {
	sql := strings.Replace(strings.Replace(sqlDiscrepancies, "/*where*/", where, 1), "/*order*/", order, 1)
	rows, err := q.Query(ctx, sql, args)
	if err != nil {
		return nil, fmt.Errorf("reconcile: reading discrepancies: %w", err)
	}
	out, err := pgx.CollectRows(rows, scanDiscrepancy)
	if err != nil {
		return nil, fmt.Errorf("reconcile: reading discrepancies: %w", err)
	}
	if err := itemsOfDiscrepancies(ctx, q, out); err != nil {
		return nil, fmt.Errorf("reconcile: reading the items of discrepancies: %w", err)
	}
	if out == nil {
		out = []Discrepancy{}
	}
	return out, nil
}

func scanDiscrepancy(row pgx.CollectableRow) (Discrepancy, error) {
	var (
		d      Discrepancy
		resID  *int64
		of     *int64
		reason *string
		note   *string
		by     *string
		at     *time.Time
		items  []int64
	)
	err := row.Scan(&d.ID, &d.RunID, &d.Account, &d.Mode, &d.EventName, &d.Meter, &d.Customer, &d.Reason, &d.Kind, &d.ErrorCode,
		&d.ErrorStatus, &d.Hour, &d.Formula, &d.Expected, &d.Provider, &d.Difference, &d.ExpectedItems, &d.UncertainItems,
		&d.ConfirmedItems, &d.ExplainedBy, &d.Explanation, &d.ReportedItems, &d.Tenants, &d.Features, &d.ClearedByRun,
		&resID, &of, &reason, &note, &by, &at, &items)
	d.Hour = d.Hour.UTC()
	if resID != nil {
		d.Resolution = &Resolution{ID: *resID, Discrepancy: *of, Reason: ResolutionReason(*reason), Note: *note, By: *by,
			At: at.UTC(), SettledItems: nonNil(items)}
	}
	return d, err
}

// ErrDiscrepancyNotFound is a discrepancy id that does not exist.
var ErrDiscrepancyNotFound = errcode.New(errcode.NotFound, "", "reconcile: no such discrepancy")

// GetDiscrepancy reads one discrepancy with its tenants, features and
// resolution.
func GetDiscrepancy(ctx context.Context, q pgdb.Querier, id int64) (Discrepancy, error) {
	ds, err := readDiscrepancies(ctx, q, `WHERE d.id = @id`, pgx.NamedArgs{"id": id})
	if err != nil {
		return Discrepancy{}, err
	}
	if len(ds) == 0 {
		return Discrepancy{}, fmt.Errorf("%w: %d", ErrDiscrepancyNotFound, id)
	}
	return ds[0], nil
}

// DiscrepancyStatus selects discrepancies by whether they are open.
type DiscrepancyStatus string

// The statuses a list selects.
const (
	// StatusOpen: unresolved and not cleared by a later run (Open).
	StatusOpen DiscrepancyStatus = "open"
	// StatusResolved: resolved by finance.
	StatusResolved DiscrepancyStatus = "resolved"
	// StatusAll: every one.
	StatusAll DiscrepancyStatus = "all"
)

// DefaultStatus is what a list of discrepancies selects unless told:
// the open ones, finance's work.
const DefaultStatus = StatusOpen

// ParseStatus validates a status name; "" is DefaultStatus.
func ParseStatus(s string) (DiscrepancyStatus, error) {
	switch st := DiscrepancyStatus(s); st {
	case "":
		return DefaultStatus, nil
	case StatusOpen, StatusResolved, StatusAll:
		return st, nil
	}
	return "", fmt.Errorf("reconcile: status must be open, resolved or all, not %q", s)
}

// ListDiscrepancies reads discrepancies with the given status,
// Stripe-has-more first, then by meter, customer and hour. With run 0 it
// reads across runs — the open ones (finance's work, whichever run found
// them), every one finance resolved, or both — and returns the latest run
// that succeeded (0 before the first), for reference; else the
// discrepancies of that run, and run. Either way it reads no history: the
// open ones are read through the index of the current ones (an hour has one),
// the resolved ones by their resolutions.
func ListDiscrepancies(ctx context.Context, q pgdb.Querier, run int64, status DiscrepancyStatus) (int64, []Discrepancy, error) {
	var where string
	if run == 0 {
		latest, _, err := LatestSucceeded(ctx, q)
		if err != nil {
			return 0, nil, err
		}
		switch status {
		case StatusOpen:
			where = `WHERE ` + isOpen
		case StatusResolved:
			where = `WHERE d.id IN (SELECT discrepancy_id FROM reconcile_resolutions)`
		default:
			where = `WHERE d.id IN (SELECT id FROM reconcile_discrepancies WHERE cleared_by_run IS NULL
				UNION SELECT discrepancy_id FROM reconcile_resolutions)`
		}
		run = latest
	} else {
		if _, err := Get(ctx, q, run); err != nil {
			return 0, nil, err
		}
		where = `WHERE d.run_id = @run`
		switch status {
		case StatusOpen:
			where += ` AND r.id IS NULL AND d.cleared_by_run IS NULL`
		case StatusResolved:
			where += ` AND r.id IS NOT NULL`
		}
	}
	ds, err := readDiscrepancies(ctx, q, where, pgx.NamedArgs{"run": run})
	return run, ds, err
}

// OpenDiscrepancies reads every open discrepancy, across runs,
// Stripe-has-more first.
func OpenDiscrepancies(ctx context.Context, q pgdb.Querier) ([]Discrepancy, error) {
	return readDiscrepancies(ctx, q, `WHERE `+isOpen, pgx.NamedArgs{})
}

// FirstOpen reads the first limit open discrepancies, across runs, in the
// order OpenDiscrepancies gives: a page's worth, however many are open.
func FirstOpen(ctx context.Context, q pgdb.Querier, limit int) ([]Discrepancy, error) {
	return readDiscrepanciesIn(ctx, q, `WHERE `+isOpen, discrepancyOrder+` LIMIT @limit`, pgx.NamedArgs{"limit": limit})
}

// OpenCounts counts the open discrepancies by kind, every kind of Kinds
// present (0 when none is open).
func OpenCounts(ctx context.Context, q pgdb.Querier) (map[string]int64, error) {
	rows, err := q.Query(ctx, `SELECT d.kind, count(*) FROM reconcile_discrepancies d WHERE `+isOpen+` GROUP BY 1`)
	if err != nil {
		return nil, fmt.Errorf("reconcile: counting open discrepancies: %w", err)
	}
	out := make(map[string]int64, len(Kinds))
	for _, k := range Kinds {
		out[k] = 0
	}
	var (
		kind string
		n    int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&kind, &n}, func() error {
		out[kind] = n
		return nil
	}); err != nil {
		return nil, fmt.Errorf("reconcile: counting open discrepancies: %w", err)
	}
	return out, nil
}

// OpenPageLimit is how many discrepancies a page of OpenPage holds unless
// told.
const OpenPageLimit = 50

// OpenQuery selects a page of the open discrepancies, across runs.
type OpenQuery struct {
	// Tenant, when set, keeps the discrepancies whose usage is that
	// tenant's (Discrepancy.Tenants).
	Tenant string
	// Kind, when set, keeps the discrepancies of that kind (one of Kinds).
	Kind string
	// Before, when set, is the page after the one that ended with that
	// discrepancy id: the older ones.
	Before int64
	// Limit is the page's size. Defaults to OpenPageLimit.
	Limit int
}

// sqlOpenItems lists the items the open discrepancies name as expected or
// uncertain.
const sqlOpenItems = `SELECT coalesce(array_agg(DISTINCT i), '{}') FROM reconcile_discrepancies d,
	unnest(d.expected_items || d.uncertain_items) AS i WHERE ` + isOpen

// sqlTenantItems keeps the items of ids that are tenant's: one shard's
// read by its bucket.
const sqlTenantItems = `SELECT coalesce(array_agg(id), '{}') FROM outbox_item_bodies
	WHERE bucket = @bucket AND tenant_key = @tenant AND id = ANY(@ids::bigint[])`

// openItemsOf lists the items of tenant that open discrepancies name: the
// discrepancies' items first (the coordinator's), then which of them are
// the tenant's (its shard's).
func openItemsOf(ctx context.Context, q pgdb.Querier, tenant string) ([]int64, error) {
	var ids []int64
	if err := q.QueryRow(ctx, sqlOpenItems).Scan(&ids); err != nil {
		return nil, fmt.Errorf("reconcile: reading the items of open discrepancies: %w", err)
	}
	if len(ids) == 0 {
		return ids, nil
	}
	var mine []int64
	if err := q.QueryRow(ctx, sqlTenantItems, pgx.NamedArgs{"bucket": tenantbucket.Of(tenant), "tenant": tenant, "ids": ids}).
		Scan(&mine); err != nil {
		return nil, fmt.Errorf("reconcile: reading a tenant's items of open discrepancies: %w", err)
	}
	return mine, nil
}

// ErrUnknownKind is a kind of discrepancy that is not one of Kinds.
var ErrUnknownKind = errors.New("reconcile: no such kind of discrepancy")

// OpenPage is a page of open discrepancies, newest first.
type OpenPage struct {
	Discrepancies []Discrepancy
	// Next, when not 0, is the Before of the next page: older ones may
	// match.
	Next int64
}

// ListOpen reads a page of the open discrepancies of every run, newest
// (the greatest id) first, keyed by id: each page walks the partial index
// of the current discrepancies (reconcile_discrepancies_current_id) down
// from Before, skipping the resolved ones, and stops at a full page. Its
// cost grows with the page, the resolved discrepancies still current
// among them and, with a tenant, the other tenants' open ones it passes;
// never with the history of cleared ones. With a tenant it first lists
// the items the open discrepancies name, and which of them are the
// tenant's (one shard's read on a distributed database, where the items
// and the discrepancies cannot be joined in one statement). A kind that is
// not one of Kinds is ErrUnknownKind.
func ListOpen(ctx context.Context, q pgdb.Querier, oq OpenQuery) (OpenPage, error) {
	if oq.Limit <= 0 {
		oq.Limit = OpenPageLimit
	}
	where := `WHERE ` + isOpen
	args := pgx.NamedArgs{"limit": oq.Limit + 1}
	if oq.Before > 0 {
		where += ` AND d.id < @before`
		args["before"] = oq.Before
	}
	if oq.Tenant != "" {
		items, err := openItemsOf(ctx, q, oq.Tenant)
		if err != nil {
			return OpenPage{}, err
		}
		where += ` AND ((d.expected_items || d.uncertain_items) && @tenant_items::bigint[] OR @tenant = ANY(coalesce(m.tenants, '{}')))`
		args["tenant"], args["tenant_items"] = oq.Tenant, items
	}
	if oq.Kind != "" {
		if !slices.Contains(Kinds, oq.Kind) {
			return OpenPage{}, fmt.Errorf("%w: %q", ErrUnknownKind, oq.Kind)
		}
		where += ` AND d.kind = @kind`
		args["kind"] = oq.Kind
	}
	ds, err := readDiscrepanciesIn(ctx, q, where, `ORDER BY d.id DESC LIMIT @limit`, args)
	if err != nil {
		return OpenPage{}, err
	}
	p := OpenPage{Discrepancies: ds}
	if len(ds) > oq.Limit {
		p.Discrepancies = ds[:oq.Limit]
		p.Next = ds[oq.Limit-1].ID
	}
	return p, nil
}
