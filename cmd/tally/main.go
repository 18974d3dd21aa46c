// Command tally is Tally's one binary: the service and its operator
// commands. Run `tally help` for the list.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
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
  migrate                apply the database migrations (Tally's and River's) and exit: [--distribute] [--grant-runtime ROLE]
  tokens create          create an API token: --role ingest|finance|operator|admin [--tenant T …] [--name N] [--expires-in D] [--corrections]
  tokens list            list tokens (names, roles, scopes, corrections; never secrets)
  tokens revoke NAME     revoke a token
  import FILE…           post usage from files (JSON Lines or CSV) as POST /v1/usage would: [--format jsonl|csv] [--batch N] [--corrections]
  cancel ID…             cancel earlier usage events, as POST /v1/usage/cancellations would: --tenant T
  mappings features      list | get FEATURE | set FEATURE --event-name E --aggregation sum|last|count [--window 1h] [--exporter NAME]
  mappings tenants       list | get TENANT | set TENANT --customer cus_… [--anchor RFC3339] [--invoice-grace DURATION] [--stripe-account acct_…]
  quarantine             the quarantine report: [--format table|csv|json] [--reason R] [--tenant T] [--feature F] [--period YYYY-MM]
  requeue ID             requeue a quarantined item: --mapping-version N [--accept-period-closed]
  requeue                requeue every matching quarantined item under the current mappings: --reason R|--tenant T|--feature F|--period YYYY-MM|--all [--dry-run [--list]] [--accept-period-closed] [--limit N] [--after ID] [--format table|json]
  items list             list outbox items: [--state S] [--tenant T] [--feature F] [--limit N] [--after ID] [--format table|json]
  report completeness    the completeness report: --period YYYY-MM [--tenant T] [--format table|json]
  archive PERIOD         write a closed month's ledger, items and evidence as Parquet to TALLY_ARCHIVE_URL: [--new-generation] [--format table|json]
  archive verify PERIOD  re-read an archive, recompute its totals, compare with the manifest and the database: [--generation N] [--format table|json]
  archive restore PERIOD load an archived month into a new schema, for an audit: --schema S [--generation N]
  archive detach PERIOD  drop the ledger's month PERIOD once the archives of PERIOD and the month before are verified: [--format table|json]
  reconcile              compare accepted items with Stripe's summaries now, confirm what matches: [--settle D] [--since T] [--format table|json]
  reconcile discrepancies  list discrepancies: [--run N] [--status open|resolved|all] [--format table|json]
  reconcile resolve ID   resolve a discrepancy: --reason credited_in_stripe|reposted|accept_stripe|accept_tally --note TEXT
  recover ID             an operator's decision about an uncertain item: --expect uncertain --to accepted|pending|rejected [--reason R] [--not-reached]
  recover --plan FILE    apply a reviewed recovery plan written by tally reconcile --plan-out
  doctor                 check the configuration, database, Stripe, mappings and clocks; say what is wrong: [--format table|json]
  stripe-sim             run the built-in Stripe simulator: [--sim-listen ADDR] [--sim-key K] [--sim-account A] [--meter EVENT:FORMULA …]
  healthcheck            GET /healthz of the serve configured here (TALLY_LISTEN) on this machine; exit 0 when it answers 200
  version                print this build's version (also: --version)
  help                   show this text, or a command's flags with: tally <command> -h

