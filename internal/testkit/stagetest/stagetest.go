// Package stagetest is the test harness of the staging path: a fresh,
// migrated database (from internal/testkit/testdb), an outbox, mappings, a stager
// addressed to a fixed test destination and an ingester, with helpers to
// map, ingest and stage. It is for tests only, and the package using it must
// call testdb.Main from its TestMain.
package stagetest

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// Env is one test's staging path.
type Env struct {
	Ctx      context.Context
	Pool     *pgxpool.Pool
	Outbox   *outbox.Store
	Maps     *mappings.Store
	Stager   *meter.Stager
	Ingester *meter.Ingester
	// Target is where the stager addresses items; a test may change it.
	Target meter.Target
}

// New returns an Env on a fresh database with the outbox config cfg, a
// grace of one minute and a test-mode destination acct_1 that takes
// values of at most 15 digits, as Stripe does.
func New(t testing.TB, cfg outbox.Config) *Env {
	t.Helper()
	return NewOn(t, cfg, testdb.New(t))
}

// NewOn is New on pool's database, migrated (testdb.NewDistributed's, for
// one).
func NewOn(t testing.TB, cfg outbox.Config, pool *pgxpool.Pool) *Env {
	t.Helper()
	ob, err := outbox.New(cfg, nil)
	require.NoError(t, err)
	e := &Env{Ctx: context.Background(), Pool: pool, Outbox: ob, Maps: &mappings.Store{},
		Target: meter.Target{Exporter: "stripe_meter_events", Account: "acct_1", Mode: outbox.ModeTest,
			AcceptPast: 35 * 24 * time.Hour, AcceptFuture: 5 * time.Minute, MaxValue: stripeapi.MaxValue,
			// Tests date usage hours back, which in the first hours of a
			// month is in a period whose invoice closed an hour after it
			// ended: the longest grace keeps it from being late, and late
			// usage would be sent anyway. Late-usage tests set both.
			InvoiceGrace: meter.MaxInvoiceGrace, LateUsage: meter.LateSend}}
	e.Stager = &meter.Stager{Outbox: ob, Grace: time.Minute, Target: func(context.Context) (meter.Target, bool) { return e.Target, true }}
	e.Ingester = &meter.Ingester{Stager: e.Stager}
	return e
}

// Feature maps a feature to the meter whose event name is its own name,
// exported by the node's default exporter.
func (e *Env) Feature(t testing.TB, name string, agg mappings.Aggregation, window time.Duration) mappings.Feature {
	t.Helper()
	return e.FeatureWith(t, name, mappings.FeatureInput{EventName: name, Aggregation: agg, Window: mappings.Duration(window)})
}

// FeatureWith sets a feature's mapping to in, e.g. one that names its own
// exporter.
func (e *Env) FeatureWith(t testing.TB, name string, in mappings.FeatureInput) mappings.Feature {
	t.Helper()
	f, _, err := e.Maps.PutFeature(e.Ctx, e.Pool, name, in, "test")
	require.NoError(t, err)
	return f
}

// Item is an outbox item's address as staging made it.
type Item struct {
	ID             int64
	Feature        string
	SubjectRef     string
	Exporter       string
	MappingVersion int
	Identifier     string
	State          outbox.State
}

// Items lists every outbox item's address, by id.
func (e *Env) Items(t testing.TB) []Item {
	t.Helper()
	rows, err := e.Pool.Query(e.Ctx, `SELECT id, coalesce(payload ->> 'feature', ''), subject_ref, exporter, mapping_version,
		identifier, state FROM outbox_items ORDER BY id`)
	require.NoError(t, err)
	items, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Item, error) {
		var it Item
		err := r.Scan(&it.ID, &it.Feature, &it.SubjectRef, &it.Exporter, &it.MappingVersion, &it.Identifier, &it.State)
		return it, err
	})
	require.NoError(t, err)
	return items
}

// Tenant maps a tenant to the customer "cus_" + its name (dashes dropped).
func (e *Env) Tenant(t testing.TB, name string, anchor *time.Time) mappings.Tenant {
	t.Helper()
	tn, _, err := e.Maps.PutTenant(e.Ctx, e.Pool, name, mappings.TenantInput{StripeCustomerID: "cus_" + strings.ReplaceAll(name, "-", ""), PeriodAnchor: anchor}, "test")
	require.NoError(t, err)
	return tn
}

// Ingest writes events in one transaction, as POST /v1/usage does.
func (e *Env) Ingest(t testing.TB, events ...meter.Event) (meter.Result, error) {
	t.Helper()
	var res meter.Result
	err := pgx.BeginFunc(e.Ctx, e.Pool, func(tx pgx.Tx) error {
		var err error
		res, err = e.Ingester.Ingest(e.Ctx, tx, events)
		return err
	})
	return res, err
}

// MustIngest is Ingest that fails the test on an error.
func (e *Env) MustIngest(t testing.TB, events ...meter.Event) meter.Result {
	t.Helper()
	res, err := e.Ingest(t, events...)
	require.NoError(t, err)
	return res
}

// Pass runs one staging pass.
func (e *Env) Pass(t testing.TB) meter.PassResult {
	t.Helper()
	res, err := e.Stager.Pass(e.Ctx, e.Pool)
	require.NoError(t, err)
	return res
}

// Ago is the time d ago, in UTC, to the microsecond.
func Ago(d time.Duration) *time.Time {
	v := time.Now().UTC().Add(-d).Truncate(time.Microsecond)
	return &v
}

// Ev is a usage event.
func Ev(id, tenant, feature string, value int64, ts *time.Time) meter.Event {
	return meter.Event{ID: id, Tenant: tenant, Feature: feature, Value: value, Timestamp: ts}
}

// AddMonths is t moved by n months as Stripe's billing cycles and
// tally_period_start move an anchor: the anchor's day, clamped to the
// month's last (January 31 plus a month is February 28), its time of day
// kept. Go's AddDate would overflow into the next month instead.
func AddMonths(t time.Time, n int) time.Time {
	t = t.UTC()
	first := time.Date(t.Year(), t.Month()+time.Month(n), 1, t.Hour(), t.Minute(), t.Second(), t.Nanosecond(), time.UTC)
	last := first.AddDate(0, 1, -1).Day()
	return first.AddDate(0, 0, min(t.Day(), last)-1)
}
