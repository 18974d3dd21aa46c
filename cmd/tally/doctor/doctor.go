// Package doctor diagnoses a Tally installation for `tally doctor`: the
// configuration (and, beside `tally dev`, which settings came from its
// dev.env), the database, its migrations and its engine (plain PostgreSQL,
// or Citus with its nodes and where Tally's tables are), Stripe (reachable, the key's
// mode and account, a restricted key where the v2 API is needed, the
// mapped meters and their payload keys, the mapped tenants' customers),
// the roles (the nodes' lacks the owner's privileges; the migrations ran
// as one owner, no superuser) and the sessions' settings,
// the mappings' coverage of recent usage, how Stripe's error reports reach
// Tally (the listing of each account's events, the event destination's
// deliveries), and the clock skew between the node and the database. Each
// check says what is wrong and how to fix it.
//
// It only reads, and only through the packages that own what it reads
// (migrations, meter, mappings, reconcile, pgsession): it runs no SQL of its own, never migrates,
// stages, sends or changes a row, and never prints a secret.
package doctor

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgsession"
	"github.com/tallymeter/tally/internal/redact"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/migrations"
)

// Status of a check.
type Status string

// The statuses: a problem makes `tally doctor` exit non-zero; a warning
// does not.
const (
	OK      Status = "ok"
	Warning Status = "warn"
	Problem Status = "FAIL"
)

// Result is one check.
type Result struct {
	Check  string `json:"check"`
	Status Status `json:"status"`
	Detail string `json:"detail"`
	Fix    string `json:"fix,omitempty"`
}

// Deps are what the checks look at.
type Deps struct {
	Config config.Config
	// Pool is the database, nil when it could not be opened (DBErr says
	// why).
	Pool  *pgxpool.Pool
	DBErr error
	// Resolver is this node's Stripe destination (no key: its Client is
	// nil).
	Resolver *exporter.Resolver
	// Now is the node's clock; MaxSkew how far it may be from the
	// database's. Defaults: time.Now and one second.
	Now     func() time.Time
	MaxSkew time.Duration
	// RecentUsage is how far back usage must be covered by mappings.
	// Default: 7 days.
	RecentUsage time.Duration
	// MaxCustomers is the most distinct mapped customers asked about at
	// Stripe. Default: MaxCustomersChecked.
	MaxCustomers int
}

// Run runs every check, in order; a check that depends on a failed one
// says so rather than failing again.
func Run(ctx context.Context, d Deps) []Result {
	if d.Now == nil {
		d.Now = time.Now
	}
	if d.MaxSkew <= 0 {
		d.MaxSkew = time.Second
	}
	if d.RecentUsage <= 0 {
		d.RecentUsage = 7 * 24 * time.Hour
	}
	if d.MaxCustomers <= 0 {
		d.MaxCustomers = MaxCustomersChecked
	}
	var out []Result
	out = append(out, configuration(d.Config))
	out = append(out, database(d))
	dbOK := d.Pool != nil
	if dbOK {
		out = append(out, schema(ctx, d.Pool))
		out = append(out, engine(ctx, d.Pool))
		out = append(out, privileges(ctx, d))
		out = append(out, owner(ctx, d))
		out = append(out, sessionSettings(ctx, d))
		out = append(out, clock(ctx, d))
	}
	stripeOK := false
	if r := stripeCheck(ctx, d); r != nil {
		out = append(out, *r)
		stripeOK = r.Status == OK
	}
	if r := v2Access(ctx, d); r != nil {
		out = append(out, *r)
	}
	if dbOK {
		out = append(out, coverage(ctx, d, stripeOK)...)
		if r := reports(ctx, d); r != nil {
			out = append(out, *r)
		}
	}
	return out
}

// Failed reports whether any result is a problem.
func Failed(rs []Result) bool {
	for _, r := range rs {
		if r.Status == Problem {
			return true
		}
	}
	return false
}

