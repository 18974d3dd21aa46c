package mappings

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/stripeapi"
)

// Aggregation is how a feature's usage is reduced, matching the Stripe
// meter's default_aggregation.formula.
type Aggregation string

// Aggregations.
const (
	// Sum meters fold usage into windows and export each window's sum.
	Sum Aggregation = "sum"
	// Last meters export each window's latest value.
	Last Aggregation = "last"
	// Count meters are exported per event.
	Count Aggregation = "count"
)

// PerEvent reports whether usage of this aggregation is exported one item
// per event rather than per window.
func (a Aggregation) PerEvent() bool { return a == Count }

// DefaultWindow is a feature's window when none is given.
const DefaultWindow = time.Hour

// Exporter names a feature mapping may choose. They mirror
// exporter.StripeMeterEvents and exporter.StripeMeterEventStream (package
// mappings does not import package exporter; a test holds them equal), and
// the CHECK of feature_mappings.exporter (migration 9).
const (
	// ExporterDefault (empty) leaves the choice to the node: TALLY_EXPORTER.
	ExporterDefault = ""
	// ExporterStripeMeterEvents is Stripe's v1 meter events
	// (exporter.StripeMeterEvents).
	ExporterStripeMeterEvents = "stripe_meter_events"
	// ExporterStripeMeterEventStream is Stripe's v2 meter event stream
	// (exporter.StripeMeterEventStream).
	ExporterStripeMeterEventStream = "stripe_meter_event_stream"
)

// Exporters lists the exporters a feature mapping may name, besides
// ExporterDefault.
var Exporters = []string{ExporterStripeMeterEvents, ExporterStripeMeterEventStream}

// ValidExporter reports whether a feature mapping may name exporter:
// empty (the node's default) or one of Exporters.
func ValidExporter(exporter string) bool {
	return exporter == ExporterDefault || slices.Contains(Exporters, exporter)
}

// The payload keys of a Stripe meter that names none: Stripe's defaults of
// customer_mapping.event_payload_key and value_settings.event_payload_key
// (stripe-go v82, BillingMeterEventParams.Payload; "Payload key overrides",
// https://docs.stripe.com/billing/subscriptions/usage-based/recording-usage#payload-key-overrides).
// Migration 12 gave them to the mappings set before mappings carried keys.
const (
	DefaultCustomerPayloadKey = stripeapi.DefaultCustomerPayloadKey
	DefaultValuePayloadKey    = stripeapi.DefaultValuePayloadKey
)

// MaxPayloadKeyLength is the longest payload key a feature mapping takes,
// in characters: the most Stripe takes when a meter is created (max length
// 100 for both event_payload_keys in Stripe's API specification).
const MaxPayloadKeyLength = 100

// PayloadKeys are the meter event payload keys a meter reads: the key of the
// Stripe customer id and the key of the value.
type PayloadKeys struct {
	Customer string
	Value    string
}

// DefaultPayloadKeys are Stripe's default keys, DefaultCustomerPayloadKey
// and DefaultValuePayloadKey.
func DefaultPayloadKeys() PayloadKeys {
	return PayloadKeys{Customer: DefaultCustomerPayloadKey, Value: DefaultValuePayloadKey}
}

// String renders the keys as the audit log shows them:
// "customer=stripe_customer_id value=value".
func (k PayloadKeys) String() string { return "customer=" + k.Customer + " value=" + k.Value }

// check returns a *MeterError unless both keys are plausible payload keys
// (1 to MaxPayloadKeyLength characters of valid UTF-8, no control
// character) and differ. eventName says whose meter it is.
func (k PayloadKeys) check(eventName string) error {
	for _, key := range []struct{ which, key string }{{"customer", k.Customer}, {"value", k.Value}} {
		if !plausiblePayloadKey(key.key) {
			return &MeterError{Code: "meter_payload_key_invalid", Message: fmt.Sprintf(
				"Stripe's meter for %q names a %s payload key that Tally cannot send: want 1 to %d characters, no control characters",
				eventName, key.which, MaxPayloadKeyLength)}
		}
	}
	if k.Customer == k.Value {
		return &MeterError{Code: "meter_payload_key_invalid", Message: fmt.Sprintf(
			"Stripe's meter for %q names the same payload key for the customer and the value", eventName)}
	}
	return nil
}

