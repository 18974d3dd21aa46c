package mappings

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
)

// MaxInvoiceGrace is the longest invoice finalization grace period Stripe
// lets an account set (https://docs.stripe.com/billing/subscriptions/usage-based/configure-grace-period),
// and so the longest a tenant mapping may name; the CHECK of migration 26
// holds the database to it too.
const MaxInvoiceGrace = 72 * time.Hour

// Tenant is the current (or a past) mapping of a tenant.
type Tenant struct {
	Tenant           string     `json:"tenant"`
	StripeCustomerID string     `json:"stripe_customer_id"`
	PeriodAnchor     *time.Time `json:"period_anchor,omitempty"`
	// InvoiceGrace is how long after a billing period ends Stripe finalizes
	// the tenant's invoice ("invoice_grace", Go's duration text); nil is
	// the node's TALLY_INVOICE_GRACE.
	InvoiceGrace *Duration `json:"invoice_grace,omitempty"`
	Version      int       `json:"mapping_version"`
	UpdatedAt    time.Time `json:"updated_at"`
	UpdatedBy    string    `json:"updated_by"`
}

// TenantInput is what an operator sets for a tenant.
type TenantInput struct {
	StripeCustomerID string `json:"stripe_customer_id"`
	// PeriodAnchor starts the tenant's monthly billing periods; nil means
	// calendar months UTC.
	PeriodAnchor *time.Time `json:"period_anchor"`
	// InvoiceGrace is the tenant's invoice finalization grace period, from
	// 0 to MaxInvoiceGrace in whole seconds; nil means the node's
	// TALLY_INVOICE_GRACE.
	InvoiceGrace *Duration `json:"invoice_grace"`
}

// graceArg is a grace as the database takes it (an interval; NULL for nil).
func graceArg(g *Duration) *time.Duration {
	if g == nil {
		return nil
	}
	d := time.Duration(*g)
	return &d
}

// graceOf is a grace the database read (nil for NULL).
func graceOf(d *time.Duration) *Duration {
	if d == nil {
		return nil
	}
	g := Duration(*d)
	return &g
}

// ValidInvoiceGrace reports whether a tenant mapping may name g as its
// invoice grace: from 0 to MaxInvoiceGrace, in whole seconds.
func ValidInvoiceGrace(g time.Duration) bool {
	return g >= 0 && g <= MaxInvoiceGrace && g%time.Second == 0
}

func (in *TenantInput) validate(tenant string) error {
	var fe []FieldError
	if !ValidName(tenant) {
		fe = append(fe, FieldError{"tenant", "1 to 64 characters: letters, digits and _.:- (starting with a letter or digit)"})
	}
	if !customerPattern.MatchString(in.StripeCustomerID) {
		fe = append(fe, FieldError{"stripe_customer_id", "a Stripe customer id (cus_…)"})
	}
	if in.PeriodAnchor != nil {
		a := in.PeriodAnchor.UTC().Truncate(time.Second)
		in.PeriodAnchor = &a
	}
	if in.InvoiceGrace != nil && !ValidInvoiceGrace(time.Duration(*in.InvoiceGrace)) {
		fe = append(fe, FieldError{"invoice_grace", "a duration from 0s to 72h (Stripe's largest finalization grace period), in whole seconds"})
	}
	if len(fe) > 0 {
		return &ValidationError{Fields: fe}
	}
	return nil
}

const tenantColumns = `tenant, stripe_customer_id, period_anchor, invoice_grace, version, updated_at, updated_by`

// scanTenant reads a row of tenantColumns (or the same columns of
// tenant_mapping_versions). pgx reads an interval into a time.Duration
// counting a day as 24 hours (and a month as 30 days, which the CHECK of
// invoice_grace rules out), and NULL as nil.
func scanTenant(row pgx.Row) (Tenant, error) {
	var (
		t     Tenant
		grace *time.Duration
	)
	if err := row.Scan(&t.Tenant, &t.StripeCustomerID, &t.PeriodAnchor, &grace, &t.Version, &t.UpdatedAt, &t.UpdatedBy); err != nil {
		return Tenant{}, err
	}
	t.InvoiceGrace = graceOf(grace)
	if t.PeriodAnchor != nil {
		a := t.PeriodAnchor.UTC()
		t.PeriodAnchor = &a
	}
	return t, nil
}

func sameAnchor(a, b *time.Time) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return a.Equal(*b)
}

func sameGrace(a, b *Duration) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return *a == *b
}

