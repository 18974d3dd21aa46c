package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/cmd/tally/doctor"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// env is what a command runs with.
type env struct {
	cfg    config.Config
	db     *app.DB
	parts  *app.Parts
	logger *slog.Logger
	stdout io.Writer
	stderr io.Writer
	opts   *opts
}

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

// opts holds the command flags of one run.
type opts struct {
	role, name                      string
	tenants                         stringList
	eventName, aggregation, window  string
	exporter                        string
	customer, anchor                string
	format, reason, tenant, feature string
	period                          string
	mappingVersion                  int
	simListen, simKey, simAccount   string
	webhookURL, webhookSecret       string
	meters, customers               stringList
	simLimits                       stripesim.Limits
	settle                          time.Duration
	since                           string
	planOut, plan                   string
	expect, to, providerRef         string
	notReached                      bool
}

func lookup(args []string) (command, []string, bool) {
	two := ""
	if len(args) > 1 {
		two = args[0] + " " + args[1]
	}
	for _, c := range commands() {
		if c.name == two {
			return c, args[2:], true
		}
	}
	for _, c := range commands() {
		if c.name == args[0] {
			return c, args[1:], true
		}
	}
	return command{}, nil, false
}

func exactly(n int, what string) func([]string) error {
	return func(args []string) error {
		if len(args) != n {
			return fmt.Errorf("want %s", what)
		}
		return nil
	}
}

