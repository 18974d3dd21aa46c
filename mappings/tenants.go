package mappings

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
)

// MaxInvoiceGrace is the longest invoice finalization grace period Stripe
// lets an account set (https://docs.stripe.com/billing/subscriptions/usage-based/configure-grace-period),
// and so the longest a tenant mapping may name; a CHECK on tenant_mappings
// holds the database to it too.
const MaxInvoiceGrace = 72 * time.Hour

// Tenant is the current (or a past) mapping of a tenant.
type Tenant struct {
	Tenant           string `json:"tenant"`
	StripeCustomerID string `json:"stripe_customer_id"`
	// StripeAccount is the Stripe Connect connected account (acct_…) the
	// tenant's usage is exported to, with the Stripe-Account header; ""
	// is the node's destination (STRIPE_ACCOUNT, else the key's own
	// account).
	StripeAccount string     `json:"stripe_account,omitempty"`
	PeriodAnchor  *time.Time `json:"period_anchor,omitempty"`
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
	// StripeAccount is the connected account (acct_…) the tenant's usage
	// goes to; "" means the node's destination. The customer must be one
	// of that account's.
	StripeAccount string `json:"stripe_account,omitempty"`
	// PeriodAnchor starts the tenant's monthly billing periods; nil means
	// calendar months UTC.
	PeriodAnchor *time.Time `json:"period_anchor"`
	// InvoiceGrace is the tenant's invoice finalization grace period, from
	// 0 to MaxInvoiceGrace in whole seconds; nil means the node's
	// TALLY_INVOICE_GRACE.
	InvoiceGrace *Duration `json:"invoice_grace"`
}

// accountPattern is the account ids a tenant mapping may name, as a CHECK
// on tenant_mappings holds them (with stripeapi.ValidAccount's length).
var accountPattern = regexp.MustCompile(`^acct_[A-Za-z0-9_]+$`)

// ValidStripeAccount reports whether a tenant mapping may name account as
// its destination: "" (the node's) or a Stripe account id, acct_ then
// letters, digits and _, at most 255 characters.
func ValidStripeAccount(account string) bool {
	return account == "" || (stripeapi.ValidAccount(account) && accountPattern.MatchString(account))
}

