package mappings_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
)

func TestMain(m *testing.M) { testdb.Main(m) }

func TestFeatureVersionsAndHistory(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	f1, changed, err := s.PutFeature(ctx, pool, "api", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum}, "alice")
	require.NoError(t, err)
	require.True(t, changed)
	require.Equal(t, mappings.Duration(time.Hour), f1.Window, "the default window")

	same, changed, err := s.PutFeature(ctx, pool, "api", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum, Window: mappings.Duration(time.Hour)}, "bob")
	require.NoError(t, err)
	require.False(t, changed, "an identical mapping is no change")
	require.Equal(t, f1.Version, same.Version)
	require.Equal(t, "alice", same.UpdatedBy)

	tn, _, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_1"}, "alice")
	require.NoError(t, err)
	require.Greater(t, tn.Version, f1.Version, "one sequence numbers both kinds")

	f2, changed, err := s.PutFeature(ctx, pool, "api", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum, Window: mappings.Duration(15 * time.Minute)}, "carol")
	require.NoError(t, err)
	require.True(t, changed)
	require.Greater(t, f2.Version, tn.Version)

	hist, err := s.FeatureHistory(ctx, pool, "api")
	require.NoError(t, err)
	require.Len(t, hist, 2)
	require.Equal(t, []int{f1.Version, f2.Version}, []int{hist[0].Version, hist[1].Version})
	require.Equal(t, mappings.Duration(time.Hour), hist[0].Window)
	require.Equal(t, "carol", hist[1].UpdatedBy)

	pair, err := s.Lookup(ctx, pool, "acme", "api")
	require.NoError(t, err)
	require.Equal(t, f2.Version, pair.Version())
	none, err := s.Lookup(ctx, pool, "nobody", "nothing")
	require.NoError(t, err)
	require.Nil(t, none.Feature)
	require.Nil(t, none.Tenant)
	require.Zero(t, none.Version())

	_, err = s.GetFeature(ctx, pool, "nothing")
	require.ErrorIs(t, err, mappings.ErrNotFound)
	_, err = pool.Exec(ctx, "UPDATE feature_mapping_versions SET event_name = 'x'")
	require.ErrorContains(t, err, "append-only")
}

func TestTenantAnchor(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	a := time.Date(2026, 1, 31, 10, 0, 0, 500, time.FixedZone("x", 3600))
	tn, _, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_1", PeriodAnchor: &a}, "alice")
	require.NoError(t, err)
	require.Equal(t, time.Date(2026, 1, 31, 9, 0, 0, 0, time.UTC), *tn.PeriodAnchor, "UTC, whole seconds")
	_, changed, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_1", PeriodAnchor: &a}, "bob")
	require.NoError(t, err)
	require.False(t, changed)
	_, changed, err = s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_1"}, "bob")
	require.NoError(t, err)
	require.True(t, changed, "dropping the anchor is a change")
}

func TestInputValidation(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	bad := []struct {
		feature string
		in      mappings.FeatureInput
		field   string
	}{
		{"a b", mappings.FeatureInput{EventName: "e", Aggregation: mappings.Sum}, "feature"},
		{"f", mappings.FeatureInput{EventName: "", Aggregation: mappings.Sum}, "event_name"},
		{"f", mappings.FeatureInput{EventName: "e", Aggregation: "avg"}, "aggregation"},
		{"f", mappings.FeatureInput{EventName: "e", Aggregation: mappings.Sum, Window: mappings.Duration(7 * time.Minute)}, "window"},
		{"f", mappings.FeatureInput{EventName: "e", Aggregation: mappings.Sum, Window: mappings.Duration(48 * time.Hour)}, "window"},
		{"f", mappings.FeatureInput{EventName: "e", Aggregation: mappings.Sum, Window: mappings.Duration(30 * time.Second)}, "window"},
		{"f", mappings.FeatureInput{EventName: "e", Aggregation: mappings.Sum, Exporter: "stripe_v3"}, "exporter"},
		{"f", mappings.FeatureInput{EventName: "e", Aggregation: mappings.Sum, Exporter: "Stripe_Meter_Events"}, "exporter"},
		{"f", mappings.FeatureInput{EventName: "e", Aggregation: mappings.Sum, Exporter: " stripe_meter_events"}, "exporter"},
	}
	for _, tc := range bad {
		_, _, err := s.PutFeature(ctx, pool, tc.feature, tc.in, "x")
		var ve *mappings.ValidationError
		require.ErrorAs(t, err, &ve, "%+v", tc)
		require.Equal(t, tc.field, ve.Fields[0].Field)
	}
	_, _, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "acme"}, "x")
	var ve *mappings.ValidationError
	require.ErrorAs(t, err, &ve)
	require.Equal(t, "stripe_customer_id", ve.Fields[0].Field)
	fs, err := s.Features(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, fs, "nothing written")
}

