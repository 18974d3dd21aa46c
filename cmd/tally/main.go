// Command tally is Tally's one binary: the service and its operator
// commands. Run `tally help` for the list.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/embeddedpg"
	"github.com/tallymeter/tally/internal/telemetry"
)

const usage = `tally — usage metering from product services to Stripe Billing, exactly once.

Usage:
  tally <command> [flags]

Commands:
  serve                  run the service: HTTP API, staging, export, reconciliation, outbox maintenance
  dev                    run the service on embedded defaults for local development
  migrate                apply the database migrations (Tally's and River's) and exit
  tokens create          create an API token: --role ingest|finance|operator|admin [--tenant T …] [--name N]
  tokens list            list tokens (names, roles, scopes; never secrets)
  tokens revoke NAME     revoke a token
  mappings features      list | get FEATURE | set FEATURE --event-name E --aggregation sum|last|count [--window 1h] [--exporter NAME]
  mappings tenants       list | get TENANT | set TENANT --customer cus_… [--anchor RFC3339]
  quarantine             the quarantine report: [--format table|csv|json] [--reason R] [--tenant T] [--feature F] [--period YYYY-MM]
  requeue ID             requeue a quarantined item: --mapping-version N
  report completeness    the completeness report: --period YYYY-MM [--tenant T] [--format table|json]
  reconcile              compare accepted items with Stripe's summaries now, confirm what matches: [--settle D] [--since T] [--format table|json]
  recover ID             an operator's decision about an uncertain item: --expect uncertain --to accepted|pending|rejected [--reason R] [--not-reached]
  recover --plan FILE    apply a reviewed recovery plan written by tally reconcile --plan-out
  doctor                 check the configuration, database, Stripe, mappings and clocks; say what is wrong: [--format table|json]
  stripe-sim             run the built-in Stripe simulator: [--sim-listen ADDR] [--sim-key K] [--sim-account A] [--meter EVENT:FORMULA …]
  help                   show this text, or a command's flags with: tally <command> -h

Every flag of the service also has an environment variable (shown in -h).
With TALLY_DATABASE_URL unset, tally uses a private PostgreSQL cluster from
the binaries on this machine, in TALLY_DATA_DIR (default .tally); operator
commands use the one a running serve or dev started there.
`