Every flag of the service also has an environment variable (shown in -h).
With TALLY_DATABASE_URL unset, tally uses a private PostgreSQL cluster from
the binaries on this machine, in TALLY_DATA_DIR (default .tally); operator
commands use the one a running serve or dev started there.
`

func main() {
	os.Exit(run(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

// run is the whole of tally: it runs the command args name and returns the
// process's exit status (0 done, 1 failed, 2 called wrongly).
func run(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	if args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		fmt.Fprint(stdout, usage)
		return 0
	}
	if args[0] == "version" || args[0] == "--version" {
		fmt.Fprintf(stdout, "tally %s\n", version)
		return 0
	}
	cmd, rest, ok := lookup(args)
	if !ok {
		fmt.Fprintf(stderr, "tally: unknown command %q\n\n%s", strings.Join(args[:min(2, len(args))], " "), usage)
		return 2
	}
	line, status := parse(cmd, rest, getenv, stderr)
	if line == nil {
		return status
	}
	cfg, logger, status := configure(line, getenv, stderr)
	if logger == nil {
		return status
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cmd.service {
		logger.Info("tally starting", "command", cmd.name, "version", version)
		// Traces of Stripe calls and outbox batches, exported when
		// OTEL_EXPORTER_OTLP_ENDPOINT is set; flushed at exit.
		shutdown, err := telemetry.Setup(ctx, version)
		if err != nil {
			fmt.Fprintf(stderr, "tally %s: tracing: %v\n", cmd.name, err)
			return 2
		}
		defer shutdown()
	}
	followGoRun()

	if cmd.prepare != nil {
		closer, err := cmd.prepare(ctx, &cfg, stdout)
		if err != nil {
			fmt.Fprintf(stderr, "tally %s: %v\n", cmd.name, err)
			return 1
		}
		if closer != nil {
			defer closer.Close()
		}
	}
	return execute(ctx, cmd, &env{cfg: cfg, logger: logger, stdout: stdout, stderr: stderr}, line.args)
}

// commandLine is a command line parsed: the command, its positional
// arguments, and the service settings given to it.
type commandLine struct {
	cmd  command
	args []string
	// settings is the flag set the service settings were registered on:
	// the command's own, or a hidden one for a command without a database.
	settings *flag.FlagSet
	// load reads the configuration from those flags and the environment.
	load func() (config.Config, error)
}

// parse parses the flags and checks the positional arguments of cmd. With
// -h, or a mistake (reported on stderr), it returns nil and the exit status.
func parse(cmd command, rest []string, getenv func(string) string, stderr io.Writer) (*commandLine, int) {
	fs := flag.NewFlagSet("tally "+cmd.name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	// A command without a database takes the service's settings from the
	// environment only (its logging, say): its -h lists its own flags.
	cfgFlags := fs
	if cmd.noDB && !cmd.settings {
		cfgFlags = flag.NewFlagSet("", flag.ContinueOnError)
	}
	// serve and dev never read tally dev's dev.env; every other command
	// does, when it is there.
	flags := config.OperatorFlags
	if cmd.service {
		flags = config.Flags
	}
	load := flags(cfgFlags, getenv)
	// -h states the defaults configure gives this command, not serve's.
	if cmd.name != "serve" {
		restateDefault(cfgFlags, "log-format", textLogFormat)
	}
	if !cmd.service {
		restateDefault(cfgFlags, "log-level", operatorLogLevel)
	}
	if cmd.flags != nil {
		cmd.flags(fs)
	}
	if err := fs.Parse(interspersed(fs, rest)); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, 0
		}
		return nil, 2
	}
	if cmd.args != nil {
		if err := cmd.args(fs.Args()); err != nil {
			fmt.Fprintf(stderr, "tally %s: %v\n", cmd.name, err)
			return nil, 2
		}
	} else if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "tally %s: unexpected arguments %q\n", cmd.name, fs.Args())
		return nil, 2
	}
	return &commandLine{cmd: cmd, args: fs.Args(), settings: cfgFlags, load: load}, 0
}

// configure loads the configuration of a command line and fits it to the
// command: people read the logs of every command but serve, operator
// commands print results rather than progress, and a default data directory
// the server user cannot reach moves. With an invalid configuration, or
// no database URL in the container image (reported on stderr), it returns
// a nil logger and the exit status.
func configure(line *commandLine, getenv func(string) string, stderr io.Writer) (config.Config, *slog.Logger, int) {
	cmd := line.cmd
	cfg, err := line.load()
	if err != nil {
		fmt.Fprintf(stderr, "tally %s: invalid configuration:\n%v\n", cmd.name, err)
		return cfg, nil, 2
	}
	if image != "" && !cmd.noDB && cfg.DatabaseURL == "" {
		fmt.Fprintf(stderr, "tally %s: %s\n", cmd.name, noEmbeddedPostgres)
		return cfg, nil, 2
	}
	if cmd.name != "serve" && !settingSet(line.settings, getenv, "log-format", "TALLY_LOG_FORMAT") {
		cfg.LogFormat = textLogFormat
	}
	if !cmd.service && cfg.LogLevel == config.DefaultLogLevel {
		cfg.LogLevel = operatorLogLevel
	}
	logger := app.NewLogger(cfg)
	warnOldNames(logger, cfg.OldNames)
	if (!cmd.noDB || cmd.settings) && cfg.DatabaseURL == "" && !dataDirSet(line.settings, getenv) && embeddedpg.Unreachable(cfg.DataDir, "") {
		// Run as root from a checkout the server user cannot reach (under
		// /root, say) or another user could change: the default data
		// directory moves to one it can use, the same for every command of
		// this checkout.
		moved := embeddedpg.Fallback(cfg.DataDir)
		if cmd.service {
			logger.Warn("the default data directory cannot be used as root (the unprivileged user that runs PostgreSQL cannot reach it, or another user could change it); using another",
				"default", cfg.DataDir, "using", moved, "hint", "set TALLY_DATA_DIR to choose")
		}
		cfg.DataDir = moved
	}
	return cfg, logger, 0
}

// warnOldNames logs one warning for each setting given by its old name.
func warnOldNames(logger *slog.Logger, names []config.OldName) {
	for _, n := range names {
		logger.Warn("deprecated setting name: it still works, but use the new one", "old", n.Old, "new", n.New)
	}
}

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

// The logging defaults of every command but serve: JSON is for production,
// where serve runs, and people read the rest; operator commands print
// results, not progress.
const (
	textLogFormat    = "text"
	operatorLogLevel = "warn"
)

// restateDefault makes a setting's -h state def as its default, in place
// of the one its usage names (the configuration's).
func restateDefault(fs *flag.FlagSet, name, def string) {
	fl := fs.Lookup(name)
	if fl == nil {
		return
	}
	if i := strings.LastIndex(fl.Usage, " (default "); i >= 0 {
		fl.Usage = fl.Usage[:i]
	}
	fl.Usage += fmt.Sprintf(" (default %q)", def)
}

// settingSet reports whether a setting was given by flag or environment.
func settingSet(fs *flag.FlagSet, getenv func(string) string, flagName, envName string) bool {
	set := getenv(envName) != ""
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == flagName })
	return set
}