func configuration(c config.Config) Result {
	var notes []string
	status, fix := OK, ""
	if c.StripeAPIKey == "" {
		status, fix = Problem, "set STRIPE_API_KEY to a secret or restricted key (sk_… or rk_…); until then usage waits in the ledger"
		notes = append(notes, "STRIPE_API_KEY is unset: export is stalled")
	} else if mode, err := stripeapi.ModeOfKey(c.StripeAPIKey); err == nil {
		kind := "secret"
		if config.RestrictedKey(c.StripeAPIKey) {
			kind = "restricted"
		}
		notes = append(notes, fmt.Sprintf("Stripe key: %s mode, %s key", mode, kind))
	}
	if c.StripeAccount != "" {
		notes = append(notes, "destination account "+c.StripeAccount+" (Connect)")
	}
	if c.Dev.EnvFile != "" {
		notes = append(notes, fmt.Sprintf("%s from %s (tally dev's)", strings.Join(c.Dev.From, ", "), c.Dev.EnvFile))
	}
	notes = append(notes, "exporter "+c.Exporter, "reconcile schedule "+c.ReconcileSchedule)
	if c.StripeWebhookSecret == "" {
		if status == OK {
			status = Warning
			fix = "set STRIPE_WEBHOOK_SECRET to the signing secret of an event destination posting to /v1/stripe/events, to receive meter error reports"
			if config.RestrictedKey(c.StripeAPIKey) {
				fix = "to receive meter error reports, use a secret key (sk_…: they are read with Stripe's v2 API, which refuses restricted keys) and set STRIPE_WEBHOOK_SECRET to the signing secret of an event destination posting to /v1/stripe/events"
			}
		}
		notes = append(notes, "STRIPE_WEBHOOK_SECRET is unset: Stripe's meter error reports are not received")
	}
	return Result{Check: "configuration", Status: status, Detail: strings.Join(notes, "; "), Fix: fix}
}

func database(d Deps) Result {
	if d.Pool == nil {
		return Result{Check: "database", Status: Problem, Detail: describe(d.DBErr),
			Fix: "set TALLY_DATABASE_URL to a reachable Postgres (or start tally serve for the embedded one), and check its user and password"}
	}
	where := "TALLY_DATABASE_URL"
	if d.Config.DatabaseURL == "" {
		where = "the embedded cluster in " + d.Config.DataDir
	}
	return Result{Check: "database", Status: OK, Detail: "reachable: " + where}
}

func schema(ctx context.Context, pool *pgxpool.Pool) Result {
	err := migrations.Check(ctx, pool)
	switch {
	case err == nil:
		return Result{Check: "migrations", Status: OK, Detail: "the schema is current"}
	case errors.Is(err, migrations.ErrBehind):
		return Result{Check: "migrations", Status: Problem, Detail: "the database lacks migrations this binary has",
			Fix: "run tally migrate (tally serve applies them at start, too)"}
	}
	return Result{Check: "migrations", Status: Problem, Detail: "the schema version could not be read: " + describe(err),
		Fix: "is this Tally's database? run tally migrate on an empty one"}
}

