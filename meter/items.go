package meter

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// item builds an item, quarantined with the first reason that makes it
// ineligible (the timestamp is checked separately, against the database
// clock). Its exporter is the feature mapping's when it names one, else the
// node's (target.Exporter): the exporter is part of the identity, so the
// identifier differs per exporter.
func (s *Stager) item(pair mappings.Pair, target Target, tenant, feature, kind, ref string, value int64, at, period time.Time) outbox.NewItem {
	it := outbox.NewItem{
		Identity: outbox.Identity{
			TenantKey: tenant, SubjectKind: kind, SubjectRef: ref, Exporter: pair.Feature.ExporterOr(target.Exporter),
			DestinationAccount: target.accountOf(pair), Mode: target.Mode, MappingVersion: pair.Version(),
		},
		Payload: outbox.Payload{Value: value, Timestamp: at.Unix(), Feature: feature, Period: rfc3339(period)},
	}
	if pair.Feature != nil {
		it.Payload.EventName = pair.Feature.EventName
		// The meter's payload keys, when they are not Stripe's defaults
		// (an item without them is sent with the defaults).
		if k := pair.Feature.CustomerPayloadKey; k != mappings.DefaultCustomerPayloadKey {
			it.Payload.CustomerKey = k
		}
		if k := pair.Feature.ValuePayloadKey; k != mappings.DefaultValuePayloadKey {
			it.Payload.ValueKey = k
		}
	}
	if pair.Tenant != nil {
		it.Payload.Customer = pair.Tenant.StripeCustomerID
	}
	it.Quarantine = ineligibility(pair, target, kind == outbox.SubjectUsageEvent, value)
	return it
}

// ineligibility is why an item of pair's usage would be quarantined at
// staging — no feature or tenant mapping, no account, a per-event item
// (event) of a count feature whose value is not 1, a value past the
// provider's digits — or "" when nothing but its timestamp (checked
// against the database clock, checkStamps) can keep it from export.
// The stager and the ingest's quarantine cap both ask it.
func ineligibility(pair mappings.Pair, target Target, event bool, value int64) outbox.Reason {
	switch {
	case pair.Feature == nil:
		return outbox.ReasonFeatureUnmapped
	case pair.Tenant == nil:
		return outbox.ReasonNoCustomer
	case target.accountOf(pair) == "":
		return outbox.ReasonNoAccount
	case event && pair.Feature.Aggregation.PerEvent() && value != 1:
		return outbox.ReasonCountValue
	case !target.valueFits(value):
		return outbox.ReasonValueDigits
	}
	return ""
}

// markRows sets each row's item, once: items has one id for all rows or one
// per row.
func markRows(ctx context.Context, tx pgx.Tx, rows, items []int64) error {
	if len(items) == 1 && len(rows) > 1 {
		one := items[0]
		items = make([]int64, len(rows))
		for i := range items {
			items[i] = one
		}
	}
	tag, err := tx.Exec(ctx, `
		UPDATE usage_events u SET item_id = m.item, staged_at = statement_timestamp()
		FROM unnest($1::bigint[], $2::bigint[]) AS m(row_id, item)
		WHERE u.id = m.row_id AND u.item_id IS NULL`, rows, items)
	if err != nil {
		return fmt.Errorf("marking rows: %w", err)
	}
	if int(tag.RowsAffected()) != len(rows) {
		return fmt.Errorf("marking rows: %d of %d rows were still unstaged", tag.RowsAffected(), len(rows))
	}
	return nil
}

// sqlMarkEventRows is markRows for the rows of one tenant's bucket.
const sqlMarkEventRows = `
UPDATE usage_events u SET item_id = m.item, staged_at = statement_timestamp()
FROM unnest($1::bigint[], $2::bigint[]) AS m(row_id, item)
WHERE u.bucket = $3 AND u.id = m.row_id AND u.item_id IS NULL`

// markEventRows is markRows for the rows of one tenant, whose bucket is
// bucket: one shard's statement.
func markEventRows(ctx context.Context, tx pgx.Tx, bucket int16, rows, items []int64) error {
	tag, err := tx.Exec(ctx, sqlMarkEventRows, rows, items, bucket)
	return checkMarked(tag.RowsAffected(), len(rows), err)
}

// sqlMarkClosedRows is sqlMarkEventRows for the rows of one window, which
// states the window's closure again (see sqlMarkWindowRows). A window's
// few rows are reached by their ids: a time range here could make the
// planner scan the window's partition instead.
const sqlMarkClosedRows = `
UPDATE usage_events u SET item_id = m.item, staged_at = statement_timestamp()
FROM unnest($1::bigint[], $2::bigint[]) AS m(row_id, item)
WHERE u.bucket = $3 AND u.id = m.row_id AND u.item_id IS NULL
  AND $4::timestamptz + $5::interval <= statement_timestamp()`

// markClosedRows is markEventRows for the rows of a window that closed at
// to plus grace.
func markClosedRows(ctx context.Context, tx pgx.Tx, bucket int16, rows, items []int64, to time.Time, grace time.Duration) error {
	tag, err := tx.Exec(ctx, sqlMarkClosedRows, rows, items, bucket, to, grace)
	return checkMarked(tag.RowsAffected(), len(rows), err)
}

// windowSpan is the time span of the windows whose rows a marking sets:
// [from, to), closed once to plus grace has passed.
type windowSpan struct {
	from, to time.Time
	grace    time.Duration
}

// sqlMarkWindowRows marks the rows of windows, of tenants of @buckets, in
// the span [@from, @to), which a ledger partitioned by time prunes by. It
// states the windows' closure again: the read that locked the rows may
// have read another node's clock; the coordinator's decides.
const sqlMarkWindowRows = `
UPDATE usage_events u SET item_id = m.item, staged_at = statement_timestamp()
FROM unnest(@rows::bigint[], @items::bigint[]) AS m(row_id, item)
WHERE u.bucket = ANY(@buckets::smallint[]) AND u.id = m.row_id AND u.item_id IS NULL
  AND u.occurred_at >= @from AND u.occurred_at < @to
  AND @to::timestamptz + @grace::interval <= statement_timestamp()`

// markWindowRows sets each row's item (items[i] for rows[i]), once; every
// row is of a tenant of buckets and in span, whose windows have closed.
func markWindowRows(ctx context.Context, tx pgx.Tx, rows, items []int64, buckets []int16, span windowSpan) error {
	tag, err := tx.Exec(ctx, sqlMarkWindowRows, pgx.NamedArgs{
		"rows": rows, "items": items, "buckets": buckets, "from": span.from, "to": span.to, "grace": span.grace,
	})
	return checkMarked(tag.RowsAffected(), len(rows), err)
}

// checkMarked fails a marking that set fewer rows than it was given.
func checkMarked(marked int64, want int, err error) error {
	if err != nil {
		return fmt.Errorf("marking rows: %w", err)
	}
	if int(marked) != want {
		return fmt.Errorf("marking rows: %d of %d rows were still unstaged", marked, want)
	}
	return nil
}

// sameItem is item n times: the items of n rows one item carries.
func sameItem(item int64, n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = item
	}
	return out
}