func plausiblePayloadKey(key string) bool {
	if key == "" || !utf8.ValidString(key) || utf8.RuneCountInString(key) > MaxPayloadKeyLength {
		return false
	}
	return !strings.ContainsFunc(key, unicode.IsControl)
}

// Feature is the current (or a past) mapping of a feature.
type Feature struct {
	Feature     string      `json:"feature"`
	EventName   string      `json:"event_name"`
	Aggregation Aggregation `json:"aggregation"`
	Window      Duration    `json:"window"`
	// Exporter is the exporter of the feature's items; empty is the node's
	// default (TALLY_EXPORTER).
	Exporter string `json:"exporter"`
	// CustomerPayloadKey and ValuePayloadKey are the meter event payload
	// keys of the customer id and the value that the feature's items send:
	// the keys of the Stripe meter with EventName when the mapping was set
	// (without a Stripe key: the keys it had for the same event name, else
	// Stripe's defaults).
	CustomerPayloadKey string    `json:"customer_payload_key"`
	ValuePayloadKey    string    `json:"value_payload_key"`
	Version            int       `json:"mapping_version"`
	UpdatedAt          time.Time `json:"updated_at"`
	UpdatedBy          string    `json:"updated_by"`
}

// PayloadKeys are the feature's payload keys.
func (f *Feature) PayloadKeys() PayloadKeys {
	return PayloadKeys{Customer: f.CustomerPayloadKey, Value: f.ValuePayloadKey}
}

// ExporterOr is the exporter of the feature's items: its own when the
// mapping names one, else def (the node's default).
func (f *Feature) ExporterOr(def string) string {
	if f == nil || f.Exporter == ExporterDefault {
		return def
	}
	return f.Exporter
}

// Tenant is the current (or a past) mapping of a tenant.
type Tenant struct {
	Tenant           string     `json:"tenant"`
	StripeCustomerID string     `json:"stripe_customer_id"`
	PeriodAnchor     *time.Time `json:"period_anchor,omitempty"`
	Version          int        `json:"mapping_version"`
	UpdatedAt        time.Time  `json:"updated_at"`
	UpdatedBy        string     `json:"updated_by"`
}

// Duration is a time.Duration written in JSON as Go's duration text ("1h").
type Duration time.Duration

// String renders the duration as "1h0m0s" (the console's tables print it).
func (d Duration) String() string { return time.Duration(d).String() }

// MarshalText renders the duration as "1h0m0s".
func (d Duration) MarshalText() ([]byte, error) { return []byte(time.Duration(d).String()), nil }

// UnmarshalText parses Go's duration text.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return fmt.Errorf("not a duration (e.g. 1h, 15m): %q", b)
	}
	*d = Duration(v)
	return nil
}

// Input errors: a field and why, for a 422 answer.
type FieldError struct {
	Field  string `json:"field"`
	Reason string `json:"reason"`
}

// ValidationError lists every problem with an input.
type ValidationError struct {
	Fields []FieldError
}

func (e *ValidationError) Error() string {
	parts := make([]string, len(e.Fields))
	for i, f := range e.Fields {
		parts[i] = f.Field + ": " + f.Reason
	}
	return "mappings: invalid input: " + strings.Join(parts, "; ")
}

// ErrNotFound says there is no mapping by that name.
var ErrNotFound = errors.New("mappings: no such mapping")