// With a Stripe key, a feature mapping is checked against the account's
// meters (here the project's simulator, through stripe-go).
func TestMeterCheckAgainstStripe(t *testing.T) {
	t.Parallel()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(srv.Close)
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "API", EventName: "api_calls", Formula: "sum"})
	old := sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "Old", EventName: "old_calls", Formula: "sum"})
	require.NoError(t, sim.DeactivateMeter(stripesim.DefaultAccount, old.ID))
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)

	ctx, pool := context.Background(), testdb.New(t)
	s := &mappings.Store{Checker: mappings.StripeMeters{Client: c}}
	_, _, err = s.PutFeature(ctx, pool, "api", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum}, "x")
	require.NoError(t, err)

	cases := []struct {
		in   mappings.FeatureInput
		code string
	}{
		{mappings.FeatureInput{EventName: "nope", Aggregation: mappings.Sum}, "meter_not_found"},
		{mappings.FeatureInput{EventName: "old_calls", Aggregation: mappings.Sum}, "meter_not_found"},
		{mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Last}, "meter_formula_mismatch"},
	}
	for _, tc := range cases {
		_, _, err := s.PutFeature(ctx, pool, "other", tc.in, "x")
		var me *mappings.MeterError
		require.ErrorAs(t, err, &me, "%+v", tc.in)
		require.Equal(t, tc.code, me.Code)
	}
	_, err = s.GetFeature(ctx, pool, "other")
	require.ErrorIs(t, err, mappings.ErrNotFound, "a refused mapping is not written")

	bad, err := stripeapi.New(stripeapi.Config{Key: "sk_test_wrong", APIBase: srv.URL})
	require.NoError(t, err)
	s.Checker = mappings.StripeMeters{Client: bad}
	_, _, err = s.PutFeature(ctx, pool, "x", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum}, "x")
	var pu *mappings.ErrProviderUnavailable
	require.ErrorAs(t, err, &pu)
	require.Equal(t, 401, pu.Status)
}