// engine names the database engine: plain PostgreSQL, or Citus with its
// nodes and where Tally's tables are. On Citus a table that is not where
// it must be is a problem: a hot statement on it would fan out to every
// worker, or be refused.
func engine(ctx context.Context, pool *pgxpool.Pool) Result {
	e, err := migrations.ReadEngine(ctx, pool)
	if err != nil {
		return Result{Check: "engine", Status: Warning, Detail: "the engine could not be read: " + describe(err)}
	}
	if e.Citus == "" {
		return Result{Check: "engine", Status: OK, Detail: e.String() + ", one server"}
	}
	var nodes, inactive []string
	for _, n := range e.Nodes {
		addr := fmt.Sprintf("%s:%d", n.Host, n.Port)
		if n.Coordinator {
			addr = "coordinator " + addr
		}
		nodes = append(nodes, addr)
		if !n.Active {
			inactive = append(inactive, addr)
		}
	}
	count := map[migrations.Placement]int{}
	var misplaced []string
	for _, t := range e.Tables {
		count[t.Have]++
	}
	for _, t := range e.Misplaced() {
		have := string(t.Have)
		if have == "" {
			have = "missing"
		}
		misplaced = append(misplaced, fmt.Sprintf("%s (%s, must be %s)", t.Name, have, t.Want))
	}
	detail := fmt.Sprintf("%s: %s; tables: %d distributed, %d reference, %d local",
		e, strings.Join(nodes, ", "), count[migrations.Distributed], count[migrations.Reference], count[migrations.Local])
	switch {
	case len(e.Workers()) == 0:
		return Result{Check: "engine", Status: Problem, Detail: detail + "; no worker is registered",
			Fix: "add the workers on the coordinator (SELECT citus_add_node(host, port)), then run tally migrate --distribute (docs/operations.md)"}
	case len(misplaced) > 0:
		return Result{Check: "engine", Status: Problem, Detail: detail + "; not where they must be: " + list(misplaced),
			Fix: "run tally migrate --distribute against the coordinator: it distributes Tally's tables with their rows, blocking writes while it copies them (docs/scale.md)"}
	case len(inactive) > 0:
		return Result{Check: "engine", Status: Problem, Detail: detail + "; inactive: " + strings.Join(inactive, ", "),
			Fix: "the tenants whose shards are on an inactive node stall: bring it back and run SELECT citus_activate_node(host, port) (docs/operations.md)"}
	}
	return Result{Check: "engine", Status: OK, Detail: detail}
}

// privileges warns when the nodes' role owns the ledger or may delete from
// it: nothing then stops a row leaving before its period is archived but
// the triggers, which an owner can drop.
func privileges(ctx context.Context, d Deps) Result {
	if d.Config.DatabaseURL == "" {
		return Result{Check: "privileges", Status: OK, Detail: "the nodes connect to the embedded cluster as a member of " + migrations.RuntimeRole}
	}
	enforced, err := migrations.PrivilegesEnforced(ctx, d.Pool)
	switch {
	case err != nil:
		return Result{Check: "privileges", Status: Warning, Detail: "the ledger's privileges could not be read: " + describe(err)}
	case enforced:
		return Result{Check: "privileges", Status: OK, Detail: "TALLY_DATABASE_URL's role owns no table and may not delete from the ledger"}
	}
	return Result{Check: "privileges", Status: Warning,
		Detail: "TALLY_DATABASE_URL's role owns the ledger (or may delete from it): privileges are not enforced",
		Fix:    "run tally migrate --grant-runtime ROLE as the owner, set TALLY_DATABASE_URL to that login role and TALLY_DATABASE_OWNER_URL to the owner (docs/security.md)"}
}

// owner checks that the migrations ran as one owner, not a superuser: a
// table of another role makes a later migration fail on it, and a managed
// Postgres gives no one a superuser.
func owner(ctx context.Context, d Deps) Result {
	o, err := migrations.TableOwners(ctx, d.Pool)
	switch {
	case err != nil:
		return Result{Check: "owner", Status: Warning, Detail: "the tables' owners could not be read: " + describe(err)}
	case len(o.Owners) > 1:
		return Result{Check: "owner", Status: Problem,
			Detail: "the tables are owned by several roles (" + strings.Join(o.Owners, ", ") + "): some migrations ran as another role, and a later one fails on a table its role does not own",
			Fix:    "as a superuser, ALTER TABLE … OWNER TO the owner role (TALLY_DATABASE_OWNER_URL's) for the others, then run migrations only as it"}
	case len(o.Owners) == 0:
		return Result{Check: "owner", Status: Warning, Detail: "no table in the schema: is this Tally's database?"}
	case o.Superuser && d.Config.DatabaseURL != "":
		return Result{Check: "owner", Status: Warning,
			Detail: "the migrations ran as a superuser (" + o.Owners[0] + " owns the tables)",
			Fix:    "migrations need no superuser: run them as an owner role that owns the database (docs/operations.md), as a managed Postgres requires"}
	}
	return Result{Check: "owner", Status: OK, Detail: "the migrations ran as " + o.Owners[0] + ", which owns every table"}
}