func main() {
	os.Exit(run(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

// command is one runnable command: its name as typed, its own flags, and
// what it does once the configuration is loaded and the database open.
type command struct {
	name string
	// flags registers the command's own flags.
	flags func(fs *flag.FlagSet, o *opts)
	// args checks the positional arguments.
	args func(args []string) error
	// service commands start a cluster of their own; the others attach to
	// a running one when there is one.
	service bool
	// noDB commands need no database opened for them.
	noDB bool
	// settings: a noDB command that takes every service setting as a flag
	// too (doctor diagnoses them).
	settings bool
	// prepare, if set, runs after the configuration is loaded and before
	// anything is built from it; what it returns is closed at exit.
	prepare func(ctx context.Context, cfg *config.Config, o *opts, stdout io.Writer) (io.Closer, error)
	run     func(ctx context.Context, env *env, args []string) error
}

func run(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	if args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		fmt.Fprint(stdout, usage)
		return 0
	}
	cmd, rest, ok := lookup(args)
	if !ok {
		fmt.Fprintf(stderr, "tally: unknown command %q\n\n%s", strings.Join(args[:min(2, len(args))], " "), usage)
		return 2
	}

	fs := flag.NewFlagSet("tally "+cmd.name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	// A command without a database takes the service's settings from the
	// environment only (its logging, say): its -h lists its own flags.
	cfgFlags := fs
	if cmd.noDB && !cmd.settings {
		cfgFlags = flag.NewFlagSet("", flag.ContinueOnError)
	}
	load := config.Flags(cfgFlags, getenv)
	o := &opts{}
	if cmd.flags != nil {
		cmd.flags(fs, o)
	}
	if err := fs.Parse(interspersed(fs, rest)); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if cmd.args != nil {
		if err := cmd.args(fs.Args()); err != nil {
			fmt.Fprintf(stderr, "tally %s: %v\n", cmd.name, err)
			return 2
		}
	} else if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "tally %s: unexpected arguments %q\n", cmd.name, fs.Args())
		return 2
	}
	cfg, err := load()
	if err != nil {
		fmt.Fprintf(stderr, "tally %s: invalid configuration:\n%v\n", cmd.name, err)
		return 2
	}
	if cmd.name != "serve" && !settingSet(cfgFlags, getenv, "log-format", "TALLY_LOG_FORMAT") {
		cfg.LogFormat = "text" // JSON is for production, where serve runs; people read the rest
	}
	if !cmd.service && cfg.LogLevel == "info" {
		cfg.LogLevel = "warn" // operator commands print results, not progress
	}
	logger := app.NewLogger(cfg)
	if (!cmd.noDB || cmd.settings) && cfg.DatabaseURL == "" && !dataDirSet(cfgFlags, getenv) && embeddedpg.Unreachable(cfg.DataDir, "") {
		// Run as root from a checkout the server user cannot reach (under
		// /root, say): the default data directory moves to one it can, the
		// same for every command of this checkout.
		moved := embeddedpg.Fallback(cfg.DataDir)
		if cmd.service {
			logger.Warn("the default data directory is not reachable by the unprivileged user that runs PostgreSQL; using another",
				"default", cfg.DataDir, "using", moved, "hint", "set TALLY_DATA_DIR to choose")
		}
		cfg.DataDir = moved
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cmd.service {
		// Traces of Stripe calls and outbox batches, exported when
		// OTEL_EXPORTER_OTLP_ENDPOINT is set; flushed at exit.
		shutdown, err := telemetry.Setup(ctx, "dev")
		if err != nil {
			fmt.Fprintf(stderr, "tally %s: tracing: %v\n", cmd.name, err)
			return 2
		}
		defer shutdown()
	}
	followGoRun()

	if cmd.prepare != nil {
		closer, err := cmd.prepare(ctx, &cfg, o, stdout)
		if err != nil {
			fmt.Fprintf(stderr, "tally %s: %v\n", cmd.name, err)
			return 1
		}
		if closer != nil {
			defer closer.Close()
		}
	}
	if cmd.noDB {
		return exitStatus(cmd, stderr, cmd.run(ctx, &env{cfg: cfg, logger: logger, stdout: stdout, stderr: stderr, opts: o}, fs.Args()))
	}
	parts, err := app.Build(cfg)
	if err != nil {
		fmt.Fprintf(stderr, "tally %s: %v\n", cmd.name, err)
		return 2
	}
	db, err := app.Open(ctx, cfg, logger, !cmd.service)
	if err != nil {
		if errors.Is(err, embeddedpg.ErrNoBinaries) {
			fmt.Fprintf(stderr, "tally %s: %v\n", cmd.name, err)
			return 1
		}
		logger.Error("opening the database failed", "error", err)
		fmt.Fprintf(stderr, "tally %s: opening the database failed: %v\n", cmd.name, err)
		return 1
	}
	defer db.Close()

	if !cmd.service {
		// An operator command (a requeue, say) needs the destination now;
		// without one it reports export as stalled.
		_, _ = parts.Resolver.Resolve(ctx)
	}
	e := &env{cfg: cfg, db: db, parts: parts, logger: logger, stdout: stdout, stderr: stderr, opts: o}
	return exitStatus(cmd, stderr, cmd.run(ctx, e, fs.Args()))
}

// exitStatus reports a command's error: 2 for a mistake in how it was
// called, 1 for a failure.
func exitStatus(cmd command, stderr io.Writer, err error) int {
	if err == nil {
		return 0
	}
	fmt.Fprintf(stderr, "tally %s: %v\n", cmd.name, err)
	var ue usageError
	if errors.As(err, &ue) {
		return 2
	}
	return 1
}

// usageError is a mistake in how a command was called (exit status 2).
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// interspersed lets flags follow positional arguments ("requeue 42
// --mapping-version 3"), which the flag package alone does not.
func interspersed(fs *flag.FlagSet, args []string) []string {
	var flags, positional []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			positional = append(positional, args[i+1:]...)
			break
		}
		if !strings.HasPrefix(a, "-") || a == "-" {
			positional = append(positional, a)
			continue
		}
		flags = append(flags, a)
		name := strings.TrimLeft(a, "-")
		if strings.Contains(name, "=") {
			continue
		}
		if f := fs.Lookup(name); f != nil && i+1 < len(args) {
			if bf, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && bf.IsBoolFlag() {
				continue
			}
			flags = append(flags, args[i+1])
			i++
		}
	}
	return append(flags, positional...)
}

// dataDirSet reports whether the data directory was chosen, by flag or
// environment, rather than left at its default.
func dataDirSet(fs *flag.FlagSet, getenv func(string) string) bool {
	return settingSet(fs, getenv, "data-dir", "TALLY_DATA_DIR")
}

// settingSet reports whether a setting was given by flag or environment.
func settingSet(fs *flag.FlagSet, getenv func(string) string, flagName, envName string) bool {
	set := getenv(envName) != ""
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == flagName })
	return set
}