// The exporter a feature mapping names is part of the mapping: a change is a
// new version, kept in the history and shown in the audit log; the same
// exporter again is no change; back to empty is the node's default again.
func TestFeatureExporter(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	base := mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum}
	f1, _, err := s.PutFeature(ctx, pool, "api", base, "alice")
	require.NoError(t, err)
	require.Equal(t, mappings.ExporterDefault, f1.Exporter)
	require.Equal(t, "stripe_meter_events", f1.ExporterOr("stripe_meter_events"), "the node's default")

	stream := base
	stream.Exporter = mappings.ExporterStripeMeterEventStream
	f2, changed, err := s.PutFeature(ctx, pool, "api", stream, "bob")
	require.NoError(t, err)
	require.True(t, changed, "another exporter is a change")
	require.Greater(t, f2.Version, f1.Version)
	require.Equal(t, "stripe_meter_event_stream", f2.Exporter)
	require.Equal(t, "stripe_meter_event_stream", f2.ExporterOr("stripe_meter_events"))
	same, changed, err := s.PutFeature(ctx, pool, "api", stream, "carol")
	require.NoError(t, err)
	require.False(t, changed, "an identical mapping is no change")
	require.Equal(t, f2.Version, same.Version)

	// Naming the default exporter explicitly is a choice of its own: it no
	// longer follows TALLY_EXPORTER.
	v1 := base
	v1.Exporter = mappings.ExporterStripeMeterEvents
	f3, changed, err := s.PutFeature(ctx, pool, "api", v1, "dan")
	require.NoError(t, err)
	require.True(t, changed)
	f4, changed, err := s.PutFeature(ctx, pool, "api", base, "erin")
	require.NoError(t, err)
	require.True(t, changed, "back to the node's default")
	require.Empty(t, f4.Exporter)

	got, err := s.GetFeature(ctx, pool, "api")
	require.NoError(t, err)
	require.Equal(t, f4.Version, got.Version)
	require.Empty(t, got.Exporter)
	hist, err := s.FeatureHistory(ctx, pool, "api")
	require.NoError(t, err)
	var exporters []string
	for _, h := range hist {
		exporters = append(exporters, h.Exporter)
	}
	require.Equal(t, []string{"", "stripe_meter_event_stream", "stripe_meter_events", ""}, exporters)
	list, err := s.Features(ctx, pool)
	require.NoError(t, err)
	require.Len(t, list, 1)

	pair, err := s.Lookup(ctx, pool, "acme", "api")
	require.NoError(t, err)
	require.Empty(t, pair.Feature.Exporter)
	_, _, err = s.PutFeature(ctx, pool, "api", stream, "fay")
	require.NoError(t, err)
	pair, err = s.Lookup(ctx, pool, "acme", "api")
	require.NoError(t, err)
	require.Equal(t, "stripe_meter_event_stream", pair.Feature.Exporter)

	entries, err := audit.List(ctx, pool, "feature:api", 10)
	require.NoError(t, err)
	require.Len(t, entries, 5, "one entry per change, none for the identical PUT")
	require.Equal(t, fmt.Sprintf("v%d api_calls sum 1h0m0s exporter node default keys customer=stripe_customer_id value=value", f1.Version), entries[4].To)
	require.Equal(t, entries[4].To, entries[3].From)
	require.Equal(t, fmt.Sprintf("v%d api_calls sum 1h0m0s exporter stripe_meter_event_stream keys customer=stripe_customer_id value=value", f2.Version), entries[3].To)
	require.Equal(t, fmt.Sprintf("v%d api_calls sum 1h0m0s exporter stripe_meter_events keys customer=stripe_customer_id value=value", f3.Version), entries[2].To)

	_, err = pool.Exec(ctx, "UPDATE feature_mappings SET exporter = 'stripe_v3'")
	require.ErrorContains(t, err, "feature_mappings_exporter_check", "the database refuses other names too")
}

// The names package mappings accepts are package exporter's.
func TestExportersMirrorPackageExporter(t *testing.T) {
	t.Parallel()
	require.Equal(t, exporter.StripeMeterEvents, mappings.ExporterStripeMeterEvents)
	require.Equal(t, exporter.StripeMeterEventStream, mappings.ExporterStripeMeterEventStream)
	require.Equal(t, []string{exporter.StripeMeterEvents, exporter.StripeMeterEventStream}, mappings.Exporters)
	require.True(t, mappings.ValidExporter(""))
	require.False(t, mappings.ValidExporter("stripe"))
}

// simMeters is a simulator with the account's meters, and a Store that
// checks feature mappings against them through stripe-go.
func simMeters(t *testing.T) (*stripesim.Server, *mappings.Store) {
	t.Helper()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	return sim, &mappings.Store{Checker: mappings.StripeMeters{Client: c}}
}

