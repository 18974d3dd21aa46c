package quarantine

import (
	"context"
	"encoding/csv"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/outbox"
)

// Item is one quarantined item as an operator requeues it.
type Item struct {
	ID      int64
	Reason  string
	Tenant  string
	Feature string
	// Period is the start of the item's billing period (RFC 3339), empty
	// when the payload has none.
	Period string
	// Value is the payload's value as the payload holds it.
	Value string
	// ItemVersion is the mapping version the item carries; CurrentVersion
	// the greater of its feature's and its tenant's current versions (0
	// when neither is mapped): the version a requeue names.
	ItemVersion    int
	CurrentVersion int
	// Customer is the payload's customer, empty when the tenant had none.
	Customer string
	// Account is the destination account the item was staged for: the
	// node's, or the tenant mapping's connected account (Stripe Connect).
	Account string
	// LastError is the item's last error as stored (sanitised when
	// written): empty when it has none.
	LastError outbox.ErrorInfo
}

// sqlItems reads the quarantined items a filter matches, with the current
// mapping version of each, by id.
const sqlItems = `
SELECT o.id, o.quarantine_reason, o.tenant_key, coalesce(o.payload ->> 'feature', ''), coalesce(o.payload ->> 'period', ''),
       o.payload ->> 'value', o.mapping_version,
       greatest(coalesce(fm.version, 0), coalesce(tm.version, 0)),
       coalesce(o.payload ->> 'customer', ''), o.destination_account, coalesce(o.last_error_code, ''), coalesce(o.last_error_status, 0),
       coalesce(o.last_error, '')
FROM outbox_items o
LEFT JOIN feature_mappings fm ON fm.feature = o.payload ->> 'feature'
LEFT JOIN tenant_mappings tm ON tm.tenant = o.tenant_key
WHERE o.state = 'quarantined' AND o.id > @after
  AND (@reason = '' OR o.quarantine_reason = @reason) AND (@tenant = '' OR o.tenant_key = @tenant)
  AND (@feature = '' OR o.payload ->> 'feature' = @feature)
  AND (@period = '' OR ((o.payload ->> 'period')::timestamptz >= @from AND (o.payload ->> 'period')::timestamptz < @to))
ORDER BY o.id LIMIT @limit`

// sqlTenantItems is sqlItems for one tenant's items: its bucket names its
// shard on a distributed database.
var sqlTenantItems = strings.Replace(sqlItems, "WHERE o.state = 'quarantined'", "WHERE o.bucket = @bucket AND o.state = 'quarantined'", 1)

// Items reads at most limit quarantined items the filter matches, by id,
// each with the mapping version a requeue would name. A malformed period is
// an error, as it is for Quarantined.
func Items(ctx context.Context, q pgdb.Querier, f Filter, limit int) ([]Item, error) {
	return ItemsAfter(ctx, q, f, 0, limit)
}

// ItemsAfter is Items from the item after the id after: the next page.
func ItemsAfter(ctx context.Context, q pgdb.Querier, f Filter, after int64, limit int) ([]Item, error) {
	var from, to time.Time
	if f.Period != "" {
		var err error
		if from, to, err = ParsePeriod(f.Period); err != nil {
			return nil, err
		}
	}
	sql, args := sqlItems, pgx.NamedArgs{"reason": f.Reason, "tenant": f.Tenant, "feature": f.Feature,
		"period": f.Period, "from": from, "to": to, "after": after, "limit": limit}
	if f.Tenant != "" {
		sql, args["bucket"] = sqlTenantItems, tenantbucket.Of(f.Tenant)
	}
	rows, err := q.Query(ctx, sql, args)
	if err != nil {
		return nil, fmt.Errorf("quarantine: reading the items: %w", err)
	}
	items, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Item, error) {
		var it Item
		err := row.Scan(&it.ID, &it.Reason, &it.Tenant, &it.Feature, &it.Period, &it.Value, &it.ItemVersion, &it.CurrentVersion,
			&it.Customer, &it.Account, &it.LastError.Code, &it.LastError.Status, &it.LastError.Message)
		return it, err
	})
	if err != nil {
		return nil, fmt.Errorf("quarantine: reading the items: %w", err)
	}
	return items, nil
}

// MaxItemsCSV is the most items the item-level CSV holds: a filter that
// matches more is narrowed (by tenant, feature, reason or period) rather
// than cut silently.
const MaxItemsCSV = 50000

// ItemsCSV writes quarantined items as CSV, one row an item — its id,
// tenant, feature, customer, destination account, reason, last error (code, status and message
// as stored: sanitised when written), period and value — every text cell
// safe against spreadsheet formula injection.
func ItemsCSV(w io.Writer, items []Item) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"id", "tenant", "feature", "customer", "destination_account", "reason", "last_error_code", "last_error_status", "last_error",
		"period", "value", "mapping_version", "current_mapping_version"})
	for _, it := range items {
		status := ""
		if it.LastError.Status != 0 {
			status = strconv.Itoa(it.LastError.Status)
		}
		_ = cw.Write([]string{strconv.FormatInt(it.ID, 10), SafeCell(it.Tenant), SafeCell(it.Feature), SafeCell(it.Customer),
			SafeCell(it.Account), SafeCell(it.Reason), SafeCell(it.LastError.Code), status, SafeCell(it.LastError.Message), SafeCell(it.Period),
			wholeNumber(it.Value), strconv.Itoa(it.ItemVersion), strconv.Itoa(it.CurrentVersion)})
	}
	cw.Flush()
	return cw.Error()
}

// wholeNumber is a value cell: a whole number as it is (a negative one is
// a correction, not a formula), anything else made safe.
func wholeNumber(s string) string {
	if _, err := strconv.ParseInt(s, 10, 64); err == nil {
		return s
	}
	return SafeCell(s)
}
