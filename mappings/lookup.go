package mappings

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// Pair is what staging needs for one tenant and feature: either may be
// missing.
type Pair struct {
	Feature *Feature
	Tenant  *Tenant
}

// Version is the mapping version an item built from p carries: the greater
// of the feature's and the tenant's (0 when neither exists).
func (p Pair) Version() int {
	v := 0
	if p.Feature != nil {
		v = p.Feature.Version
	}
	if p.Tenant != nil && p.Tenant.Version > v {
		v = p.Tenant.Version
	}
	return v
}

// Lookup reads the current mappings of a tenant and a feature in one query.
func (s *Store) Lookup(ctx context.Context, q pgdb.Querier, tenant, feature string) (Pair, error) {
	key := [2]string{tenant, feature}
	pairs, err := s.LookupMany(ctx, q, map[[2]string]bool{key: true})
	if err != nil {
		return Pair{}, fmt.Errorf("mappings: looking up %s/%s: %w", tenant, feature, err)
	}
	return pairs[key], nil
}

// LookupMany reads the current mappings of every (tenant, feature) pair in
// pairs in one query; the staging path of a batch of per-event usage uses
// it, and Lookup for one pair.
func (s *Store) LookupMany(ctx context.Context, q pgdb.Querier, pairs map[[2]string]bool) (map[[2]string]Pair, error) {
	out := make(map[[2]string]Pair, len(pairs))
	var tenants, features []string
	for p := range pairs {
		tenants, features = append(tenants, p[0]), append(features, p[1])
	}
	rows, err := q.Query(ctx, `
		SELECT u.t, u.f,
		       f.event_name, f.aggregation, f.window_seconds, f.exporter, f.customer_payload_key, f.value_payload_key,
		       f.version, f.updated_at, f.updated_by,
		       t.stripe_customer_id, t.stripe_account, t.period_anchor, t.invoice_grace, t.version, t.updated_at, t.updated_by
		FROM unnest($1::text[], $2::text[]) AS u(t, f)
		LEFT JOIN feature_mappings f ON f.feature = u.f
		LEFT JOIN tenant_mappings t ON t.tenant = u.t`, tenants, features)
	if err != nil {
		return nil, fmt.Errorf("mappings: reading mappings: %w", err)
	}
	var (
		tenant, feature      string
		ev, agg, exp, ck, vk *string
		cust, acct, fby, tby *string
		window, fv, tv       *int
		anchor, fat, tat     *time.Time
		grace                *time.Duration
	)
	_, err = pgx.ForEachRow(rows, []any{&tenant, &feature, &ev, &agg, &window, &exp, &ck, &vk, &fv, &fat, &fby,
		&cust, &acct, &anchor, &grace, &tv, &tat, &tby}, func() error {
		var p Pair
		if fv != nil {
			p.Feature = &Feature{Feature: feature, EventName: *ev, Aggregation: Aggregation(*agg),
				Window: Duration(time.Duration(*window) * time.Second), Exporter: *exp,
				CustomerPayloadKey: *ck, ValuePayloadKey: *vk, Version: *fv, UpdatedAt: *fat, UpdatedBy: *fby}
		}
		if tv != nil {
			p.Tenant = &Tenant{Tenant: tenant, StripeCustomerID: *cust, Version: *tv, UpdatedAt: *tat, UpdatedBy: *tby}
			if acct != nil {
				p.Tenant.StripeAccount = *acct
			}
			if anchor != nil {
				a := anchor.UTC()
				p.Tenant.PeriodAnchor = &a
			}
			p.Tenant.InvoiceGrace = graceOf(grace) // a copy of its own, whatever the next row's scan does with grace
		}
		out[[2]string{tenant, feature}] = p
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("mappings: reading mappings: %w", err)
	}
	return out, nil
}