// A feature mapping carries the payload keys of the meter it was set
// against: shown by GetFeature, Features, FeatureHistory and Lookup. When
// the meter with that event name reads other keys (Stripe's meters cannot
// change their keys: a new meter takes the event name), the same PUT is a
// change: a new version, in the history and the audit log.
func TestFeatureCarriesTheMetersPayloadKeys(t *testing.T) {
	t.Parallel()
	sim, s := simMeters(t)
	ctx, pool := context.Background(), testdb.New(t)
	old := sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "api_calls", Formula: "sum",
		CustomerPayloadKey: "account", ValuePayloadKey: "calls"})
	in := mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum}

	f1, changed, err := s.PutFeature(ctx, pool, "api", in, "alice")
	require.NoError(t, err)
	require.True(t, changed)
	require.Equal(t, "account", f1.CustomerPayloadKey)
	require.Equal(t, "calls", f1.ValuePayloadKey)
	require.Equal(t, mappings.PayloadKeys{Customer: "account", Value: "calls"}, f1.PayloadKeys())
	same, changed, err := s.PutFeature(ctx, pool, "api", in, "bob")
	require.NoError(t, err)
	require.False(t, changed, "the same meter again is no change")
	require.Equal(t, f1.Version, same.Version)

	require.NoError(t, sim.DeactivateMeter(stripesim.DefaultAccount, old.ID))
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "api_calls", Formula: "sum"})
	f2, changed, err := s.PutFeature(ctx, pool, "api", in, "carol")
	require.NoError(t, err)
	require.True(t, changed, "the meter's keys changed at Stripe: a change")
	require.Greater(t, f2.Version, f1.Version)
	require.Equal(t, mappings.DefaultCustomerPayloadKey, f2.CustomerPayloadKey)
	require.Equal(t, mappings.DefaultValuePayloadKey, f2.ValuePayloadKey)

	got, err := s.GetFeature(ctx, pool, "api")
	require.NoError(t, err)
	require.Equal(t, f2, got)
	list, err := s.Features(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, []mappings.Feature{f2}, list)
	pair, err := s.Lookup(ctx, pool, "acme", "api")
	require.NoError(t, err)
	require.Equal(t, mappings.PayloadKeys{Customer: "stripe_customer_id", Value: "value"}, pair.Feature.PayloadKeys())
	hist, err := s.FeatureHistory(ctx, pool, "api")
	require.NoError(t, err)
	require.Len(t, hist, 2)
	require.Equal(t, mappings.PayloadKeys{Customer: "account", Value: "calls"}, hist[0].PayloadKeys())
	require.Equal(t, mappings.PayloadKeys{Customer: "stripe_customer_id", Value: "value"}, hist[1].PayloadKeys())

	entries, err := audit.List(ctx, pool, "feature:api", 10)
	require.NoError(t, err)
	require.Len(t, entries, 2, "one entry per change")
	require.Equal(t, fmt.Sprintf("v%d api_calls sum 1h0m0s exporter node default keys customer=account value=calls", f1.Version), entries[1].To)
	require.Equal(t, entries[1].To, entries[0].From)
	require.Equal(t, fmt.Sprintf("v%d api_calls sum 1h0m0s exporter node default keys customer=stripe_customer_id value=value", f2.Version), entries[0].To)

	b, err := json.Marshal(f1)
	require.NoError(t, err)
	require.Contains(t, string(b), `"customer_payload_key":"account","value_payload_key":"calls"`)
}

// Without a checker (no Stripe key) a feature mapping takes Stripe's
// default keys.
func TestFeatureWithoutCheckerTakesTheDefaultKeys(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	f, _, err := s.PutFeature(ctx, pool, "api", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum}, "alice")
	require.NoError(t, err)
	require.Equal(t, "stripe_customer_id", f.CustomerPayloadKey)
	require.Equal(t, "value", f.ValuePayloadKey)
	require.Equal(t, mappings.DefaultPayloadKeys(), f.PayloadKeys())
}