// Names of features and tenants: a letter or digit, then up to 63 of
// letters, digits and _.:- (the same rule as the ledger's).
var namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$`)

// ValidName reports whether s is a valid feature or tenant name.
func ValidName(s string) bool { return namePattern.MatchString(s) }

var (
	eventNamePattern = regexp.MustCompile(`^[A-Za-z0-9_.:-]{1,100}$`)
	customerPattern  = regexp.MustCompile(`^cus_[A-Za-z0-9]{1,250}$`)
)

// FeatureInput is what an operator sets for a feature.
type FeatureInput struct {
	EventName   string      `json:"event_name"`
	Aggregation Aggregation `json:"aggregation"`
	// Window defaults to one hour; it must divide a day, from 1 minute to 24
	// hours. It is ignored for per-event (count) features.
	Window Duration `json:"window"`
	// Exporter is ExporterDefault (empty: the node's TALLY_EXPORTER) or one
	// of Exporters. It is part of every item's identity, so a change gives
	// the feature's next items other identifiers.
	Exporter string `json:"exporter"`
}

func (in *FeatureInput) validate(feature string) error {
	var fe []FieldError
	if !ValidName(feature) {
		fe = append(fe, FieldError{"feature", "1 to 64 characters: letters, digits and _.:- (starting with a letter or digit)"})
	}
	if !eventNamePattern.MatchString(in.EventName) {
		fe = append(fe, FieldError{"event_name", "1 to 100 characters: letters, digits and _.:-"})
	}
	switch in.Aggregation {
	case Sum, Last, Count:
	default:
		fe = append(fe, FieldError{"aggregation", "one of sum, last, count"})
	}
	if in.Window == 0 {
		in.Window = Duration(DefaultWindow)
	}
	w := time.Duration(in.Window)
	if w < time.Minute || w > 24*time.Hour || w%time.Second != 0 || (24*time.Hour)%w != 0 {
		fe = append(fe, FieldError{"window", "from 1m to 24h, dividing a day (e.g. 1m, 15m, 1h, 6h, 24h)"})
	}
	if !ValidExporter(in.Exporter) {
		fe = append(fe, FieldError{"exporter", "empty (the node's default, TALLY_EXPORTER) or one of " + strings.Join(Exporters, ", ")})
	}
	if len(fe) > 0 {
		return &ValidationError{Fields: fe}
	}
	return nil
}

// TenantInput is what an operator sets for a tenant.
type TenantInput struct {
	StripeCustomerID string `json:"stripe_customer_id"`
	// PeriodAnchor starts the tenant's monthly billing periods; nil means
	// calendar months UTC.
	PeriodAnchor *time.Time `json:"period_anchor"`
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
	if len(fe) > 0 {
		return &ValidationError{Fields: fe}
	}
	return nil
}

// MeterChecker verifies a feature mapping against the provider's meters.
type MeterChecker interface {
	// CheckMeter returns the payload keys of the active meter with the
	// event name when its formula matches the aggregation, with a key the
	// provider leaves empty as its default (DefaultCustomerPayloadKey,
	// DefaultValuePayloadKey), and a *MeterError when no meter fits.
	CheckMeter(ctx context.Context, eventName string, aggregation Aggregation) (PayloadKeys, error)
}

// MeterError says why the provider's meters do not fit a feature mapping.
type MeterError struct {
	// Code is "meter_not_found", "meter_formula_mismatch" or
	// "meter_payload_key_invalid".
	Code    string
	Message string
}

func (e *MeterError) Error() string { return "mappings: " + e.Message }

// Store reads and writes mappings.
type Store struct {
	// Checker, when set, is asked before a feature mapping is written, and
	// gives the mapping its meter's payload keys. Unset (no Stripe key), a
	// mapping that names the same meter keeps the keys read before, and one
	// that names another takes Stripe's defaults; `tally doctor` compares
	// them with the meters once a key is configured.
	Checker MeterChecker
	// RestrictedKey says the node's Stripe key is a restricted key (rk_…).
	// Stripe's v2 API takes only secret keys ("You can only access APIs in
	// the /v2 namespace with secret keys", https://docs.stripe.com/api-v2-overview),
	// so a feature mapping that names ExporterStripeMeterEventStream is
	// refused: none of its items could be sent. The wiring sets it from
	// STRIPE_API_KEY (config.RestrictedKey).
	RestrictedKey bool
}

// Querier runs SQL.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// TxBeginner opens transactions: a pool or a connection.
type TxBeginner interface {
	Querier
	Begin(ctx context.Context) (pgx.Tx, error)
}

const featureColumns = `feature, event_name, aggregation, window_seconds, exporter, customer_payload_key, value_payload_key, version, updated_at, updated_by`

func scanFeature(row pgx.Row) (Feature, error) {
	var (
		f      Feature
		agg    string
		window int
	)
	if err := row.Scan(&f.Feature, &f.EventName, &agg, &window, &f.Exporter, &f.CustomerPayloadKey, &f.ValuePayloadKey,
		&f.Version, &f.UpdatedAt, &f.UpdatedBy); err != nil {
		return Feature{}, err
	}
	f.Aggregation, f.Window = Aggregation(agg), Duration(time.Duration(window)*time.Second)
	return f, nil
}

// PutFeature sets a feature's mapping. With a Checker, the account's
// active meter with the event name must have the aggregation as its
// formula, and the mapping takes that meter's payload keys; without one it
// keeps the keys it had for the same event name, or takes Stripe's
// defaults, which `tally doctor` checks against the meters later. An
// identical mapping — the same input and the same keys — is no change:
// the current version is returned and changed is false. A change,
// including keys that changed at Stripe, takes the next mapping version
// and is kept in the history and the audit log. by names who changed it. A ValidationError lists bad input (and the stream exporter
// on a node whose key is restricted); a *MeterError says the meter does
// not fit.
func (s *Store) PutFeature(ctx context.Context, db TxBeginner, feature string, in FeatureInput, by string) (f Feature, changed bool, err error) {
	if err := in.validate(feature); err != nil {
		return Feature{}, false, err
	}
	if s.RestrictedKey && in.Exporter == ExporterStripeMeterEventStream {
		return Feature{}, false, &ValidationError{Fields: []FieldError{{"exporter", ExporterStripeMeterEventStream +
			" sends through Stripe's v2 API, which takes only secret keys (sk_…), and this node's STRIPE_API_KEY is a restricted key (rk_…): " +
			"name " + ExporterStripeMeterEvents + " or the node's default, or configure a secret key"}}}
	}
	keys := DefaultPayloadKeys()
	if s.Checker != nil {
		if keys, err = s.Checker.CheckMeter(ctx, in.EventName, in.Aggregation); err != nil {
			return Feature{}, false, err
		}
		if err := keys.check(in.EventName); err != nil {
			return Feature{}, false, err
		}
	}
	windowSeconds := int(time.Duration(in.Window) / time.Second)
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		cur, err := scanFeature(tx.QueryRow(ctx, "SELECT "+featureColumns+" FROM feature_mappings WHERE feature = $1 FOR UPDATE", feature))
		if err == nil && s.Checker == nil && cur.EventName == in.EventName {
			// Without Stripe to ask, the keys read from the meter before
			// stay: nothing here knows better, and the defaults could be
			// wrong for it.
			keys = cur.PayloadKeys()
		}
		switch {
		case err == nil && cur.EventName == in.EventName && cur.Aggregation == in.Aggregation && cur.Window == in.Window &&
			cur.Exporter == in.Exporter && cur.PayloadKeys() == keys:
			f = cur
			return nil
		case err != nil && !errors.Is(err, pgx.ErrNoRows):
			return err
		}
		changed = true
		from := ""
		if err == nil {
			from = featureState(cur)
		}
		f, err = scanFeature(tx.QueryRow(ctx, `
			WITH v AS (SELECT nextval('mapping_version_seq')::integer AS version),
			hist AS (
				INSERT INTO feature_mapping_versions (version, feature, event_name, aggregation, window_seconds, exporter,
					customer_payload_key, value_payload_key, changed_by)
				SELECT version, $1, $2, $3, $4, $6, $7, $8, $5 FROM v
			)
			INSERT INTO feature_mappings (feature, event_name, aggregation, window_seconds, exporter,
				customer_payload_key, value_payload_key, version, updated_by)
			SELECT $1, $2, $3, $4, $6, $7, $8, version, $5 FROM v
			ON CONFLICT (feature) DO UPDATE SET event_name = EXCLUDED.event_name, aggregation = EXCLUDED.aggregation,
				window_seconds = EXCLUDED.window_seconds, exporter = EXCLUDED.exporter,
				customer_payload_key = EXCLUDED.customer_payload_key, value_payload_key = EXCLUDED.value_payload_key,
				version = EXCLUDED.version, updated_at = clock_timestamp(), updated_by = EXCLUDED.updated_by
			RETURNING `+featureColumns,
			feature, in.EventName, string(in.Aggregation), windowSeconds, by, in.Exporter, keys.Customer, keys.Value))
		if err != nil {
			return err
		}
		return audit.Record(ctx, tx, audit.Entry{Actor: by, Action: audit.ActionFeatureMapping, Subject: "feature:" + feature,
			From: from, To: featureState(f)})
	})
	if err != nil {
		return Feature{}, false, fmt.Errorf("mappings: setting feature %s: %w", feature, err)
	}
	return f, changed, nil
}

// featureState is a feature mapping as the audit log shows it, e.g.
// "v3 api_calls sum 1h0m0s exporter stripe_meter_event_stream keys
// customer=stripe_customer_id value=value" ("exporter node default" when it
// names none).
func featureState(f Feature) string {
	exp := f.Exporter
	if exp == ExporterDefault {
		exp = "node default"
	}
	return fmt.Sprintf("v%d %s %s %s exporter %s keys %s", f.Version, f.EventName, f.Aggregation, time.Duration(f.Window), exp, f.PayloadKeys())
}

// GetFeature reads a feature's current mapping.
func (s *Store) GetFeature(ctx context.Context, q Querier, feature string) (Feature, error) {
	f, err := scanFeature(q.QueryRow(ctx, "SELECT "+featureColumns+" FROM feature_mappings WHERE feature = $1", feature))
	if errors.Is(err, pgx.ErrNoRows) {
		return Feature{}, fmt.Errorf("%w: feature %s", ErrNotFound, feature)
	}
	return f, err
}

// Features lists every feature's current mapping, by name.
func (s *Store) Features(ctx context.Context, q Querier) ([]Feature, error) {
	rows, err := q.Query(ctx, "SELECT "+featureColumns+" FROM feature_mappings ORDER BY feature")
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Feature, error) { return scanFeature(r) })
}

// FeatureHistory lists every version of a feature's mapping, oldest first.
func (s *Store) FeatureHistory(ctx context.Context, q Querier, feature string) ([]Feature, error) {
	rows, err := q.Query(ctx, `SELECT feature, event_name, aggregation, window_seconds, exporter,
		customer_payload_key, value_payload_key, version, changed_at, changed_by
		FROM feature_mapping_versions WHERE feature = $1 ORDER BY version`, feature)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Feature, error) { return scanFeature(r) })
}

// FeaturesWithExporter lists, by name, the features whose current mapping
// names exporter (ExporterDefault: those that name none). A node with a
// restricted key uses it to refuse to start when a feature names
// ExporterStripeMeterEventStream.
func FeaturesWithExporter(ctx context.Context, q Querier, exporter string) ([]string, error) {
	rows, err := q.Query(ctx, "SELECT feature FROM feature_mappings WHERE exporter = $1 ORDER BY feature", exporter)
	if err != nil {
		return nil, fmt.Errorf("mappings: listing the features of exporter %s: %w", exporter, err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("mappings: listing the features of exporter %s: %w", exporter, err)
	}
	return names, nil
}

const tenantColumns = `tenant, stripe_customer_id, period_anchor, version, updated_at, updated_by`

func scanTenant(row pgx.Row) (Tenant, error) {
	var t Tenant
	if err := row.Scan(&t.Tenant, &t.StripeCustomerID, &t.PeriodAnchor, &t.Version, &t.UpdatedAt, &t.UpdatedBy); err != nil {
		return Tenant{}, err
	}
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

// PutTenant sets a tenant's mapping, like PutFeature.
func (s *Store) PutTenant(ctx context.Context, db TxBeginner, tenant string, in TenantInput, by string) (t Tenant, changed bool, err error) {
	if err := in.validate(tenant); err != nil {
		return Tenant{}, false, err
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		cur, err := scanTenant(tx.QueryRow(ctx, "SELECT "+tenantColumns+" FROM tenant_mappings WHERE tenant = $1 FOR UPDATE", tenant))
		switch {
		case err == nil && cur.StripeCustomerID == in.StripeCustomerID && sameAnchor(cur.PeriodAnchor, in.PeriodAnchor):
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
				INSERT INTO tenant_mapping_versions (version, tenant, stripe_customer_id, period_anchor, changed_by)
				SELECT version, $1, $2, $3, $4 FROM v
			)
			INSERT INTO tenant_mappings (tenant, stripe_customer_id, period_anchor, version, updated_by)
			SELECT $1, $2, $3, version, $4 FROM v
			ON CONFLICT (tenant) DO UPDATE SET stripe_customer_id = EXCLUDED.stripe_customer_id,
				period_anchor = EXCLUDED.period_anchor, version = EXCLUDED.version,
				updated_at = clock_timestamp(), updated_by = EXCLUDED.updated_by
			RETURNING `+tenantColumns,
			tenant, in.StripeCustomerID, in.PeriodAnchor, by))
		if err != nil {
			return err
		}
		return audit.Record(ctx, tx, audit.Entry{Actor: by, Action: audit.ActionTenantMapping, Subject: "tenant:" + tenant,
			From: from, To: tenantState(t)})
	})
	if err != nil {
		return Tenant{}, false, fmt.Errorf("mappings: setting tenant %s: %w", tenant, err)
	}
	return t, changed, nil
}