func commands() []command {
	return []command{
		{name: "serve", service: true, run: func(ctx context.Context, e *env, _ []string) error {
			return app.Serve(ctx, e.cfg, e.db, e.parts, e.logger, nil)
		}},
		{name: "dev", service: true, prepare: prepareDev, flags: func(fs *flag.FlagSet, o *opts) {
			fs.StringVar(&o.simListen, "sim-listen", "127.0.0.1:12111", "the built-in Stripe simulator's address (when STRIPE_API_KEY is unset)")
		}, run: runDev},
		{name: "migrate", run: func(_ context.Context, e *env, _ []string) error {
			fmt.Fprintln(e.stdout, "migrations applied")
			return nil
		}},
		{name: "tokens create", flags: func(fs *flag.FlagSet, o *opts) {
			fs.StringVar(&o.role, "role", "", "ingest, finance, operator or admin (required)")
			fs.StringVar(&o.name, "name", "", "the token's name, shown in audit trails (default: role and a random suffix)")
			fs.Var(&o.tenants, "tenant", "scope an ingest token to this tenant (repeatable)")
		}, run: runTokensCreate},
		{name: "tokens list", run: runTokensList},
		{name: "tokens revoke", args: exactly(1, "a token name"), run: func(ctx context.Context, e *env, args []string) error {
			if err := auth.Revoke(ctx, e.db.Pool, args[0]); err != nil {
				return err
			}
			fmt.Fprintf(e.stdout, "revoked %s\n", args[0])
			return nil
		}},
		{name: "mappings features", flags: func(fs *flag.FlagSet, o *opts) {
			fs.StringVar(&o.eventName, "event-name", "", "set: the Stripe meter's event_name (the mapping takes that meter's payload keys, shown as customer_payload_key and value_payload_key)")
			fs.StringVar(&o.aggregation, "aggregation", "", "set: sum, last or count (the meter's formula)")
			fs.StringVar(&o.window, "window", "", "set: the window, dividing a day (default 1h)")
			featureExporterFlag(fs, o)
		}, args: mappingArgs, run: runFeatures},
		{name: "mappings tenants", flags: func(fs *flag.FlagSet, o *opts) {
			fs.StringVar(&o.customer, "customer", "", "set: the Stripe customer id (cus_…)")
			fs.StringVar(&o.anchor, "anchor", "", "set: the billing-period anchor, RFC 3339 (default: calendar months UTC)")
		}, args: mappingArgs, run: runTenants},
		{name: "quarantine", flags: func(fs *flag.FlagSet, o *opts) {
			fs.StringVar(&o.format, "format", "table", "table, csv or json")
			fs.StringVar(&o.reason, "reason", "", "only this quarantine reason")
			fs.StringVar(&o.tenant, "tenant", "", "only this tenant")
			fs.StringVar(&o.feature, "feature", "", "only this feature")
			fs.StringVar(&o.period, "period", "", "only billing periods starting in this month (YYYY-MM)")
		}, run: runQuarantine},
		{name: "requeue", flags: func(fs *flag.FlagSet, o *opts) {
			fs.IntVar(&o.mappingVersion, "mapping-version", -1, "the current mapping version of the item's tenant and feature (required)")
		}, args: exactly(1, "an item id"), run: runRequeue},
		{name: "stripe-sim", noDB: true, flags: func(fs *flag.FlagSet, o *opts) {
			fs.StringVar(&o.simListen, "sim-listen", "127.0.0.1:12111", "the simulator's HTTP address")
			fs.StringVar(&o.simKey, "sim-key", stripesim.DefaultKey, "the API key it accepts")
			fs.StringVar(&o.simAccount, "sim-account", stripesim.DefaultAccount, "the account of that key")
			fs.Var(&o.meters, "meter", "create a meter at start, as EVENT_NAME:FORMULA (sum, count or last; repeatable)")
			fs.Var(&o.customers, "customer", "create a customer at start, by id (cus_…; repeatable)")
			fs.Float64Var(&o.simLimits.RatePerSecond, "rate", 0, "v1 meter-event calls a second before 429 (0: no limit)")
			fs.Float64Var(&o.simLimits.StreamRatePerSecond, "stream-rate", 0, "v2 meter event stream requests a second before 429 (0: no limit)")
			fs.BoolVar(&o.simLimits.OneCallPerCustomerMeter, "one-call-per-key", true, "answer 429 to a second concurrent call for one customer and meter, as Stripe does")
			fs.Float64Var(&o.simLimits.BasicRatePerSecond, "basic-rate", 0, "calls a second, every kind together, before 429: Stripe's basic limit (0: no limit)")
			fs.Float64Var(&o.simLimits.EndpointRatePerSecond, "endpoint-rate", 0, "calls a second per endpoint before 429, meter events aside (Stripe: 25; 0: no limit)")
			fs.BoolVar(&o.simLimits.AsyncValidation, "async-validation", false, "v1 answers 200 to an event that fails validation Stripe may make later (unknown customer, …) and reports it")
			fs.Float64Var(&o.simLimits.Faults.FailBeforeRecord, "fail-before-record", 0, "probability of a 500 before recording (kept for its Idempotency-Key)")
			fs.Float64Var(&o.simLimits.Faults.FailAfterRecord, "fail-after-record", 0, "probability of recording, then answering 500 (kept for its Idempotency-Key)")
			fs.Float64Var(&o.simLimits.Faults.LoseReply, "lose-reply", 0, "probability of recording, then answering 502 (a lost reply)")
			fs.Float64Var(&o.simLimits.Faults.RateLimitFault, "rate-limit-fault", 0, "probability of a 429 without recording")
			fs.Float64Var(&o.simLimits.Faults.Hang, "hang", 0, "probability of not answering until the client gives up")
			fs.Float64Var(&o.simLimits.Faults.AsyncDrop, "async-drop", 0, "probability of answering 200 and dropping the event later")
			fs.DurationVar(&o.simLimits.Faults.Latency, "latency", 0, "added latency of every meter-event call and stream request")
			fs.Float64Var(&o.simLimits.Faults.ReadFault, "read-fault", 0, "probability of a 500 or 429 to a read (meters, summaries)")
			fs.StringVar(&o.webhookURL, "webhook-url", "", "post meter error reports as signed thin events here (e.g. http://127.0.0.1:8080/v1/stripe/events)")
			fs.StringVar(&o.webhookSecret, "webhook-secret", devWebhookSecret, "the signing secret of those events (Tally's STRIPE_WEBHOOK_SECRET)")
		}, run: runStripeSim},
		{name: "reconcile", flags: func(fs *flag.FlagSet, o *opts) {
			fs.DurationVar(&o.settle, "settle", -1, "compare only items accepted longer ago than this (default: TALLY_RECONCILE_SETTLE)")
			fs.StringVar(&o.since, "since", "", "only hours from this event time on: RFC 3339 or YYYY-MM-DD (default: all)")
			fs.StringVar(&o.format, "format", "table", "table or json")
			fs.StringVar(&o.planOut, "plan-out", "", "write the run's recovery plan to this file, for review and tally recover --plan")
		}, run: runReconcile},
		{name: "recover", flags: func(fs *flag.FlagSet, o *opts) {
			fs.StringVar(&o.expect, "expect", "", "the item's state as you saw it: uncertain (required with an ID)")
			fs.StringVar(&o.to, "to", "", "accepted, pending or rejected (required with an ID)")
			fs.StringVar(&o.reason, "reason", "", "why (required to reject and with --not-reached)")
			fs.BoolVar(&o.notReached, "not-reached", false, "with --to pending: record that no attempt reached Stripe")
			fs.StringVar(&o.providerRef, "provider-ref", "", "with --to accepted: Stripe's evidence (optional)")
			fs.StringVar(&o.plan, "plan", "", "apply a reviewed plan file (from tally reconcile --plan-out or GET /v1/reconcile/runs/{id}/plan)")
		}, args: func(args []string) error {
			if len(args) > 1 {
				return errors.New("want one item id, or --plan FILE")
			}
			return nil
		}, run: runRecover},
		{name: "doctor", noDB: true, settings: true, flags: func(fs *flag.FlagSet, o *opts) {
			fs.StringVar(&o.format, "format", "table", "table or json")
		}, run: runDoctor},
		{name: "report completeness", flags: func(fs *flag.FlagSet, o *opts) {
			fs.StringVar(&o.period, "period", "", "billing periods starting in this month, YYYY-MM (required)")
			fs.StringVar(&o.tenant, "tenant", "", "only this tenant")
			fs.StringVar(&o.format, "format", "table", "table or json")
		}, run: runCompleteness},
	}
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// The demo of tally dev: features mapped to the simulator's meters, and
// tenants to its customers.
var (
	demoFeatures = []struct {
		name  string
		agg   mappings.Aggregation
		win   time.Duration
		event string
	}{
		{"api_calls", mappings.Sum, time.Minute, "api_calls"},
		{"seats", mappings.Last, time.Minute, "seats"},
		{"logins", mappings.Count, time.Hour, "logins"},
	}
	demoTenants = []struct{ tenant, customer string }{{"acme", "cus_acme"}, {"globex", "cus_globex"}}
)

// devSim is the simulator tally dev runs; closing it stops it.
type devSim struct {
	srv  *http.Server
	sim  *stripesim.Server
	stop chan struct{}
}

func (d *devSim) Close() error {
	close(d.stop)
	d.sim.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return d.srv.Shutdown(ctx)
}

// prepareDev starts the built-in Stripe simulator on loopback with the
// demo's meters and customers, and points this node at it, unless
// STRIPE_API_KEY is set; and it shortens the stage interval and the window
// grace left at their defaults, so that usage lands within a minute.
func prepareDev(_ context.Context, cfg *config.Config, o *opts, stdout io.Writer) (io.Closer, error) {
	if cfg.StageInterval == 10*time.Second {
		cfg.StageInterval = 2 * time.Second
	}
	if cfg.WindowGrace == 2*time.Minute {
		cfg.WindowGrace = 5 * time.Second
	}
	if cfg.StripeAPIKey != "" {
		return nil, nil
	}
	sim := stripesim.New(stripesim.Options{})
	for _, f := range demoFeatures {
		sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: f.name, EventName: f.event, Formula: string(f.agg)})
	}
	for _, t := range demoTenants {
		sim.CreateCustomer(stripesim.DefaultAccount, t.customer)
	}
	ln, err := net.Listen("tcp", o.simListen)
	if err != nil {
		return nil, fmt.Errorf("starting the Stripe simulator: %w", err)
	}
	srv := &http.Server{Handler: sim.Handler(), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	// The simulator serves the v2 meter event stream on the same address.
	cfg.StripeAPIKey, cfg.StripeAPIBase = stripesim.DefaultKey, "http://"+ln.Addr().String()
	cfg.StripeMeterEventsBase = cfg.StripeAPIBase
	o.simListen = ln.Addr().String()
	// The simulator is the event destination's sender too: its meter error
	// reports reach POST /v1/stripe/events, signed with the dev secret.
	if cfg.StripeWebhookSecret == "" {
		cfg.StripeWebhookSecret = devWebhookSecret
	}
	d := &devSim{srv: srv, sim: sim, stop: make(chan struct{})}
	go deliverReports(sim, stripesim.DefaultAccount, "http://"+cfg.Listen+"/v1/stripe/events", cfg.StripeWebhookSecret, d.stop)
	return d, nil
}