// accountArg is an account as the database takes it (NULL for "").
func accountArg(account string) *string {
	if account == "" {
		return nil
	}
	return &account
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
	if !stripeapi.ValidCustomerID(in.StripeCustomerID) {
		fe = append(fe, FieldError{"stripe_customer_id", "a Stripe customer id (cus_…)"})
	}
	if !ValidStripeAccount(in.StripeAccount) {
		fe = append(fe, FieldError{"stripe_account", "a Stripe account id (acct_…), or empty for this node's destination"})
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

const tenantColumns = `tenant, stripe_customer_id, stripe_account, period_anchor, invoice_grace, version, updated_at, updated_by`

// scanTenant reads a row of tenantColumns (or the same columns of
// tenant_mapping_versions). pgx reads an interval into a time.Duration
// counting a day as 24 hours (and a month as 30 days, which the CHECK of
// invoice_grace rules out), and NULL as nil; a NULL stripe_account as "".
func scanTenant(row pgx.Row) (Tenant, error) {
	var (
		t       Tenant
		account *string
		grace   *time.Duration
	)
	if err := row.Scan(&t.Tenant, &t.StripeCustomerID, &account, &t.PeriodAnchor, &grace, &t.Version, &t.UpdatedAt, &t.UpdatedBy); err != nil {
		return Tenant{}, err
	}
	if account != nil {
		t.StripeAccount = *account
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
// platform's key must be able to act for the mapping's stripe_account, if
// it names one (an *AccountError says it cannot), and that account (else
// the node's) must have the customer, not deleted (a *CustomerError says
// why not), whether or not the mapping changes; Stripe is asked before the
// transaction, which holds no lock while Stripe answers. A Checker that is
// also a CustomerNamer gives the customer's name in the same request, kept
// for the console (TenantCustomers). With Subscriptions, the customer's
// subscriptions are read too and kept: a customer whose subscription gives
// a billing cycle anchor gives it to the tenant, and another anchor in the
// input is refused (a ValidationError on period_anchor).
func (s *Store) PutTenant(ctx context.Context, db pgdb.Beginner, tenant string, in TenantInput, by string) (t Tenant, changed bool, err error) {
	if err := in.validate(tenant); err != nil {
		return Tenant{}, false, err
	}
	var name *string // the customer's name, when the check read it
	if s.Checker != nil {
		if in.StripeAccount != "" {
			if err := s.Checker.CheckAccount(ctx, in.StripeAccount); err != nil {
				return Tenant{}, false, err
			}
		}
		if namer, ok := s.Checker.(CustomerNamer); ok {
			n, err := namer.CustomerName(ctx, in.StripeAccount, in.StripeCustomerID)
			if err != nil {
				return Tenant{}, false, err
			}
			name = &n
		} else if err := s.Checker.CheckCustomer(ctx, in.StripeAccount, in.StripeCustomerID); err != nil {
			return Tenant{}, false, err
		}
	}
	var items []stripeapi.SubscriptionItem // the customer's, when Stripe answered
	read := false
	if s.Subscriptions != nil {
		// A failed read leaves the periods as last read: the hourly job
		// reads the customer again.
		if got, err := s.Subscriptions.SubscriptionItems(ctx, in.StripeAccount, in.StripeCustomerID); err == nil {
			items, read = got, true
		}
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if name != nil {
			if err := storeName(ctx, tx, in.StripeAccount, in.StripeCustomerID, *name); err != nil {
				return err
			}
		}
		var p BillingPeriods
		if read {
			kept, err := s.keepSubscriptions(ctx, tx, in.StripeAccount, in.StripeCustomerID, items)
			if err != nil {
				return err
			}
			p = kept.Periods
		} else if p, _, err = StoredPeriods(ctx, tx, in.StripeAccount, in.StripeCustomerID); err != nil {
			return err
		}
		if p.Anchor != nil {
			if in.PeriodAnchor != nil && !in.PeriodAnchor.Equal(*p.Anchor) {
				return &ValidationError{Fields: []FieldError{{"period_anchor", fmt.Sprintf(
					"customer %s bills by subscription %s, whose billing cycle anchor %s sets the periods; leave period_anchor out",
					in.StripeCustomerID, p.Subscription, p.Anchor.Format(time.RFC3339))}}}
			}
			in.PeriodAnchor = p.Anchor
		}
		cur, err := scanTenant(tx.QueryRow(ctx, "SELECT "+tenantColumns+" FROM tenant_mappings WHERE tenant = $1 FOR UPDATE", tenant))
		switch {
		case err == nil && cur.StripeCustomerID == in.StripeCustomerID && cur.StripeAccount == in.StripeAccount &&
			sameAnchor(cur.PeriodAnchor, in.PeriodAnchor) && sameGrace(cur.InvoiceGrace, in.InvoiceGrace):
			t = cur
			return nil
		case err != nil && !errors.Is(err, pgx.ErrNoRows):
			return err
		}
		changed = true
		var was *Tenant
		if err == nil {
			was = &cur
		}
		t, err = s.writeTenant(ctx, tx, tenant, in, by, was, s.auditReason())
		return err
	})
	if err != nil {
		return Tenant{}, false, fmt.Errorf("mappings: setting tenant %s: %w", tenant, err)
	}
	return t, changed, nil
}

// writeTenant writes tenant's new mapping version in tx, cur being its
// current mapping (nil: none), moves its unstaged usage to the new
// anchor's periods and audits the change with reason.
func (s *Store) writeTenant(ctx context.Context, tx pgx.Tx, tenant string, in TenantInput, by string, cur *Tenant, reason string) (Tenant, error) {
	from := ""
	if cur != nil {
		from = tenantState(*cur)
	}
	// An update takes the new row's updated_at (its column default, the
	// clock): a distributed database refuses a function that is not
	// IMMUTABLE in DO UPDATE SET, and the mappings are reference tables.
	t, err := scanTenant(tx.QueryRow(ctx, `
		WITH v AS (SELECT nextval('mapping_version_seq')::integer AS version),
		hist AS (
			INSERT INTO tenant_mapping_versions (version, tenant, stripe_customer_id, stripe_account, period_anchor, invoice_grace, changed_by)
			SELECT version, $1, $2, $6::text, $3, $5::interval, $4 FROM v
		)
		INSERT INTO tenant_mappings (tenant, stripe_customer_id, stripe_account, period_anchor, invoice_grace, version, updated_by)
		SELECT $1, $2, $6::text, $3, $5::interval, version, $4 FROM v
		ON CONFLICT (tenant) DO UPDATE SET stripe_customer_id = EXCLUDED.stripe_customer_id,
			stripe_account = EXCLUDED.stripe_account, period_anchor = EXCLUDED.period_anchor,
			invoice_grace = EXCLUDED.invoice_grace, version = EXCLUDED.version,
			updated_at = EXCLUDED.updated_at, updated_by = EXCLUDED.updated_by
		RETURNING `+tenantColumns,
		tenant, in.StripeCustomerID, in.PeriodAnchor, by, graceArg(in.InvoiceGrace), accountArg(in.StripeAccount)))
	if err != nil {
		return Tenant{}, err
	}
	var was *time.Time // the anchor the tenant's usage was counted by: none before its first mapping
	if cur != nil {
		was = cur.PeriodAnchor
	}
	if err := moveAnchor(ctx, tx, tenant, was, t.PeriodAnchor); err != nil {
		return Tenant{}, err
	}
	return t, audit.Record(ctx, tx, audit.Entry{Actor: by, Action: audit.ActionTenantMapping, Subject: "tenant:" + tenant,
		From: from, To: tenantState(t), Reason: reason})
}

// tenantState is a tenant mapping as the audit log shows it; the account
// and the invoice grace only when the mapping names them ("v7 cus_1
// account acct_1 calendar months grace 2h0m0s").
func tenantState(t Tenant) string {
	anchor := "calendar months"
	if t.PeriodAnchor != nil {
		anchor = "anchor " + t.PeriodAnchor.Format(time.RFC3339)
	}
	s := fmt.Sprintf("v%d %s", t.Version, t.StripeCustomerID)
	if t.StripeAccount != "" {
		s += " account " + t.StripeAccount
	}
	s += " " + anchor
	if t.InvoiceGrace != nil {
		s += " grace " + t.InvoiceGrace.String()
	}
	return s
}

// GetTenant reads a tenant's current mapping.
func (s *Store) GetTenant(ctx context.Context, q pgdb.Querier, tenant string) (Tenant, error) {
	t, err := scanTenant(q.QueryRow(ctx, "SELECT "+tenantColumns+" FROM tenant_mappings WHERE tenant = $1", tenant))
	if errors.Is(err, pgx.ErrNoRows) {
		return Tenant{}, fmt.Errorf("%w: tenant %s", ErrNotFound, tenant)
	}
	return t, err
}

// Tenants lists every tenant's current mapping, by name.
func (s *Store) Tenants(ctx context.Context, q pgdb.Querier) ([]Tenant, error) {
	rows, err := q.Query(ctx, "SELECT "+tenantColumns+" FROM tenant_mappings ORDER BY tenant")
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Tenant, error) { return scanTenant(r) })
}

// TenantHistory lists every version of a tenant's mapping, oldest first.
func (s *Store) TenantHistory(ctx context.Context, q pgdb.Querier, tenant string) ([]Tenant, error) {
	rows, err := q.Query(ctx, `SELECT tenant, stripe_customer_id, stripe_account, period_anchor, invoice_grace, version, changed_at, changed_by
		FROM tenant_mapping_versions WHERE tenant = $1 ORDER BY version`, tenant)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Tenant, error) { return scanTenant(r) })
}