// tenantState is a tenant mapping as the audit log shows it.
func tenantState(t Tenant) string {
	anchor := "calendar months"
	if t.PeriodAnchor != nil {
		anchor = "anchor " + t.PeriodAnchor.Format(time.RFC3339)
	}
	return fmt.Sprintf("v%d %s %s", t.Version, t.StripeCustomerID, anchor)
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
	rows, err := q.Query(ctx, `SELECT tenant, stripe_customer_id, period_anchor, version, changed_at, changed_by
		FROM tenant_mapping_versions WHERE tenant = $1 ORDER BY version`, tenant)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Tenant, error) { return scanTenant(r) })
}

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
func (s *Store) Lookup(ctx context.Context, q Querier, tenant, feature string) (Pair, error) {
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
func (s *Store) LookupMany(ctx context.Context, q Querier, pairs map[[2]string]bool) (map[[2]string]Pair, error) {
	out := make(map[[2]string]Pair, len(pairs))
	var tenants, features []string
	for p := range pairs {
		tenants, features = append(tenants, p[0]), append(features, p[1])
	}
	rows, err := q.Query(ctx, `
		SELECT u.t, u.f,
		       f.event_name, f.aggregation, f.window_seconds, f.exporter, f.customer_payload_key, f.value_payload_key,
		       f.version, f.updated_at, f.updated_by,
		       t.stripe_customer_id, t.period_anchor, t.version, t.updated_at, t.updated_by
		FROM unnest($1::text[], $2::text[]) AS u(t, f)
		LEFT JOIN feature_mappings f ON f.feature = u.f
		LEFT JOIN tenant_mappings t ON t.tenant = u.t`, tenants, features)
	if err != nil {
		return nil, fmt.Errorf("mappings: reading mappings: %w", err)
	}
	var (
		tenant, feature      string
		ev, agg, exp, ck, vk *string
		cust, fby, tby       *string
		window, fv, tv       *int
		anchor, fat, tat     *time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&tenant, &feature, &ev, &agg, &window, &exp, &ck, &vk, &fv, &fat, &fby,
		&cust, &anchor, &tv, &tat, &tby}, func() error {
		var p Pair
		if fv != nil {
			p.Feature = &Feature{Feature: feature, EventName: *ev, Aggregation: Aggregation(*agg),
				Window: Duration(time.Duration(*window) * time.Second), Exporter: *exp,
				CustomerPayloadKey: *ck, ValuePayloadKey: *vk, Version: *fv, UpdatedAt: *fat, UpdatedBy: *fby}
		}
		if tv != nil {
			p.Tenant = &Tenant{Tenant: tenant, StripeCustomerID: *cust, Version: *tv, UpdatedAt: *tat, UpdatedBy: *tby}
			if anchor != nil {
				a := anchor.UTC()
				p.Tenant.PeriodAnchor = &a
			}
		}
		out[[2]string{tenant, feature}] = p
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("mappings: reading mappings: %w", err)
	}
	return out, nil
}
