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

	"github.com/tallymeter/tally/internal/app"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/config"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/quarantine"
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
	customer, anchor                string
	format, reason, tenant, feature string
	period                          string
	mappingVersion                  int
	simListen, simKey, simAccount   string
	meters                          stringList
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
		{name: "dev", service: true, run: runDev},
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
			fs.StringVar(&o.eventName, "event-name", "", "set: the Stripe meter's event_name")
			fs.StringVar(&o.aggregation, "aggregation", "", "set: sum, last or count (the meter's formula)")
			fs.StringVar(&o.window, "window", "", "set: the window, dividing a day (default 1h)")
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
		}, run: runStripeSim},
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

// devTokenFile keeps the dev admin token between runs of `tally dev`.
const devTokenFile = "dev-admin-token"

func runDev(ctx context.Context, e *env, _ []string) error {
	token := e.cfg.AdminToken
	if token == "" && e.cfg.DatabaseURL == "" {
		path := filepath.Join(e.cfg.DataDir, devTokenFile)
		b, err := os.ReadFile(path)
		switch {
		case err == nil:
			token = strings.TrimSpace(string(b))
		case errors.Is(err, os.ErrNotExist):
			var raw [32]byte
			if _, err := rand.Read(raw[:]); err != nil {
				return err
			}
			token = auth.TokenPrefix + base64.RawURLEncoding.EncodeToString(raw[:])
			if err := os.WriteFile(path, []byte(token+"\n"), 0o600); err != nil {
				return err
			}
		default:
			return err
		}
		e.cfg.AdminToken = token
	}
	ready := func(addr string) {
		fmt.Fprintf(e.stdout, "\nTally is running at http://%s (health /healthz, readiness /readyz, metrics /metrics, API /v1)\n", addr)
		if token != "" {
			fmt.Fprintf(e.stdout, "Admin token: %s\n", token)
		}
		where := "embedded PostgreSQL in " + e.cfg.DataDir
		if e.cfg.DatabaseURL != "" {
			where = "TALLY_DATABASE_URL"
		}
		fmt.Fprintf(e.stdout, "Data: %s. Stop with Ctrl-C.\n", where)
		fmt.Fprintln(e.stdout, "Not built yet: export to Stripe with the built-in simulator and demo data (issue 4); without STRIPE_API_KEY, usage stays pending.")
	}
	return app.Serve(ctx, e.cfg, e.db, e.parts, e.logger, ready)
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
	in := mappings.FeatureInput{EventName: e.opts.eventName, Aggregation: mappings.Aggregation(e.opts.aggregation)}
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
	res, err := e.parts.Requeuer.Requeue(ctx, e.db.Pool, id, e.opts.mappingVersion)
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

func runStripeSim(ctx context.Context, e *env, _ []string) error {
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{e.opts.simKey: e.opts.simAccount}})
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
	fmt.Fprintf(e.stdout, "Stripe simulator on http://%s\nUse: STRIPE_API_BASE=http://%s STRIPE_API_KEY=%s\n",
		ln.Addr(), ln.Addr(), e.opts.simKey)
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
