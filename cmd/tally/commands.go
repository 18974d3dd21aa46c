package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/embeddedpg"
	"github.com/tallymeter/tally/internal/errcode"
)

// command is one runnable command: its name as typed, its own flags, and
// what it does once the configuration is loaded and the database open. A
// command's flags live in a struct of its own, made afresh for each run by
// the command's constructor, which its functions close over.
type command struct {
	name string
	// flags registers the command's own flags.
	flags func(fs *flag.FlagSet)
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
	prepare func(ctx context.Context, cfg *config.Config, stdout io.Writer) (io.Closer, error)
	run     func(ctx context.Context, env *env, args []string) error
}

// commands is the table of every command, in the order of the usage text.
func commands() []command {
	return []command{
		serveCommand(),
		devCommand(),
		migrateCommand(),
		tokensCreateCommand(),
		tokensListCommand(),
		tokensRevokeCommand(),
		importCommand(),
		cancelCommand(),
		mappingsFeaturesCommand(),
		mappingsTenantsCommand(),
		quarantineCommand(),
		requeueMatchingCommand(),
		itemsListCommand(),
		stripeSimCommand(),
		healthcheckCommand(),
		reconcileCommand(),
		recoverCommand(),
		doctorCommand(),
		completenessCommand(),
		archiveVerifyCommand(),
		archiveRestoreCommand(),
		archiveDetachCommand(),
		archiveCommand(),
	}
}

// lookup finds the command that args name, two words ("tokens list")
// before one, and returns it with the arguments that follow its name.
func lookup(args []string) (command, []string, bool) {
	all := commands()
	two := ""
	if len(args) > 1 {
		two = args[0] + " " + args[1]
	}
	for _, c := range all {
		if c.name == two {
			return c, args[2:], true
		}
	}
	for _, c := range all {
		if c.name == args[0] {
			return c, args[1:], true
		}
	}
	return command{}, nil, false
}

// exactly checks for n positional arguments, described as what.
func exactly(n int, what string) func([]string) error {
	return func(args []string) error {
		if len(args) != n {
			return fmt.Errorf("want %s", what)
		}
		return nil
	}
}

// env is what a command runs with.
type env struct {
	cfg    config.Config
	db     *app.DB
	parts  *app.Parts
	logger *slog.Logger
	stdout io.Writer
	stderr io.Writer
}

// execute runs cmd with the configuration prepared: on its own when it needs
// no database, or else on the database opened for it, which a service
// command starts and an operator command attaches to.
func execute(ctx context.Context, cmd command, e *env, args []string) int {
	if cmd.noDB {
		return exitStatus(cmd, e.stderr, cmd.run(ctx, e, args))
	}
	parts, err := app.Build(e.cfg)
	if err != nil {
		fmt.Fprintf(e.stderr, "tally %s: %v\n", cmd.name, err)
		return 2
	}
	db, err := app.Open(ctx, e.cfg, e.logger, !cmd.service)
	if err != nil {
		if errors.Is(err, embeddedpg.ErrNoBinaries) || errors.Is(err, embeddedpg.ErrNoCitus) || errors.Is(err, errors.ErrUnsupported) {
			fmt.Fprintf(e.stderr, "tally %s: %v\n", cmd.name, err)
			return 1
		}
		e.logger.Error("opening the database failed", "error", err)
		fmt.Fprintf(e.stderr, "tally %s: opening the database failed: %v\n", cmd.name, err)
		return 1
	}
	defer db.Close()

	if !cmd.service {
		// An operator command (a requeue, say) needs the destination now;
		// without one it reports export as stalled.
		_, _ = parts.Resolver.Resolve(ctx)
	}
	e.db, e.parts = db, parts
	return exitStatus(cmd, e.stderr, cmd.run(ctx, e, args))
}

// exitStatus reports a command's error: 2 for a mistake in how it was
// called (a usage error, or a domain refusal coded invalid), a findings
// error's own status, 1 for another refusal or a failure. A refusal other
// than invalid input is printed after its condition (not_found: …).
func exitStatus(cmd command, stderr io.Writer, err error) int {
	if err == nil {
		return 0
	}
	code := errcode.Of(err)
	switch code {
	case errcode.Internal, errcode.Invalid:
		fmt.Fprintf(stderr, "tally %s: %v\n", cmd.name, err)
	default:
		fmt.Fprintf(stderr, "tally %s: %s: %v\n", cmd.name, errcode.ConditionOf(err), err)
	}
	var ue usageError
	if errors.As(err, &ue) || code == errcode.Invalid {
		return 2
	}
	var fe findingsError
	if errors.As(err, &fe) {
		return fe.status
	}
	return 1
}

// findingsError is a command that did its work and found what a human must
// look at (tally reconcile leaving discrepancies open): its exit status is
// its own, not a failure's.
type findingsError struct {
	status int
	msg    string
}

func (e findingsError) Error() string { return e.msg }

// usageError is a mistake in how a command was called (exit status 2).
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// printJSON writes v as indented JSON, the output of the commands that
// answer in JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// who names the operator of a command in audit trails: cli: and the user.
func who() string {
	name := os.Getenv("USER")
	if name == "" {
		name = strconv.Itoa(os.Getuid())
	}
	return "cli:" + name
}

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }
