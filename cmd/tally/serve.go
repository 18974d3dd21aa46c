package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
)

// serveCommand is tally serve: the service, configured by its settings alone.
func serveCommand() command {
	return command{name: "serve", service: true, run: func(ctx context.Context, e *env, _ []string) error {
		return app.Serve(ctx, e.cfg, e.db, e.parts, e.logger, nil)
	}}
}

// devFlags are the flags of tally dev.
type devFlags struct {
	// simListen is the simulator's address: as asked for, then as bound.
	simListen string
	// simFaults are the simulator's faults (--sim-fault).
	simFaults simFaults
	// simStarted is set once prepare has started the simulator.
	simStarted bool
}

// devCommand is tally dev: the service on embedded defaults, with the
// built-in Stripe simulator and a demo mapped, for local development.
func devCommand() command {
	f := &devFlags{}
	return command{name: "dev", service: true, prepare: f.prepare, flags: f.register, run: f.run}
}

func (f *devFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.simListen, "sim-listen", "127.0.0.1:12111", "the built-in Stripe simulator's address (when STRIPE_API_KEY is unset)")
	fs.Var(&f.simFaults, "sim-fault", "a fault of the built-in simulator as NAME=VALUE, e.g. lose-reply=0.1 or latency=200ms (repeatable; NAME: "+
		f.simFaults.names()+", as tally stripe-sim's flags)")
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

// prepare starts the built-in Stripe simulator on loopback with the demo's
// meters and customers, and points this node at it, unless STRIPE_API_KEY
// is set; and it shortens the stage interval and the window grace left at
// their defaults, so that usage lands within a minute. It refuses TLS:
// dev is plain HTTP on this machine (its simulator delivers error reports
// to it over HTTP); TLS is serve's.
func (f *devFlags) prepare(_ context.Context, cfg *config.Config, _ io.Writer) (io.Closer, error) {
	if cfg.TLS.Enabled() {
		return nil, errors.New("dev serves plain HTTP for local development; TALLY_TLS_CERT and TALLY_TLS_KEY are for tally serve")
	}
	if cfg.StageInterval == meter.DefaultStageInterval {
		cfg.StageInterval = 2 * time.Second
	}
	if cfg.WindowGrace == meter.DefaultGrace {
		cfg.WindowGrace = 5 * time.Second
	}
	if cfg.StripeAPIKey != "" {
		if f.simFaults.given {
			return nil, errors.New("--sim-fault is for the built-in simulator, which dev does not start with STRIPE_API_KEY set")
		}
		return nil, nil
	}
	sim := stripesim.New(stripesim.Options{Limits: stripesim.Limits{Faults: f.simFaults.faults}})
	for _, d := range demoFeatures {
		sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: d.name, EventName: d.event, Formula: string(d.agg)})
	}
	for _, t := range demoTenants {
		sim.CreateCustomer(stripesim.DefaultAccount, t.customer)
	}
	ln, err := net.Listen("tcp", f.simListen)
	if err != nil {
		return nil, fmt.Errorf("starting the Stripe simulator: %w", err)
	}
	srv := &http.Server{Handler: sim.Handler(), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	// The simulator serves the v2 meter event stream on the same address.
	cfg.StripeAPIKey, cfg.StripeAPIBase = stripesim.DefaultKey, "http://"+ln.Addr().String()
	cfg.StripeMeterEventsBase = cfg.StripeAPIBase
	f.simListen, f.simStarted = ln.Addr().String(), true
	// The simulator is the event destination's sender too: its meter error
	// reports reach POST /v1/stripe/events, signed with the dev secret.
	if cfg.StripeWebhookSecret == "" {
		cfg.StripeWebhookSecret = devWebhookSecret
	}
	d := &devSim{srv: srv, sim: sim, stop: make(chan struct{})}
	go deliverReports(sim, stripesim.DefaultAccount, "http://"+cfg.Listen+"/v1/stripe/events", cfg.StripeWebhookSecret, d.stop)
	return d, nil
}

