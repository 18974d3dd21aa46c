package doctor_test

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/cmd/tally/doctor"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// restrictedKey is a restricted test key (the simulator is still reached
// with the secret key of each setup's Resolver).
const restrictedKey = "rk_test_doctor0123456789"

type setup struct {
	env  *stagetest.Env
	sim  *stripesim.Server
	base string
	cfg  config.Config
}

// healthy is a database with mapped usage, a simulator with the meters,
// and a configuration with a key and a webhook secret.
func healthy(t *testing.T) *setup {
	t.Helper()
	sim := stripesim.New(stripesim.Options{})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: "api", EventName: "api", Formula: "sum"})
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_t1")
	env := stagetest.New(t, outbox.Config{})
	env.Feature(t, "api", mappings.Sum, time.Hour)
	env.Tenant(t, "t1", nil)
	env.MustIngest(t, stagetest.Ev("e1", "t1", "api", 3, nil))
	cfg := config.Config{StripeAPIKey: stripesim.DefaultKey, StripeAPIBase: srv.URL, StripeWebhookSecret: "whsec_x",
		Exporter: "stripe_meter_events", ReconcileSchedule: "0 2 * * *", DatabaseURL: "postgres://set"}
	return &setup{env: env, sim: sim, base: srv.URL, cfg: cfg}
}

func (s *setup) run(t *testing.T, mutate func(*doctor.Deps)) map[string]doctor.Result {
	t.Helper()
	res, err := exporter.NewResolver(exporter.Settings{Key: s.cfg.StripeAPIKey, APIBase: s.cfg.StripeAPIBase})
	require.NoError(t, err)
	d := doctor.Deps{Config: s.cfg, Pool: s.env.Pool, Resolver: res}
	if mutate != nil {
		mutate(&d)
	}
	out := map[string]doctor.Result{}
	for _, r := range doctor.Run(context.Background(), d) {
		out[r.Check] = r
		require.NotContains(t, r.Detail+r.Fix, stripesim.DefaultKey, "no secret in the output")
		require.NotContains(t, r.Detail+r.Fix, restrictedKey, "no key in the output")
		require.NotContains(t, r.Detail+r.Fix, "s3cret", "no password in the output")
	}
	return out
}

func TestHealthy(t *testing.T) {
	t.Parallel()
	s := healthy(t)
	rs := s.run(t, nil)
	for _, check := range []string{"configuration", "database", "migrations", "engine", "clock", "stripe", "stripe v2", "mappings", "meters", "payload keys", "customers", "billing periods"} {
		require.Equal(t, doctor.OK, rs[check].Status, "%s: %+v", check, rs[check])
	}
	require.Contains(t, rs["stripe"].Detail, "account acct_sim, test mode")
	require.Regexp(t, `^PostgreSQL 15\.\d+, one server$`, rs["engine"].Detail)
}

// failureCase is one failure the doctor checks: how to bring it about
// (prepare the database or the simulator, mutate the doctor's inputs), and
// what the check named says of it.
type failureCase struct {
	name    string
	prepare func(t *testing.T, s *setup)
	mutate  func(*doctor.Deps)
	check   string
	status  doctor.Status
	says    string
	fix     string // when set, what the fix says
}