// A mapping set where Stripe cannot be asked (a CLI without STRIPE_API_KEY)
// keeps the keys read from the meter before, as long as it names the same
// meter: resetting them to the defaults would send the next items under
// keys the meter does not read. Naming another meter takes the defaults,
// and doctor checks them.
func TestFeatureWithoutCheckerKeepsTheMetersKeys(t *testing.T) {
	t.Parallel()
	sim, checked := simMeters(t)
	ctx, pool := context.Background(), testdb.New(t)
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "api_calls", Formula: "sum",
		CustomerPayloadKey: "account", ValuePayloadKey: "calls"})
	f1, _, err := checked.PutFeature(ctx, pool, "api", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum}, "alice")
	require.NoError(t, err)

	blind := &mappings.Store{}
	f2, changed, err := blind.PutFeature(ctx, pool, "api", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum,
		Window: mappings.Duration(30 * time.Minute)}, "bob")
	require.NoError(t, err)
	require.True(t, changed, "the window changed")
	require.Equal(t, f1.PayloadKeys(), f2.PayloadKeys(), "the meter's keys stay")

	f3, _, err := blind.PutFeature(ctx, pool, "api", mappings.FeatureInput{EventName: "other", Aggregation: mappings.Sum}, "bob")
	require.NoError(t, err)
	require.Equal(t, mappings.DefaultPayloadKeys(), f3.PayloadKeys(), "another meter: the defaults, until doctor says otherwise")
}

// A meter whose keys are no plausible payload keys is refused, and nothing
// is written.
func TestImplausiblePayloadKeysAreRefused(t *testing.T) {
	t.Parallel()
	sim, s := simMeters(t)
	ctx, pool := context.Background(), testdb.New(t)
	for i, keys := range []mappings.PayloadKeys{
		{Customer: strings.Repeat("k", 101), Value: "value"},
		{Customer: "stripe_customer_id", Value: strings.Repeat("v", 101)},
		{Customer: "cust\tomer", Value: "value"},
		{Customer: "stripe_customer_id", Value: "val\u0085ue"},
		{Customer: "same", Value: "same"},
	} {
		name := fmt.Sprintf("meter_%d", i)
		sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: name, CustomerPayloadKey: keys.Customer, ValuePayloadKey: keys.Value})
		_, _, err := s.PutFeature(ctx, pool, name, mappings.FeatureInput{EventName: name, Aggregation: mappings.Sum}, "x")
		var me *mappings.MeterError
		require.ErrorAs(t, err, &me, "%+v", keys)
		require.Equal(t, "meter_payload_key_invalid", me.Code)
		require.NotContains(t, me.Message, "\t", "the message does not echo a control character")
	}
	// 100 characters is still a key.
	long := mappings.PayloadKeys{Customer: strings.Repeat("k", 100), Value: "v"}
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "long", CustomerPayloadKey: long.Customer, ValuePayloadKey: long.Value})
	f, _, err := s.PutFeature(ctx, pool, "long", mappings.FeatureInput{EventName: "long", Aggregation: mappings.Sum}, "x")
	require.NoError(t, err)
	require.Equal(t, long, f.PayloadKeys())

	fs, err := s.Features(ctx, pool)
	require.NoError(t, err)
	require.Len(t, fs, 1, "only the plausible one is written")
	_, err = pool.Exec(ctx, "UPDATE feature_mappings SET value_payload_key = customer_payload_key")
	require.ErrorContains(t, err, "feature_mappings_payload_keys_check", "the database refuses them too")
	_, err = pool.Exec(ctx, "UPDATE feature_mappings SET value_payload_key = E'a\\x01'")
	require.ErrorContains(t, err, "feature_mappings_value_payload_key_check")
	_, err = pool.Exec(ctx, "UPDATE feature_mappings SET customer_payload_key = ''")
	require.ErrorContains(t, err, "feature_mappings_customer_payload_key_check")
}

// With a restricted key (rk_…) the node cannot use Stripe's v2 API, so a
// feature mapping that names the stream exporter is refused as a field
// problem; v1 and the node's default stay allowed.
func TestRestrictedKeyRefusesTheStreamExporter(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{RestrictedKey: true}
	in := mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum, Exporter: mappings.ExporterStripeMeterEventStream}
	_, _, err := s.PutFeature(ctx, pool, "api", in, "x")
	var ve *mappings.ValidationError
	require.ErrorAs(t, err, &ve)
	require.Len(t, ve.Fields, 1)
	require.Equal(t, "exporter", ve.Fields[0].Field)
	require.Contains(t, ve.Fields[0].Reason, "restricted")
	_, err = s.GetFeature(ctx, pool, "api")
	require.ErrorIs(t, err, mappings.ErrNotFound, "nothing written")

	for _, exp := range []string{mappings.ExporterDefault, mappings.ExporterStripeMeterEvents} {
		in.Exporter = exp
		_, _, err := s.PutFeature(ctx, pool, "api", in, "x")
		require.NoError(t, err, exp)
	}
}