// devToken returns the token kept in the data directory under name,
// making one the first time. It reuses only a file it could have made: a
// regular file of this user, readable by no one else; any other stops dev.
func devToken(dataDir, name string) (string, error) {
	path := filepath.Join(dataDir, name)
	b, err := config.ReadOwnFile(path, "as a token")
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

// run makes the dev tokens and maps the demo, then serves; once the service
// listens it says where everything is.
func (f *devFlags) run(ctx context.Context, e *env, _ []string) error {
	admin, ingest, err := devTokens(ctx, e)
	if err != nil {
		return err
	}
	if f.simulated(e) {
		if err := mapDemo(ctx, e); err != nil {
			return err
		}
	}
	envFile, err := f.writeDevEnv(e)
	if err != nil {
		return fmt.Errorf("writing %s: %w", config.DevEnvFile, err)
	}
	if envFile != "" {
		defer os.Remove(envFile)
	}
	ready := func(addr string) { f.printReady(e, addr, admin, ingest, envFile) }
	return app.Serve(ctx, e.cfg, e.db, e.parts, e.logger, ready)
}

// writeDevEnv writes config.DevEnvFile in the data directory — dev's
// database when it is TALLY_DATABASE_URL, and the simulator's key and
// addresses when dev runs it — for the operator commands (doctor, requeue,
// reconcile, mappings…) to find dev; run removes it when dev stops. With
// neither (the embedded cluster, which commands find by the data
// directory, and a Stripe key of the environment) it writes none, and
// removes one an earlier dev left. It returns the file's path, or "".
func (f *devFlags) writeDevEnv(e *env) (string, error) {
	vars := map[string]string{}
	if e.cfg.DatabaseURL != "" {
		vars["TALLY_DATABASE_URL"] = e.cfg.DatabaseURL
	}
	if f.simulated(e) {
		vars["STRIPE_API_KEY"], vars["STRIPE_API_BASE"] = e.cfg.StripeAPIKey, e.cfg.StripeAPIBase
		vars["STRIPE_METER_EVENTS_BASE"], vars["STRIPE_WEBHOOK_SECRET"] = e.cfg.StripeMeterEventsBase, e.cfg.StripeWebhookSecret
	}
	if len(vars) == 0 {
		err := os.Remove(filepath.Join(e.cfg.DataDir, config.DevEnvFile))
		if errors.Is(err, os.ErrNotExist) {
			err = nil
		}
		return "", err
	}
	var notes []string
	if e.cfg.DatabaseURL == "" {
		notes = append(notes, "The admin token (for the API and the console) is in "+filepath.Join(e.cfg.DataDir, "dev-admin-token")+" unless TALLY_ADMIN_TOKEN is set.")
	}
	return config.WriteDevEnv(e.cfg.DataDir, vars, notes...)
}

// simulated reports whether this node sends to the simulator tally dev
// started: not to one of the same address it did not start (a tally
// stripe-sim of STRIPE_API_BASE, say).
func (f *devFlags) simulated(e *env) bool {
	return f.simStarted && e.cfg.StripeAPIBase == "http://"+f.simListen
}

// devTokens returns the admin token (the configured one, or one kept in the
// data directory) and a live ingest token kept there, on the embedded
// database only; on TALLY_DATABASE_URL only a configured admin token.
func devTokens(ctx context.Context, e *env) (admin, ingest string, err error) {
	admin = e.cfg.AdminToken
	if e.cfg.DatabaseURL != "" {
		return admin, "", nil
	}
	if admin == "" {
		if admin, err = devToken(e.cfg.DataDir, "dev-admin-token"); err != nil {
			return "", "", err
		}
		e.cfg.AdminToken = admin
	}
	if ingest, err = devToken(e.cfg.DataDir, "dev-ingest-token"); err != nil {
		return "", "", err
	}
	if err := ensureIngestToken(ctx, e, ingest); err != nil {
		return "", "", err
	}
	return admin, ingest, nil
}

// ensureIngestToken makes token dev's live ingest token (see
// auth.SeedToken): a new file's token replaces the previous one, and a
// revoked one is not revived.
func ensureIngestToken(ctx context.Context, e *env, token string) error {
	_, err := auth.SeedToken(ctx, e.db.Pool, auth.OriginDev, auth.RoleIngest, token)
	if errors.Is(err, auth.ErrSeedRevoked) {
		return fmt.Errorf("the ingest token in %s was revoked; remove that file to make a new one",
			filepath.Join(e.cfg.DataDir, "dev-ingest-token"))
	}
	return err
}

// mapDemo maps the demo: the simulator's meters and customers.
func mapDemo(ctx context.Context, e *env) error {
	for _, d := range demoFeatures {
		in := mappings.FeatureInput{EventName: d.event, Aggregation: d.agg, Window: mappings.Duration(d.win)}
		if _, _, err := e.parts.Mappings.PutFeature(ctx, e.db.Pool, d.name, in, "tally dev"); err != nil {
			return fmt.Errorf("mapping the demo feature %s: %w", d.name, err)
		}
	}
	for _, t := range demoTenants {
		if _, _, err := e.parts.Mappings.PutTenant(ctx, e.db.Pool, t.tenant, mappings.TenantInput{StripeCustomerID: t.customer}, "tally dev"); err != nil {
			return fmt.Errorf("mapping the demo tenant %s: %w", t.tenant, err)
		}
	}
	return nil
}

// printReady says where the service listening at addr, its console, the
// simulator, the dev.env of the operator commands and the data are, and
// how to post usage.
func (f *devFlags) printReady(e *env, addr, admin, ingest, envFile string) {
	w := e.stdout
	fmt.Fprintf(w, "\nTally is running at http://%s (API /v1, health /healthz, readiness /readyz, metrics /metrics)\n", addr)
	if admin != "" {
		fmt.Fprintf(w, "Admin token:  %s\n", admin)
		fmt.Fprintf(w, "Console:      http://%s/console/ (sign in with the admin token)\n", addr)
	}
	if f.simulated(e) {
		fmt.Fprintf(w, "Stripe:       the built-in simulator at http://%s (recorded events: http://%s/_sim/events)\n", f.simListen, f.simListen)
		fmt.Fprintf(w, "Demo:         tenants acme and globex; features api_calls (sum, 1m windows), seats (last, 1m), logins (count, sent per event)\n")
	} else {
		// No demo is mapped and no simulator records: the token, not the
		// demo's commands.
		fmt.Fprintf(w, "Stripe:       STRIPE_API_KEY's account at %s (no simulator started, no demo mapped)\n", e.cfg.StripeAPIBase)
		if ingest != "" {
			fmt.Fprintf(w, "Ingest token: %s\n", ingest)
		}
	}
	if ingest != "" && f.simulated(e) {
		fmt.Fprintf(w, "\nPost usage:\n  curl -sS -X POST http://%s/v1/usage -H 'Authorization: Bearer %s' \\\n", addr, ingest)
		fmt.Fprintf(w, "    -d '{\"events\":[{\"id\":\"demo-'$(date +%%s%%N)'\",\"tenant\":\"acme\",\"feature\":\"logins\",\"value\":1},\n")
		fmt.Fprintf(w, "                   {\"id\":\"demo-'$(date +%%s%%N)'-b\",\"tenant\":\"acme\",\"feature\":\"api_calls\",\"value\":5}]}'\n")
		fmt.Fprintf(w, "See it reach Stripe (logins at once, api_calls when its minute closes):\n")
		fmt.Fprintf(w, "  curl -sS http://%s/_sim/events\n", f.simListen)
		fmt.Fprintf(w, "  curl -sS http://%s/v1/outbox/summary -H 'Authorization: Bearer %s'\n", addr, admin)
	}
	where := "embedded PostgreSQL in " + e.cfg.DataDir
	if e.cfg.EmbeddedWorkers > 0 {
		where = fmt.Sprintf("embedded Citus, a coordinator and %d workers, in %s", e.cfg.EmbeddedWorkers, app.CitusDataDir(e.cfg.DataDir))
	}
	if e.cfg.DatabaseURL != "" {
		where = "TALLY_DATABASE_URL"
	}
	if envFile != "" {
		fmt.Fprintf(w, "\nOperator commands run here (tally doctor, requeue, reconcile, mappings …) find dev through %s (mode 0600: it holds the simulator's key).\n", envFile)
	}
	fmt.Fprintf(w, "\nData: %s. Stop with Ctrl-C.\n", where)
}