// sessionSettings checks that a session starts with the settings Tally's
// statements are planned for, which are the database's defaults.
func sessionSettings(ctx context.Context, d Deps) Result {
	missing, err := pgsession.Missing(ctx, d.Pool)
	switch {
	case err != nil:
		return Result{Check: "session settings", Status: Warning, Detail: "the session's settings could not be read: " + describe(err)}
	case len(missing) > 0:
		return Result{Check: "session settings", Status: Warning,
			Detail: "sessions start without " + strings.Join(missing, ", ") + ": reports over a long history may compile or start parallel workers for seconds",
			Fix: "as the database's owner run " + strings.Join(pgsession.Statements(d.Pool.Config().ConnConfig.Database), "; ") +
				" (tally migrate does when its role owns the database), or drop them from TALLY_DATABASE_URL"}
	}
	return Result{Check: "session settings", Status: OK, Detail: "sessions start with the database's defaults (jit off, no parallel workers)"}
}

func clock(ctx context.Context, d Deps) Result {
	before := d.Now()
	db, err := migrations.DatabaseTime(ctx, d.Pool)
	if err != nil {
		return Result{Check: "clock", Status: Problem, Detail: "the database's clock could not be read: " + describe(err)}
	}
	after := d.Now()
	mid := before.Add(after.Sub(before) / 2)
	skew := db.Sub(mid)
	detail := fmt.Sprintf("node and database clocks differ by %s (round trip %s)", skew.Round(time.Millisecond), after.Sub(before).Round(time.Millisecond))
	if skew > d.MaxSkew || skew < -d.MaxSkew {
		return Result{Check: "clock", Status: Problem, Detail: detail,
			Fix: fmt.Sprintf("synchronise both clocks (NTP): Tally decides with the database's clock, but timestamps default to it and a skew over %s misleads windows and logs", d.MaxSkew)}
	}
	return Result{Check: "clock", Status: OK, Detail: detail}
}

func stripeCheck(ctx context.Context, d Deps) *Result {
	if d.Resolver == nil || d.Resolver.Client() == nil {
		return nil // the configuration check said so
	}
	dest, err := d.Resolver.Resolve(ctx)
	if err == nil {
		_, err = d.Resolver.Client().Meters(ctx)
	}
	if err != nil {
		code, status, _ := stripeapi.Describe(err)
		if le := (*exporter.LookupError)(nil); errors.As(err, &le) {
			code, status = le.Code, le.Status
		}
		var why error = err
		if errors.As(err, new(*stripeapi.Error)) || status != 0 {
			why = fmt.Errorf("%s (status %d)", code, status)
		}
		r := Result{Check: "stripe", Status: Problem, Detail: "Stripe did not answer as expected: " + describe(why)}
		switch status {
		case http.StatusUnauthorized:
			r.Detail = "the key was refused (401): " + describe(why)
			r.Fix = "check STRIPE_API_KEY: Stripe does not take it (rolled, deleted or mistyped; a restricted key's missing permissions answer 403 instead); set it to a current key of the account"
		case http.StatusForbidden:
			r.Fix = "the key may not read meters or the account: give a restricted key meter events (write) and meters, event summaries and customers (read), or fix STRIPE_ACCOUNT"
		default:
			r.Fix = "check that " + d.Config.StripeAPIBase + " is reachable from this node"
			if d.Config.Dev.EnvFile != "" && slices.Contains(d.Config.Dev.From, "STRIPE_API_BASE") {
				r.Fix = "is tally dev still running? its simulator (" + d.Config.StripeAPIBase + ", from " + d.Config.Dev.EnvFile +
					") does not answer; dev removes that file when it stops, not when it is killed"
			}
		}
		return &r
	}
	account := dest.Account
	if account == "" {
		return &Result{Check: "stripe", Status: Problem, Detail: "the key may not read its account: usage is quarantined as no_account",
			Fix: "set STRIPE_ACCOUNT, or use a key that may read GET /v1/account"}
	}
	return &Result{Check: "stripe", Status: OK, Detail: fmt.Sprintf("reachable; account %s, %s mode", account, dest.Mode)}
}