// PutTenant sets a tenant's mapping, like PutFeature. With a Checker, the
// account must have the customer, not deleted (a *CustomerError says why
// not), whether or not the mapping changes; it is asked before the
// transaction, which holds no lock while Stripe answers.
func (s *Store) PutTenant(ctx context.Context, db TxBeginner, tenant string, in TenantInput, by string) (t Tenant, changed bool, err error) {
	if err := in.validate(tenant); err != nil {
		return Tenant{}, false, err
	}
	if s.Checker != nil {
		if err := s.Checker.CheckCustomer(ctx, in.StripeCustomerID); err != nil {
			return Tenant{}, false, err
		}
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		cur, err := scanTenant(tx.QueryRow(ctx, "SELECT "+tenantColumns+" FROM tenant_mappings WHERE tenant = $1 FOR UPDATE", tenant))
		switch {
		case err == nil && cur.StripeCustomerID == in.StripeCustomerID && sameAnchor(cur.PeriodAnchor, in.PeriodAnchor) &&
			sameGrace(cur.InvoiceGrace, in.InvoiceGrace):
			t = cur
			return nil
		case err != nil && !errors.Is(err, pgx.ErrNoRows):
			return err
		}
		changed = true
		from := ""
		if err == nil {
			from = tenantState(cur)
		}
		t, err = scanTenant(tx.QueryRow(ctx, `
			WITH v AS (SELECT nextval('mapping_version_seq')::integer AS version),
			hist AS (
				INSERT INTO tenant_mapping_versions (version, tenant, stripe_customer_id, period_anchor, invoice_grace, changed_by)
				SELECT version, $1, $2, $3, $5::interval, $4 FROM v
			)
			INSERT INTO tenant_mappings (tenant, stripe_customer_id, period_anchor, invoice_grace, version, updated_by)
			SELECT $1, $2, $3, $5::interval, version, $4 FROM v
			ON CONFLICT (tenant) DO UPDATE SET stripe_customer_id = EXCLUDED.stripe_customer_id,
				period_anchor = EXCLUDED.period_anchor, invoice_grace = EXCLUDED.invoice_grace, version = EXCLUDED.version,
				updated_at = clock_timestamp(), updated_by = EXCLUDED.updated_by
			RETURNING `+tenantColumns,
			tenant, in.StripeCustomerID, in.PeriodAnchor, by, graceArg(in.InvoiceGrace)))
		if err != nil {
			return err
		}
		return audit.Record(ctx, tx, audit.Entry{Actor: by, Action: audit.ActionTenantMapping, Subject: "tenant:" + tenant,
			From: from, To: tenantState(t), Reason: s.auditReason()})
	})
	if err != nil {
		return Tenant{}, false, fmt.Errorf("mappings: setting tenant %s: %w", tenant, err)
	}
	return t, changed, nil
}

// tenantState is a tenant mapping as the audit log shows it; the invoice
// grace only when the mapping names one ("… grace 2h0m0s").
func tenantState(t Tenant) string {
	anchor := "calendar months"
	if t.PeriodAnchor != nil {
		anchor = "anchor " + t.PeriodAnchor.Format(time.RFC3339)
	}
	s := fmt.Sprintf("v%d %s %s", t.Version, t.StripeCustomerID, anchor)
	if t.InvoiceGrace != nil {
		s += " grace " + t.InvoiceGrace.String()
	}
	return s
}

// GetTenant reads a tenant's current mapping.
func (s *Store) GetTenant(ctx context.Context, q Querier, tenant string) (Tenant, error) {
	t, err := scanTenant(q.QueryRow(ctx, "SELECT "+tenantColumns+" FROM tenant_mappings WHERE tenant = $1", tenant))
	if errors.Is(err, pgx.ErrNoRows) {
		return Tenant{}, fmt.Errorf("%w: tenant %s", ErrNotFound, tenant)
	}
	return t, err
}

// Tenants lists every tenant's current mapping, by name.
func (s *Store) Tenants(ctx context.Context, q Querier) ([]Tenant, error) {
	rows, err := q.Query(ctx, "SELECT "+tenantColumns+" FROM tenant_mappings ORDER BY tenant")
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Tenant, error) { return scanTenant(r) })
}

// TenantHistory lists every version of a tenant's mapping, oldest first.
func (s *Store) TenantHistory(ctx context.Context, q Querier, tenant string) ([]Tenant, error) {
	rows, err := q.Query(ctx, `SELECT tenant, stripe_customer_id, period_anchor, invoice_grace, version, changed_at, changed_by
		FROM tenant_mapping_versions WHERE tenant = $1 ORDER BY version`, tenant)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Tenant, error) { return scanTenant(r) })
}