// devWebhookSecret signs the simulator's events in tally dev.
const devWebhookSecret = "whsec_tally_dev_simulator"

// deliverReports posts the simulator's meter error reports to url every
// few seconds until stop is closed; a delivery that fails is tried again
// on the next round, as Stripe retries.
func deliverReports(sim *stripesim.Server, account, url, secret string, stop <-chan struct{}) {
	t := time.NewTicker(3 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, _ = sim.DeliverReports(ctx, account, url, secret)
			cancel()
		}
	}
}

// devToken returns the token kept in the data directory under name,
// making one the first time.
func devToken(dataDir, name string) (string, error) {
	path := filepath.Join(dataDir, name)
	b, err := os.ReadFile(path)
	if err == nil {
		return strings.TrimSpace(string(b)), nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	var raw [32]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return "", err
	}
	token := auth.TokenPrefix + base64.RawURLEncoding.EncodeToString(raw[:])
	return token, os.WriteFile(path, []byte(token+"\n"), 0o600)
}

func runDev(ctx context.Context, e *env, _ []string) error {
	admin, ingest := e.cfg.AdminToken, ""
	if e.cfg.DatabaseURL == "" {
		var err error
		if admin == "" {
			if admin, err = devToken(e.cfg.DataDir, "dev-admin-token"); err != nil {
				return err
			}
			e.cfg.AdminToken = admin
		}
		if ingest, err = devToken(e.cfg.DataDir, "dev-ingest-token"); err != nil {
			return err
		}
		if err := ensureIngestToken(ctx, e, ingest); err != nil {
			return err
		}
	}
	if e.cfg.StripeAPIBase == "http://"+e.opts.simListen {
		// The demo: the simulator's meters and customers, mapped.
		for _, f := range demoFeatures {
			in := mappings.FeatureInput{EventName: f.event, Aggregation: f.agg, Window: mappings.Duration(f.win)}
			if _, _, err := e.parts.Mappings.PutFeature(ctx, e.db.Pool, f.name, in, "tally dev"); err != nil {
				return fmt.Errorf("mapping the demo feature %s: %w", f.name, err)
			}
		}
		for _, t := range demoTenants {
			if _, _, err := e.parts.Mappings.PutTenant(ctx, e.db.Pool, t.tenant, mappings.TenantInput{StripeCustomerID: t.customer}, "tally dev"); err != nil {
				return fmt.Errorf("mapping the demo tenant %s: %w", t.tenant, err)
			}
		}
	}
	ready := func(addr string) {
		w := e.stdout
		fmt.Fprintf(w, "\nTally is running at http://%s (API /v1, health /healthz, readiness /readyz, metrics /metrics)\n", addr)
		if admin != "" {
			fmt.Fprintf(w, "Admin token:  %s\n", admin)
			fmt.Fprintf(w, "Console:      http://%s/console/ (sign in with the admin token)\n", addr)
		}
		if e.cfg.StripeAPIBase == "http://"+e.opts.simListen {
			fmt.Fprintf(w, "Stripe:       the built-in simulator at http://%s (recorded events: http://%s/_sim/events)\n", e.opts.simListen, e.opts.simListen)
			fmt.Fprintf(w, "Demo:         tenants acme and globex; features api_calls (sum, 1m windows), seats (last, 1m), logins (count, sent per event)\n")
		}
		if ingest != "" {
			fmt.Fprintf(w, "\nPost usage:\n  curl -sS -X POST http://%s/v1/usage -H 'Authorization: Bearer %s' \\\n", addr, ingest)
			fmt.Fprintf(w, "    -d '{\"events\":[{\"id\":\"demo-'$(date +%%s%%N)'\",\"tenant\":\"acme\",\"feature\":\"logins\",\"value\":1},\n")
			fmt.Fprintf(w, "                   {\"id\":\"demo-'$(date +%%s%%N)'-b\",\"tenant\":\"acme\",\"feature\":\"api_calls\",\"value\":5}]}'\n")
			fmt.Fprintf(w, "See it reach Stripe (logins at once, api_calls when its minute closes):\n")
			fmt.Fprintf(w, "  curl -sS http://%s/_sim/events\n", e.opts.simListen)
			fmt.Fprintf(w, "  curl -sS http://%s/v1/outbox/summary -H 'Authorization: Bearer %s'\n", addr, admin)
		}
		where := "embedded PostgreSQL in " + e.cfg.DataDir
		if e.cfg.DatabaseURL != "" {
			where = "TALLY_DATABASE_URL"
		}
		fmt.Fprintf(w, "\nData: %s. Stop with Ctrl-C.\n", where)
	}
	return app.Serve(ctx, e.cfg, e.db, e.parts, e.logger, ready)
}

