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