// v2Access checks that a restricted key (rk_…) is not asked to use Stripe's
// v2 API, which takes only secret keys (https://docs.stripe.com/api-v2-overview):
// the stream exporter, by TALLY_EXPORTER or by a feature mapping, and error
// reports, read with GET /v2/core/events when STRIPE_WEBHOOK_SECRET is set.
// Without a key it says nothing (the configuration check did).
func v2Access(ctx context.Context, d Deps) *Result {
	c := d.Config
	if c.StripeAPIKey == "" {
		return nil
	}
	if !config.RestrictedKey(c.StripeAPIKey) {
		return &Result{Check: "stripe v2", Status: OK, Detail: "a secret key: Stripe's v2 API (the stream exporter, error reports) takes it"}
	}
	var uses []string
	if c.Exporter == mappings.ExporterStripeMeterEventStream {
		uses = append(uses, "TALLY_EXPORTER=stripe_meter_event_stream")
	}
	if d.Pool != nil {
		fs, err := mappings.FeaturesWithExporter(ctx, d.Pool, mappings.ExporterStripeMeterEventStream)
		if err != nil {
			return &Result{Check: "stripe v2", Status: Problem, Detail: "a restricted key (rk_…), and the feature mappings could not be read: " + describe(err),
				Fix: "fix the database first (see the database and migrations checks)"}
		}
		if len(fs) > 0 {
			uses = append(uses, "feature mappings name stripe_meter_event_stream: "+list(fs))
		}
	}
	if c.StripeWebhookSecret != "" {
		uses = append(uses, "STRIPE_WEBHOOK_SECRET is set: error reports are read with GET /v2/core/events")
	}
	if len(uses) == 0 {
		return &Result{Check: "stripe v2", Status: OK,
			Detail: "a restricted key (rk_…): nothing configured needs Stripe's v2 API, which takes only secret keys"}
	}
	return &Result{Check: "stripe v2", Status: Problem,
		Detail: "STRIPE_API_KEY is a restricted key (rk_…), which Stripe's v2 API refuses (it takes only secret keys), but these need v2: " + strings.Join(uses, "; "),
		Fix: "use a secret key (sk_…) for STRIPE_API_KEY; or keep to v1: TALLY_EXPORTER=stripe_meter_events, those features' exporter " +
			"stripe_meter_events or the node's default (tally mappings features set F … --exporter stripe_meter_events), and STRIPE_WEBHOOK_SECRET unset " +
			"(error reports are then not received)"}
}

// coverage checks that recent usage's features and tenants are mapped, and
// (when Stripe answered) that every mapped feature has an active meter
// with its formula and sends the payload keys that meter reads, and that
// every mapped tenant's customer exists, and what the tenants' billing
// periods come from.
func coverage(ctx context.Context, d Deps, stripeOK bool) []Result {
	r, read := mapped(ctx, d)
	if !read || !stripeOK {
		return []Result{r}
	}
	return append(append([]Result{r}, meters(ctx, d)...), customers(ctx, d), periods(ctx, d))
}

