package mappings

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/pgdb"
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
// the CHECK of feature_mappings.exporter.
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

// Duration is a time.Duration written in JSON as Go's duration text ("1h").
type Duration time.Duration

// String renders the duration as Go does ("1h0m0s").
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
// and is kept in the history and the audit log. by names who changed it.
// A ValidationError lists bad input (and the stream exporter on a node
// whose key is restricted); a *MeterError says the meter does not fit.
func (s *Store) PutFeature(ctx context.Context, db pgdb.Beginner, feature string, in FeatureInput, by string) (f Feature, changed bool, err error) {
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
		// An update takes the new row's updated_at (its column default, the
		// clock): a distributed database refuses a function that is not
		// IMMUTABLE in DO UPDATE SET, and the mappings are reference tables.
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
				version = EXCLUDED.version, updated_at = EXCLUDED.updated_at, updated_by = EXCLUDED.updated_by
			RETURNING `+featureColumns,
			feature, in.EventName, string(in.Aggregation), windowSeconds, by, in.Exporter, keys.Customer, keys.Value))
		if err != nil {
			return err
		}
		return audit.Record(ctx, tx, audit.Entry{Actor: by, Action: audit.ActionFeatureMapping, Subject: "feature:" + feature,
			From: from, To: featureState(f), Reason: s.auditReason()})
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
func (s *Store) GetFeature(ctx context.Context, q pgdb.Querier, feature string) (Feature, error) {
	f, err := scanFeature(q.QueryRow(ctx, "SELECT "+featureColumns+" FROM feature_mappings WHERE feature = $1", feature))
	if errors.Is(err, pgx.ErrNoRows) {
		return Feature{}, fmt.Errorf("%w: feature %s", ErrNotFound, feature)
	}
	return f, err
}

// Features lists every feature's current mapping, by name.
func (s *Store) Features(ctx context.Context, q pgdb.Querier) ([]Feature, error) {
	rows, err := q.Query(ctx, "SELECT "+featureColumns+" FROM feature_mappings ORDER BY feature")
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Feature, error) { return scanFeature(r) })
}

// FeatureHistory lists every version of a feature's mapping, oldest first.
func (s *Store) FeatureHistory(ctx context.Context, q pgdb.Querier, feature string) ([]Feature, error) {
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
func FeaturesWithExporter(ctx context.Context, q pgdb.Querier, exporter string) ([]string, error) {
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