// FeaturesWithExporter lists the features whose mapping names an exporter,
// by name; the node's default is named by none.
func TestFeaturesWithExporter(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	for name, exp := range map[string]string{"b": mappings.ExporterStripeMeterEventStream, "a": mappings.ExporterStripeMeterEventStream,
		"c": mappings.ExporterStripeMeterEvents, "d": mappings.ExporterDefault} {
		_, _, err := s.PutFeature(ctx, pool, name, mappings.FeatureInput{EventName: name, Aggregation: mappings.Sum, Exporter: exp}, "x")
		require.NoError(t, err)
	}
	got, err := mappings.FeaturesWithExporter(ctx, pool, mappings.ExporterStripeMeterEventStream)
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b"}, got)
	got, err = mappings.FeaturesWithExporter(ctx, pool, mappings.ExporterStripeMeterEvents)
	require.NoError(t, err)
	require.Equal(t, []string{"c"}, got)
	got, err = mappings.FeaturesWithExporter(ctx, pool, "nothing")
	require.NoError(t, err)
	require.Empty(t, got)
}

// Migration 12 gives the mappings that existed before it, and their
// history, Stripe's default keys.
func TestMigrationGivesExistingMappingsTheDefaultKeys(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS("../migrations"), goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	_, err = p.ApplyVersion(ctx, 12, false)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
		WITH v AS (SELECT nextval('mapping_version_seq')::integer AS version),
		hist AS (INSERT INTO feature_mapping_versions (version, feature, event_name, aggregation, window_seconds, changed_by)
			SELECT version, 'api', 'api_calls', 'sum', 3600, 'before' FROM v)
		INSERT INTO feature_mappings (feature, event_name, aggregation, window_seconds, version, updated_by)
		SELECT 'api', 'api_calls', 'sum', 3600, version, 'before' FROM v`)
	require.NoError(t, err)
	_, err = p.ApplyVersion(ctx, 12, true)
	require.NoError(t, err)

	s := &mappings.Store{}
	f, err := s.GetFeature(ctx, pool, "api")
	require.NoError(t, err)
	require.Equal(t, mappings.DefaultPayloadKeys(), f.PayloadKeys())
	hist, err := s.FeatureHistory(ctx, pool, "api")
	require.NoError(t, err)
	require.Equal(t, mappings.DefaultPayloadKeys(), hist[0].PayloadKeys())
	_, changed, err := s.PutFeature(ctx, pool, "api", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum}, "after")
	require.NoError(t, err)
	require.False(t, changed, "the same mapping with the default keys is no change")
	_, err = pool.Exec(ctx, "INSERT INTO feature_mappings (feature, event_name, aggregation, window_seconds, version, updated_by) VALUES ('b', 'b', 'sum', 3600, 999999, 'x')")
	require.ErrorContains(t, err, "customer_payload_key", "no default in the database: every writer names the keys")
}

// A pre-aggregated meter keeps only the latest event of each customer and
// window ("a newer event overwrites the previous one",
// docs.stripe.com/billing/subscriptions/usage-based/meters/configure): a
// supplement or a correction would replace what was sent before it. The
// mapping refuses such a meter.
func TestPreAggregatedMeterIsRefused(t *testing.T) {
	t.Parallel()
	sim, s := simMeters(t)
	ctx, pool := context.Background(), testdb.New(t)
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "api_calls", Formula: "sum", EventTimeWindow: "hour"})
	_, _, err := s.PutFeature(ctx, pool, "api", mappings.FeatureInput{EventName: "api_calls", Aggregation: mappings.Sum}, "alice")
	var me *mappings.MeterError
	require.ErrorAs(t, err, &me)
	require.Equal(t, "meter_pre_aggregated", me.Code)
	_, err = s.GetFeature(ctx, pool, "api")
	require.Error(t, err, "nothing was saved")
}