// Each failure of the configuration and of Stripe, one at a time, with what
// the doctor says.
func TestEachStripeFailure(t *testing.T) {
	t.Parallel()
	runFailures(t, []failureCase{
		{name: "no key", mutate: func(d *doctor.Deps) {
			d.Config.StripeAPIKey = ""
			d.Resolver, _ = exporter.NewResolver(exporter.Settings{})
		}, check: "configuration", status: doctor.Problem, says: "STRIPE_API_KEY is unset"},
		{name: "no webhook secret is a warning", mutate: func(d *doctor.Deps) { d.Config.StripeWebhookSecret = "" },
			check: "configuration", status: doctor.Warning, says: "meter error reports are not received"},
		{name: "a key Stripe refuses", mutate: func(d *doctor.Deps) {
			d.Resolver, _ = exporter.NewResolver(exporter.Settings{Key: "sk_test_rolled0123456789", APIBase: d.Config.StripeAPIBase})
		}, check: "stripe", status: doctor.Problem, says: "the key was refused (401)", fix: "check STRIPE_API_KEY"},
		{name: "Stripe unreachable", mutate: func(d *doctor.Deps) {
			d.Resolver, _ = exporter.NewResolver(exporter.Settings{Key: stripesim.DefaultKey, APIBase: "http://127.0.0.1:1"})
		}, check: "stripe", status: doctor.Problem, says: "Stripe did not answer"},
		{name: "dev's simulator gone", mutate: func(d *doctor.Deps) {
			d.Config.StripeAPIBase = "http://127.0.0.1:1"
			d.Config.Dev = config.DevConfig{EnvFile: "/data/dev.env", From: []string{"STRIPE_API_KEY", "STRIPE_API_BASE"}}
			d.Resolver, _ = exporter.NewResolver(exporter.Settings{Key: stripesim.DefaultKey, APIBase: d.Config.StripeAPIBase})
		}, check: "stripe", status: doctor.Problem, says: "Stripe did not answer", fix: "is tally dev still running?"},
		{name: "settings from dev.env are named", mutate: func(d *doctor.Deps) {
			d.Config.Dev = config.DevConfig{EnvFile: "/data/dev.env", From: []string{"STRIPE_API_KEY", "STRIPE_API_BASE"}}
		}, check: "configuration", status: doctor.OK, says: "STRIPE_API_KEY, STRIPE_API_BASE from /data/dev.env (tally dev's)"},
		{name: "a mapped tenant whose customer the account does not have", prepare: func(t *testing.T, s *setup) {
			s.env.Tenant(t, "t2", nil)
		}, check: "customers", status: doctor.Problem, says: "t2 (cus_t2: customer_not_found)"},
		{name: "a mapped tenant whose customer was deleted", prepare: func(t *testing.T, s *setup) {
			c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: s.base})
			require.NoError(t, err)
			_, err = c.Stripe().V1Customers.Delete(context.Background(), "cus_t1", nil)
			require.NoError(t, err)
		}, check: "customers", status: doctor.Problem, says: "t1 (cus_t1: customer_deleted)"},
		{name: "more customers than one run checks is a warning", prepare: func(t *testing.T, s *setup) {
			s.sim.CreateCustomer(stripesim.DefaultAccount, "cus_t2")
			s.env.Tenant(t, "t2", nil)
		}, mutate: func(d *doctor.Deps) { d.MaxCustomers = 1 },
			check: "customers", status: doctor.Warning, says: "the customers of 1 mapped tenants exist in the account (the first 1 distinct, by tenant); 1 tenants not checked"},
		{name: "a tenant whose subscription bills quarterly keeps its anchor", prepare: func(t *testing.T, s *setup) {
			subscribeQuarterly(t, s)
		}, check: "billing periods", status: doctor.Warning, says: "t1 (Tally bills by monthly periods only: sub_"},
	})
}

// Each failure of the database, the mappings, the clock and the key's
// permissions, one at a time, with what the doctor says.
func TestEachFailure(t *testing.T) {
	t.Parallel()
	runFailures(t, []failureCase{
		{name: "database unreachable", mutate: func(d *doctor.Deps) {
			d.Pool, d.DBErr = nil, errors.New("connecting to postgres://tally:s3cret@db:5432/tally: refused")
		}, check: "database", status: doctor.Problem, says: "[redacted]"},
		{name: "schema behind", mutate: func(d *doctor.Deps) { d.Pool = emptyDatabase(t, d.Pool) },
			check: "migrations", status: doctor.Problem, says: "lacks migrations"},
		{name: "unmapped usage", prepare: func(t *testing.T, s *setup) {
			s.env.MustIngest(t, stagetest.Ev("e2", "t1", "gpu", 1, nil), stagetest.Ev("e3", "t9", "api", 1, nil))
		}, check: "mappings", status: doctor.Problem, says: "features gpu; tenants t9"},
		{name: "a mapped feature without its meter", prepare: func(t *testing.T, s *setup) {
			s.env.Feature(t, "seats", mappings.Last, time.Hour)
		}, check: "meters", status: doctor.Problem, says: "seats (seats last"},
		// 5.5 s, not 5: the skew is measured to within half a round trip
		// (4.999s was read once under load), and every reading of 5.5 s
		// give or take a few milliseconds starts "5.".
		{name: "clock skew", mutate: func(d *doctor.Deps) { d.Now = func() time.Time { return time.Now().Add(-5500 * time.Millisecond) } },
			check: "clock", status: doctor.Problem, says: "differ by 5."},
		{name: "a meter whose payload keys changed", prepare: func(t *testing.T, s *setup) {
			// Stripe's meters cannot change their keys: a new meter takes the
			// event name, and the mapping still sends the old one's.
			for _, m := range s.sim.Meters(stripesim.DefaultAccount) {
				require.NoError(t, s.sim.DeactivateMeter(stripesim.DefaultAccount, m.ID))
			}
			s.sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "api", Formula: "sum", CustomerPayloadKey: "account"})
		}, check: "payload keys", status: doctor.Problem, says: `api (mapping v`},
		{name: "a restricted key with the stream exporter", mutate: func(d *doctor.Deps) {
			d.Config.StripeAPIKey, d.Config.StripeWebhookSecret = restrictedKey, ""
			d.Config.Exporter = exporter.StripeMeterEventStream
		}, check: "stripe v2", status: doctor.Problem, says: "TALLY_EXPORTER=stripe_meter_event_stream"},
		{name: "a restricted key with a feature that names the stream", prepare: func(t *testing.T, s *setup) {
			s.env.FeatureWith(t, "clicks", mappings.FeatureInput{EventName: "clicks", Aggregation: mappings.Count,
				Exporter: mappings.ExporterStripeMeterEventStream})
		}, mutate: func(d *doctor.Deps) { d.Config.StripeAPIKey, d.Config.StripeWebhookSecret = restrictedKey, "" },
			check: "stripe v2", status: doctor.Problem, says: "feature mappings name stripe_meter_event_stream: clicks"},
		{name: "a restricted key with the webhook secret", mutate: func(d *doctor.Deps) { d.Config.StripeAPIKey = restrictedKey },
			check: "stripe v2", status: doctor.Problem, says: "STRIPE_WEBHOOK_SECRET is set"},
		{name: "a restricted key without error reports is a warning", mutate: func(d *doctor.Deps) {
			d.Config.StripeAPIKey, d.Config.StripeWebhookSecret = restrictedKey, ""
		}, check: "configuration", status: doctor.Warning, says: "restricted key"},
	})
}