// Accounts lists every connected account any version of any tenant
// mapping has named (tenant_mapping_versions), each once, in byte order:
// the accounts that items may have been staged for, current mappings or
// not. The node's own destination (NULL) is not among them.
func Accounts(ctx context.Context, q pgdb.Querier) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT DISTINCT stripe_account COLLATE "C" FROM tenant_mapping_versions
		WHERE stripe_account IS NOT NULL ORDER BY 1`)
	if err != nil {
		return nil, fmt.Errorf("mappings: listing the tenants' accounts: %w", err)
	}
	accounts, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("mappings: listing the tenants' accounts: %w", err)
	}
	return accounts, nil
}

// CurrentAccounts counts the tenants whose current mapping names each
// connected account: account -> tenants. Tenants of the node's own
// destination (no stripe_account) are not counted.
func CurrentAccounts(ctx context.Context, q pgdb.Querier) (map[string]int, error) {
	rows, err := q.Query(ctx, `SELECT stripe_account, count(*)::integer FROM tenant_mappings
		WHERE stripe_account IS NOT NULL GROUP BY stripe_account`)
	if err != nil {
		return nil, fmt.Errorf("mappings: counting the tenants' accounts: %w", err)
	}
	out := map[string]int{}
	var (
		account string
		n       int
	)
	if _, err := pgx.ForEachRow(rows, []any{&account, &n}, func() error { out[account] = n; return nil }); err != nil {
		return nil, fmt.Errorf("mappings: counting the tenants' accounts: %w", err)
	}
	return out, nil
}
