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
	"syscall"

	"github.com/tallymeter/tally/internal/app"
	"github.com/tallymeter/tally/internal/config"
	"github.com/tallymeter/tally/internal/embeddedpg"
)

const usage = `tally — usage metering from product services to Stripe Billing, exactly once.

Usage:
  tally <command> [flags]

Commands:
  serve     run the service: HTTP API and the outbox maintenance loop
  dev       run the service on embedded defaults for local development
  migrate   apply the database migrations (Tally's and River's) and exit
  help      show this text, or a command's flags with: tally <command> -h

Every flag also has an environment variable (shown in each command's -h).
With TALLY_DATABASE_URL unset, tally starts a private PostgreSQL cluster from
the binaries on this machine, in TALLY_DATA_DIR (default .tally).
`

func main() {
	os.Exit(run(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

func run(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	cmd, args := args[0], args[1:]
	switch cmd {
	case "serve", "dev", "migrate":
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "tally: unknown command %q\n\n%s", cmd, usage)
		return 2
	}

	fs := flag.NewFlagSet("tally "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	load := config.Flags(fs, getenv)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "tally %s: unexpected arguments %q\n", cmd, fs.Args())
		return 2
	}
	cfg, err := load()
	if err != nil {
		fmt.Fprintf(stderr, "tally %s: invalid configuration:\n%v\n", cmd, err)
		return 2
	}
	logger := app.NewLogger(cfg)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	followGoRun()

	db, err := app.Open(ctx, cfg, logger)
	if err != nil {
		if errors.Is(err, embeddedpg.ErrNoBinaries) {
			fmt.Fprintf(stderr, "tally %s: %v\n", cmd, err)
			return 1
		}
		logger.Error("opening the database failed", "error", err)
		return 1
	}
	defer db.Close()

	switch cmd {
	case "migrate":
		fmt.Fprintln(stdout, "migrations applied")
		return 0
	case "dev":
		ready := func(addr string) {
			fmt.Fprintf(stdout, "\nTally is running at http://%s (health: /healthz, readiness: /readyz, metrics: /metrics)\n", addr)
			fmt.Fprintf(stdout, "Data: %s. Stop with Ctrl-C.\n", dataLocation(cfg))
			fmt.Fprintln(stdout, "Not built yet: usage ingest, mappings and tokens (issue 3), export to Stripe with the built-in simulator and demo data (issue 4).")
		}
		return exit(app.Serve(ctx, cfg, db, logger, ready), logger)
	default:
		return exit(app.Serve(ctx, cfg, db, logger, nil), logger)
	}
}

func dataLocation(cfg config.Config) string {
	if cfg.DatabaseURL != "" {
		return "TALLY_DATABASE_URL"
	}
	return "embedded PostgreSQL in " + cfg.DataDir
}

func exit(err error, logger interface{ Error(string, ...any) }) int {
	if err != nil {
		logger.Error("tally stopped", "error", err)
		return 1
	}
	return 0
}