// mapped checks that every feature and tenant with usage in the last
// RecentUsage has a mapping; false when the usage could not be read.
func mapped(ctx context.Context, d Deps) (Result, bool) {
	unmapped, err := meter.UnmappedUsage(ctx, d.Pool, d.RecentUsage)
	if err != nil {
		return Result{Check: "mappings", Status: Problem, Detail: "the usage could not be read: " + describe(err)}, false
	}
	var features, tenants []string
	for _, u := range unmapped {
		if u.Kind == meter.UnmappedFeature {
			features = append(features, u.Name)
		} else {
			tenants = append(tenants, u.Name)
		}
	}
	days := int(d.RecentUsage.Hours() / 24)
	if len(features)+len(tenants) == 0 {
		return Result{Check: "mappings", Status: OK, Detail: fmt.Sprintf("every feature and tenant with usage in the last %d days is mapped", days)}, true
	}
	var parts []string
	if len(features) > 0 {
		parts = append(parts, "features "+list(features))
	}
	if len(tenants) > 0 {
		parts = append(parts, "tenants "+list(tenants))
	}
	return Result{Check: "mappings", Status: Problem,
		Detail: fmt.Sprintf("usage of the last %d days has no mapping: %s (it is quarantined)", days, strings.Join(parts, "; ")),
		Fix:    "map them (tally mappings features set …, tally mappings tenants set …), then requeue their items"}, true
}

// meters checks, at Stripe, that every mapped feature has an active meter
// with its formula, and that the meter reads the payload keys the mapping
// sends.
func meters(ctx context.Context, d Deps) []Result {
	var out []Result
	var st mappings.Store
	fs, err := st.Features(ctx, d.Pool)
	if err != nil {
		return append(out, Result{Check: "meters", Status: Problem, Detail: "the mappings could not be read: " + describe(err)})
	}
	checker := mappings.StripeMeters{Client: d.Resolver.Client()}
	var bad, stale []string
	for _, f := range fs {
		keys, err := checker.CheckMeter(ctx, f.EventName, f.Aggregation)
		if err != nil {
			bad = append(bad, fmt.Sprintf("%s (%s %s: %s)", f.Feature, f.EventName, f.Aggregation, describe(err)))
			continue
		}
		if mine := f.PayloadKeys(); mine != keys {
			stale = append(stale, fmt.Sprintf("%s (mapping v%d sends %q and %q; Stripe's meter for %s reads %q and %q)",
				f.Feature, f.Version, mine.Customer, mine.Value, f.EventName, keys.Customer, keys.Value))
		}
	}
	if len(bad) > 0 {
		out = append(out, Result{Check: "meters", Status: Problem,
			Detail: "mapped features without an active Stripe meter of their formula: " + list(bad),
			Fix:    "create or reactivate the meter at Stripe with that event name and formula, or change the mapping"})
	} else {
		out = append(out, Result{Check: "meters", Status: OK, Detail: fmt.Sprintf("all %d mapped features have an active meter with their formula", len(fs))})
	}
	if len(stale) > 0 {
		return append(out, Result{Check: "payload keys", Status: Problem,
			Detail: "mapped features whose Stripe meter reads other payload keys (customer, value) than their mapping sends: " + list(stale),
			Fix: "set each feature's mapping again, with its current values (tally mappings features set F …, or PUT /v1/mappings/features/F): " +
				"the new version takes the meter's keys, and the items staged from then on carry them; items staged before keep the keys they were built with"})
	}
	checked := len(fs) - len(bad)
	return append(out, Result{Check: "payload keys", Status: OK,
		Detail: fmt.Sprintf("all %d mapped features with a meter send the payload keys it reads", checked)})
}

func list(names []string) string {
	if len(names) > 10 {
		return strings.Join(names[:10], ", ") + fmt.Sprintf(" and %d more", len(names)-10)
	}
	return strings.Join(names, ", ")
}

// describe is an error's text, sanitised of anything that looks like a
// secret (a URL's password, a key).
func describe(err error) string {
	if err == nil {
		return "unknown error"
	}
	_, _, msg := stripeapi.Describe(err)
	if msg == "unknown error" {
		msg = err.Error()
	}
	return sanitize(msg)
}

var urlCredentials = regexp.MustCompile(`://[^/\s@]+@`)

func sanitize(s string) string {
	s = urlCredentials.ReplaceAllString(s, "://[redacted]@")
	return redact.Message(s)
}