// runFailures runs each case on a healthy setup of its own.
func runFailures(t *testing.T, cases []failureCase) {
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := healthy(t)
			if tc.prepare != nil {
				tc.prepare(t, s)
			}
			rs := s.run(t, tc.mutate)
			r, ok := rs[tc.check]
			require.True(t, ok, "no %s check in %+v", tc.check, rs)
			require.Equal(t, tc.status, r.Status, "%+v", r)
			require.Contains(t, r.Detail, tc.says)
			require.Contains(t, r.Fix, tc.fix)
			if tc.status == doctor.Problem {
				require.NotEmpty(t, r.Fix, "a problem says how to fix it")
			}
			var all []doctor.Result
			for _, r := range rs {
				all = append(all, r)
			}
			require.Equal(t, tc.status == doctor.Problem, doctor.Failed(all))
		})
	}
}

// emptyDatabase is a database on the same server with nothing in it.
func emptyDatabase(t *testing.T, pool *pgxpool.Pool) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	name := strings.ToLower(strings.ReplaceAll(t.Name(), "/", "_"))
	name = strings.Map(func(r rune) rune {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r == '_' {
			return r
		}
		return '_'
	}, name) + "_empty"
	_, err := pool.Exec(ctx, "CREATE DATABASE "+name)
	require.NoError(t, err)
	cfg := pool.Config().Copy()
	cfg.ConnConfig.Database = name
	empty, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		empty.Close()
		_, _ = pool.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	})
	return empty
}

// A restricted key that nothing asks to use Stripe's v2 API passes the v2
// check; the feature mappings whose meter reads their keys pass the keys
// check, custom keys included.
func TestRestrictedKeyWithoutV2AndCustomKeys(t *testing.T) {
	t.Parallel()
	s := healthy(t)
	s.sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "tokens", Formula: "sum", CustomerPayloadKey: "account", ValuePayloadKey: "n"})
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: s.base})
	require.NoError(t, err)
	checked := &mappings.Store{Checker: mappings.StripeMeters{Client: c}}
	f, _, err := checked.PutFeature(context.Background(), s.env.Pool, "tokens", mappings.FeatureInput{EventName: "tokens", Aggregation: mappings.Sum}, "test")
	require.NoError(t, err)
	require.Equal(t, mappings.PayloadKeys{Customer: "account", Value: "n"}, f.PayloadKeys())

	rs := s.run(t, func(d *doctor.Deps) { d.Config.StripeAPIKey = restrictedKey; d.Config.StripeWebhookSecret = "" })
	require.Equal(t, doctor.OK, rs["stripe v2"].Status, "%+v", rs["stripe v2"])
	require.Contains(t, rs["stripe v2"].Detail, "restricted key")
	require.Equal(t, doctor.OK, rs["payload keys"].Status, "%+v", rs["payload keys"])
	require.Contains(t, rs["payload keys"].Detail, "all 2 mapped features")
}