// ensureIngestToken makes token a live ingest token named "dev ingest".
func ensureIngestToken(ctx context.Context, e *env, token string) error {
	if _, err := auth.Verify(ctx, e.db.Pool, token); err == nil {
		return nil
	}
	return auth.EnsureToken(ctx, e.db.Pool, "dev ingest", auth.RoleIngest, token)
}

func runTokensCreate(ctx context.Context, e *env, _ []string) error {
	role, err := auth.ParseRole(e.opts.role)
	if err != nil {
		return usageError{err.Error()}
	}
	name := e.opts.name
	if name == "" {
		var raw [4]byte
		_, _ = rand.Read(raw[:])
		name = fmt.Sprintf("%s-%x", role, raw)
	}
	tok, err := auth.CreateToken(ctx, e.db.Pool, name, role, e.opts.tenants)
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stderr, "Created %s token %q%s. It is shown once; Tally keeps only its hash.\n", role, name, scopeText(tok.Tenants))
	fmt.Fprintln(e.stdout, tok.Secret)
	return nil
}

func scopeText(tenants []string) string {
	if len(tenants) == 0 {
		return ""
	}
	return " for tenants " + strings.Join(tenants, ", ")
}

func runTokensList(ctx context.Context, e *env, _ []string) error {
	rows, err := e.db.Pool.Query(ctx, `SELECT name, role, coalesce(array_to_string(tenants, ','), '(all)'), created_at, revoked_at
		FROM api_tokens ORDER BY created_at`)
	if err != nil {
		return err
	}
	defer rows.Close()
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tROLE\tTENANTS\tCREATED\tREVOKED")
	for rows.Next() {
		var (
			name, role, tenants string
			created             time.Time
			revoked             *time.Time
		)
		if err := rows.Scan(&name, &role, &tenants, &created, &revoked); err != nil {
			return err
		}
		rev := ""
		if revoked != nil {
			rev = revoked.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", name, role, tenants, created.UTC().Format(time.RFC3339), rev)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	return tw.Flush()
}

func mappingArgs(args []string) error {
	if len(args) == 0 {
		return errors.New("want list, get NAME or set NAME")
	}
	switch args[0] {
	case "list":
		if len(args) != 1 {
			return errors.New("list takes no name")
		}
	case "get", "set":
		if len(args) != 2 {
			return fmt.Errorf("%s needs one name", args[0])
		}
	default:
		return fmt.Errorf("unknown action %q: want list, get or set", args[0])
	}
	return nil
}

func who() string {
	name := os.Getenv("USER")
	if name == "" {
		name = strconv.Itoa(os.Getuid())
	}
	return "cli:" + name
}

func mappingFailure(err error) error {
	var ve *mappings.ValidationError
	if errors.As(err, &ve) {
		return usageError{ve.Error()}
	}
	return err
}

// featureExporterFlag makes --exporter of `mappings features set` the
// feature mapping's exporter, like --event-name and --aggregation are its
// other fields. The service's own --exporter (TALLY_EXPORTER, the node's
// default) is registered on this command's flags already and means nothing
// to it: it is taken over here, so that --exporter is never silently read as
// the node's setting while the mapping goes back to the default. The node's
// setting still comes from TALLY_EXPORTER in the environment.
func featureExporterFlag(fs *flag.FlagSet, o *opts) {
	usage := "set: the exporter of the feature's items, " + strings.Join(mappings.Exporters, " or ") +
		" (default: none, the node's TALLY_EXPORTER)"
	set := func(v string) error { o.exporter = v; return nil }
	if f := fs.Lookup("exporter"); f != nil {
		f.Value, f.Usage, f.DefValue = funcValue(set), usage, ""
		return
	}
	fs.Func("exporter", usage, set)
}

// funcValue is a flag.Value that hands what is set to a function.
type funcValue func(string) error

func (f funcValue) Set(v string) error { return f(v) }
func (f funcValue) String() string     { return "" }

func runFeatures(ctx context.Context, e *env, args []string) error {
	m, pool := e.parts.Mappings, e.db.Pool
	switch args[0] {
	case "list":
		fs, err := m.Features(ctx, pool)
		if err != nil {
			return err
		}
		return printJSON(e.stdout, map[string]any{"features": fs})
	case "get":
		f, err := m.GetFeature(ctx, pool, args[1])
		if err != nil {
			return err
		}
		hist, err := m.FeatureHistory(ctx, pool, args[1])
		if err != nil {
			return err
		}
		return printJSON(e.stdout, map[string]any{"mapping": f, "history": hist})
	}
	in := mappings.FeatureInput{EventName: e.opts.eventName, Aggregation: mappings.Aggregation(e.opts.aggregation), Exporter: e.opts.exporter}
	if e.opts.window != "" {
		if err := in.Window.UnmarshalText([]byte(e.opts.window)); err != nil {
			return usageError{"--window: " + err.Error()}
		}
	}
	f, changed, err := m.PutFeature(ctx, pool, args[1], in, who())
	if err != nil {
		return mappingFailure(err)
	}
	return printJSON(e.stdout, map[string]any{"mapping": f, "changed": changed})
}

func runTenants(ctx context.Context, e *env, args []string) error {
	m, pool := e.parts.Mappings, e.db.Pool
	switch args[0] {
	case "list":
		ts, err := m.Tenants(ctx, pool)
		if err != nil {
			return err
		}
		return printJSON(e.stdout, map[string]any{"tenants": ts})
	case "get":
		t, err := m.GetTenant(ctx, pool, args[1])
		if err != nil {
			return err
		}
		hist, err := m.TenantHistory(ctx, pool, args[1])
		if err != nil {
			return err
		}
		return printJSON(e.stdout, map[string]any{"mapping": t, "history": hist})
	}
	in := mappings.TenantInput{StripeCustomerID: e.opts.customer}
	if e.opts.anchor != "" {
		a, err := time.Parse(time.RFC3339, e.opts.anchor)
		if err != nil {
			return usageError{"--anchor: want RFC 3339, e.g. 2026-01-15T00:00:00Z"}
		}
		in.PeriodAnchor = &a
	}
	t, changed, err := m.PutTenant(ctx, pool, args[1], in, who())
	if err != nil {
		return mappingFailure(err)
	}
	return printJSON(e.stdout, map[string]any{"mapping": t, "changed": changed})
}

func runQuarantine(ctx context.Context, e *env, _ []string) error {
	if e.opts.period != "" {
		if _, _, err := quarantine.ParsePeriod(e.opts.period); err != nil {
			return usageError{err.Error()}
		}
	}
	rep, err := quarantine.Quarantined(ctx, e.db.Pool, quarantine.Filter{Reason: e.opts.reason, Tenant: e.opts.tenant, Feature: e.opts.feature, Period: e.opts.period})
	if err != nil {
		return err
	}
	switch e.opts.format {
	case "table":
		return rep.Table(e.stdout)
	case "csv":
		return rep.CSV(e.stdout)
	case "json":
		return printJSON(e.stdout, rep)
	}
	return usageError{"--format must be table, csv or json"}
}

func runRequeue(ctx context.Context, e *env, args []string) error {
	id, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil || id < 1 {
		return usageError{"the item id must be a positive number"}
	}
	if e.opts.mappingVersion < 0 {
		return usageError{"--mapping-version is required: the current mapping version of the item's tenant and feature"}
	}
	res, err := e.parts.Requeuer.Requeue(ctx, e.db.Pool, id, e.opts.mappingVersion, who())
	if err != nil {
		return err
	}
	return printJSON(e.stdout, res)
}

func runCompleteness(ctx context.Context, e *env, _ []string) error {
	if _, _, err := quarantine.ParsePeriod(e.opts.period); err != nil {
		return usageError{"--period is required, as YYYY-MM"}
	}
	c, err := quarantine.CompletenessOf(ctx, e.db.Pool, e.opts.period, e.opts.tenant)
	if err != nil {
		return err
	}
	switch e.opts.format {
	case "table":
		if err := c.Table(e.stdout); err != nil {
			return err
		}
	case "json":
		if err := printJSON(e.stdout, c); err != nil {
			return err
		}
	default:
		return usageError{"--format must be table or json"}
	}
	if !c.Holds {
		return errors.New("the conservation identity does not hold for every line")
	}
	return nil
}

func runReconcile(ctx context.Context, e *env, _ []string) error {
	if e.parts.Reconciler == nil {
		return errors.New("no Stripe key (STRIPE_API_KEY): there is nothing to reconcile against")
	}
	if e.opts.format != "table" && e.opts.format != "json" {
		return usageError{"--format must be table or json"}
	}
	opts := reconcile.Options{Settle: e.cfg.ReconcileSettle}
	if e.opts.settle >= 0 {
		opts.Settle = e.opts.settle
	}
	if e.opts.since != "" {
		t, err := time.Parse(time.RFC3339, e.opts.since)
		if err != nil {
			if t, err = time.Parse(time.DateOnly, e.opts.since); err != nil {
				return usageError{"--since must be RFC 3339 or YYYY-MM-DD"}
			}
		}
		opts.Since = t
	}
	run, err := e.parts.Reconciler.RunNow(ctx, e.db.Pool, reconcile.TriggerCommand, "tally reconcile", opts)
	if errors.Is(err, reconcile.ErrRunning) {
		return errors.New("another reconcile run is in progress; see GET /v1/reconcile/runs")
	}
	if err != nil && run.ID == 0 {
		return err
	}
	ds, derr := reconcile.Discrepancies(ctx, e.db.Pool, run.ID)
	if derr != nil {
		return derr
	}
	if e.opts.planOut != "" {
		p, perr := reconcile.PlanOf(ctx, e.db.Pool, e.parts.Outbox, run.ID)
		if perr != nil {
			return perr
		}
		b, perr := json.MarshalIndent(p, "", "  ")
		if perr != nil {
			return perr
		}
		if perr := os.WriteFile(e.opts.planOut, append(b, '\n'), 0o600); perr != nil {
			return perr
		}
		fmt.Fprintf(e.stderr, "plan: %d recoveries written to %s (%d discrepancies without one); review it, then: tally recover --plan %s\n",
			len(p.Actions), e.opts.planOut, p.Unplanned, e.opts.planOut)
	}
	if e.opts.format == "json" {
		if perr := printJSON(e.stdout, map[string]any{"run": run, "discrepancies": ds}); perr != nil {
			return perr
		}
		return err
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "run %d\t%s\n", run.ID, run.Status)
	fmt.Fprintf(w, "destination\t%s (%s)\n", run.Account, run.Mode)
	fmt.Fprintf(w, "settle\t%s\n", run.Settle)
	fmt.Fprintf(w, "keys (customer, meter)\t%d of %d\n", run.KeysDone, run.KeysTotal)
	fmt.Fprintf(w, "hours compared\t%d (%d matched, %d skipped: an item in flight or not settled)\n", run.HoursCompared, run.HoursMatched, run.HoursSkipped)
	fmt.Fprintf(w, "items confirmed\t%d\n", run.ItemsConfirmed)
	fmt.Fprintf(w, "discrepancies\t%d\n", run.Discrepancies)
	fmt.Fprintf(w, "stripe calls\t%d\n", run.StripeCalls)
	if run.Error != "" {
		fmt.Fprintf(w, "error\t%s: %s\n", run.ErrorCode, run.Error)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if len(ds) > 0 {
		fmt.Fprintln(e.stdout)
		w = tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "REASON\tMETER\tCUSTOMER\tHOUR\tFORMULA\tEXPECTED\tSTRIPE\tDIFFERENCE\tEXPLANATION\tUNCERTAIN ITEMS")
		for _, d := range ds {
			provider, diff := "(none)", ""
			if d.Provider != nil {
				provider, diff = *d.Provider, *d.Difference
			}
			hour := d.Hour.Format(time.RFC3339)
			if d.Refused() {
				// Stripe refused the key's summaries: nothing was compared.
				hour, provider = "from "+hour, fmt.Sprintf("refused: %s (%d)", d.ErrorCode, d.ErrorStatus)
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%v\n", d.Reason, d.EventName, d.Customer, hour,
				d.Formula, d.Expected, provider, diff, d.Explanation, d.UncertainItems)
		}
		if ferr := w.Flush(); ferr != nil {
			return ferr
		}
	}
	return err
}

func runRecover(ctx context.Context, e *env, args []string) error {
	if e.opts.plan != "" {
		if len(args) > 0 {
			return usageError{"give an item id or --plan, not both"}
		}
		b, err := os.ReadFile(e.opts.plan)
		if err != nil {
			return err
		}
		var p reconcile.Plan
		dec := json.NewDecoder(strings.NewReader(string(b)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&p); err != nil {
			return usageError{fmt.Sprintf("--plan %s: not a plan: %v", e.opts.plan, err)}
		}
		results := reconcile.ApplyPlan(ctx, e.db.Pool, e.parts.Outbox, p, who())
		w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "ITEM\tTO\tRESULT")
		failed := 0
		for _, r := range results {
			res := "applied"
			if !r.Applied {
				res, failed = "refused: "+r.Error, failed+1
			}
			fmt.Fprintf(w, "%d\t%s\t%s\n", r.Item, r.To, res)
		}
		if err := w.Flush(); err != nil {
			return err
		}
		if failed > 0 {
			return fmt.Errorf("%d of %d recoveries refused; the others were applied", failed, len(results))
		}
		return nil
	}
	if len(args) != 1 {
		return usageError{"want an item id (or --plan FILE)"}
	}
	id, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil || id < 1 {
		return usageError{"the item id must be a positive integer"}
	}
	if e.opts.expect == "" || e.opts.to == "" {
		return usageError{"--expect and --to are required"}
	}
	it, err := reconcile.Recover(ctx, e.db.Pool, e.parts.Outbox, id, reconcile.Recovery{
		Expect: outbox.State(e.opts.expect), To: outbox.State(e.opts.to), Reason: e.opts.reason,
		NotReached: e.opts.notReached, ProviderRef: e.opts.providerRef, By: who()})
	var se *reconcile.ExpectedStateError
	switch {
	case errors.As(err, &se):
		return fmt.Errorf("expected_state_mismatch: %v", se)
	case errors.Is(err, reconcile.ErrInvalidRecovery):
		return usageError{err.Error()}
	case err != nil:
		return err
	}
	fmt.Fprintf(e.stdout, "item %d: %s -> %s\n", id, e.opts.expect, it.State)
	return nil
}

func runDoctor(ctx context.Context, e *env, _ []string) error {
	if e.opts.format != "table" && e.opts.format != "json" {
		return usageError{"--format must be table or json"}
	}
	pool, dbErr := app.Connect(ctx, e.cfg)
	if pool != nil {
		defer pool.Close()
	}
	res, err := exporter.NewResolver(exporter.Settings{Key: e.cfg.StripeAPIKey, APIBase: e.cfg.StripeAPIBase,
		MeterEventsBase: e.cfg.StripeMeterEventsBase, Account: e.cfg.StripeAccount, Exporter: e.cfg.Exporter})
	if err != nil {
		return err
	}
	results := doctor.Run(ctx, doctor.Deps{Config: e.cfg, Pool: pool, DBErr: dbErr, Resolver: res})
	if e.opts.format == "json" {
		if err := printJSON(e.stdout, results); err != nil {
			return err
		}
	} else {
		for _, r := range results {
			fmt.Fprintf(e.stdout, "%-4s  %-13s %s\n", r.Status, r.Check, r.Detail)
			if r.Fix != "" {
				fmt.Fprintf(e.stdout, "      %-13s fix: %s\n", "", r.Fix)
			}
		}
	}
	if doctor.Failed(results) {
		return errors.New("problems found; each says how to fix it")
	}
	return nil
}

func runStripeSim(ctx context.Context, e *env, _ []string) error {
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{e.opts.simKey: e.opts.simAccount}, Limits: e.opts.simLimits})
	defer sim.Close()
	for _, c := range e.opts.customers {
		sim.CreateCustomer(e.opts.simAccount, c)
	}
	for _, m := range e.opts.meters {
		event, formula, ok := strings.Cut(m, ":")
		if !ok || event == "" {
			return usageError{fmt.Sprintf("--meter %q: want EVENT_NAME:FORMULA", m)}
		}
		switch formula {
		case "sum", "count", "last":
		default:
			return usageError{fmt.Sprintf("--meter %q: the formula is sum, count or last", m)}
		}
		sim.CreateMeter(e.opts.simAccount, stripesim.MeterSpec{DisplayName: event, EventName: event, Formula: formula})
	}
	ln, err := net.Listen("tcp", e.opts.simListen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: sim.Handler(), ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintf(e.stdout, "Stripe simulator on http://%s\nUse: STRIPE_API_BASE=http://%s STRIPE_METER_EVENTS_BASE=http://%s STRIPE_API_KEY=%s\nRecorded events: http://%s/_sim/events\n",
		ln.Addr(), ln.Addr(), ln.Addr(), e.opts.simKey, ln.Addr())
	if e.opts.webhookURL != "" {
		stop := make(chan struct{})
		defer close(stop)
		go deliverReports(sim, e.opts.simAccount, e.opts.webhookURL, e.opts.webhookSecret, stop)
		fmt.Fprintf(e.stdout, "Meter error reports: posted to %s (STRIPE_WEBHOOK_SECRET=%s)\n", e.opts.webhookURL, e.opts.webhookSecret)
	}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