// A node connecting as the tables' owner (here the test cluster's
// superuser) is warned that privileges are not enforced; one connecting as
// a member of the runtime role is not.
func TestPrivilegesWarnWhenTheNodesOwnTheLedger(t *testing.T) {
	t.Parallel()
	s := healthy(t)
	rs := s.run(t, nil)
	require.Equal(t, doctor.Warning, rs["privileges"].Status, "%+v", rs["privileges"])
	require.Contains(t, rs["privileges"].Fix, "--grant-runtime")

	role := fmt.Sprintf("doctor_runtime_%d", time.Now().UnixNano())
	_, err := s.env.Pool.Exec(context.Background(), "CREATE ROLE "+role+" LOGIN PASSWORD 'pw' IN ROLE tally_runtime")
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = s.env.Pool.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })
	u, err := url.Parse(testdb.URLOf(t, s.env.Pool))
	require.NoError(t, err)
	u.User = url.UserPassword(role, "pw")
	pool, err := pgxpool.New(context.Background(), u.String())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	rs = s.run(t, func(d *doctor.Deps) { d.Pool = pool })
	require.Equal(t, doctor.OK, rs["privileges"].Status, "%+v", rs["privileges"])
}

// The doctor says when the migrations did not all run as one owner, or ran
// as a superuser, and when sessions start without pgsession's settings.
func TestOwnerAndSessionSettings(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := healthy(t)
	rs := s.run(t, nil)
	require.Equal(t, doctor.Warning, rs["owner"].Status, "the test cluster's superuser migrated: %+v", rs["owner"])
	require.Contains(t, rs["owner"].Detail, "superuser")
	require.Equal(t, doctor.OK, rs["session settings"].Status, "%+v", rs["session settings"])

	role := fmt.Sprintf("doctor_other_%d", time.Now().UnixNano())
	_, err := s.env.Pool.Exec(ctx, "CREATE ROLE "+role)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = s.env.Pool.Exec(context.Background(), "REASSIGN OWNED BY "+role+" TO CURRENT_USER")
		_, _ = s.env.Pool.Exec(context.Background(), "DROP ROLE IF EXISTS "+role)
	})
	_, err = s.env.Pool.Exec(ctx, "ALTER TABLE console_sessions OWNER TO "+role)
	require.NoError(t, err)
	rs = s.run(t, nil)
	require.Equal(t, doctor.Problem, rs["owner"].Status, "%+v", rs["owner"])
	require.Contains(t, rs["owner"].Detail, role)

	db := s.env.Pool.Config().ConnConfig.Database
	_, err = s.env.Pool.Exec(ctx, "ALTER DATABASE "+db+" RESET jit")
	require.NoError(t, err)
	fresh, err := pgxpool.New(ctx, testdb.URLOf(t, s.env.Pool))
	require.NoError(t, err)
	t.Cleanup(fresh.Close)
	rs = s.run(t, func(d *doctor.Deps) { d.Pool = fresh })
	require.Equal(t, doctor.Warning, rs["session settings"].Status, "%+v", rs["session settings"])
	require.Contains(t, rs["session settings"].Detail, "jit=off")
	require.Contains(t, rs["session settings"].Fix, `ALTER DATABASE "`+db+`" SET jit = off`)
}

// On a Citus coordinator whose tables are not distributed yet, the engine
// check fails, names the tables and says which command places them.
func TestEngineOnCitusNotDistributed(t *testing.T) {
	t.Parallel()
	pool := testdb.NewCitus(t)
	var engine doctor.Result
	for _, r := range doctor.Run(context.Background(), doctor.Deps{Pool: pool}) {
		if r.Check == "engine" {
			engine = r
		}
	}
	require.Equal(t, doctor.Problem, engine.Status, "%+v", engine)
	require.Contains(t, engine.Detail, "outbox_item_bodies (local, must be distributed)")
	require.Contains(t, engine.Detail, "feature_mappings (local, must be reference)")
	require.Contains(t, engine.Fix, "run tally migrate --distribute against the coordinator")
}

// subscribeQuarterly gives cus_t1 a subscription billed every 3 months on
// the mapped meter, and reads it as the mapping's check would.
func subscribeQuarterly(t *testing.T, s *setup) {
	t.Helper()
	ctx := context.Background()
	m := s.sim.Meters(stripesim.DefaultAccount)[0]
	_, err := s.env.Pool.Exec(ctx, `INSERT INTO stripe_meters (account, mode, id, event_name, status, formula)
		VALUES ('acct_sim', 'test', $1, $2, 'active', 'sum')`, m.ID, m.EventName)
	require.NoError(t, err)
	price := s.sim.CreatePrice(stripesim.DefaultAccount, stripesim.PriceSpec{UnitAmountDecimal: "1", Meter: m.ID, IntervalCount: 3})
	s.sim.CreateSubscription(stripesim.DefaultAccount, stripesim.SubscriptionSpec{Customer: "cus_t1", Prices: []string{price},
		BillingCycleAnchor: time.Now().Add(48 * time.Hour)})
	c, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: s.base})
	require.NoError(t, err)
	_, err = (&mappings.Store{}).SyncSubscriptions(ctx, s.env.Pool, mappings.StripeMeters{Client: c}, "", "cus_t1")
	require.NoError(t, err)
}
