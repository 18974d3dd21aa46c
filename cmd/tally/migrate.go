package main

import (
	"context"
	"flag"
	"fmt"

	"github.com/tallymeter/tally/migrations"
)

// migrateCommand is tally migrate: opening the database applies the
// migrations (Tally's and River's), as the owner; --distribute then places
// Tally's tables on a Citus coordinator; --grant-runtime ROLE makes a login
// role a member of the runtime role the nodes connect as.
func migrateCommand() command {
	var (
		grant      string
		distribute bool
	)
	return command{name: "migrate",
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&grant, "grant-runtime", "", "make this login role a member of "+migrations.RuntimeRole+", the role tally serve should connect as (docs/security.md)")
			fs.BoolVar(&distribute, "distribute", false, "on a Citus coordinator, distribute Tally's tables in place, with their rows; writes wait while they are copied (docs/scale.md)")
		},
		run: func(ctx context.Context, e *env, _ []string) error {
			fmt.Fprintln(e.stdout, "migrations applied")
			if distribute {
				res, err := migrations.Distribute(ctx, e.db.Pool, e.logger)
				if err != nil {
					return err
				}
				fmt.Fprintln(e.stdout, res)
			} else if err := notDistributed(ctx, e); err != nil {
				return err
			}
			if grant == "" {
				return nil
			}
			if err := migrations.GrantRuntime(ctx, e.db.Pool, grant); err != nil {
				return err
			}
			fmt.Fprintf(e.stdout, "%s is a member of %s\n", grant, migrations.RuntimeRole)
			return nil
		}}
}

// notDistributed says, on a Citus coordinator whose tables are not where
// they must be, how to place them. Placing them stays an explicit step: it
// blocks writes while it copies the rows.
func notDistributed(ctx context.Context, e *env) error {
	engine, err := migrations.ReadEngine(ctx, e.db.Pool)
	if err != nil {
		return err
	}
	if n := len(engine.Misplaced()); n > 0 {
		fmt.Fprintf(e.stdout, "%s: %d of Tally's tables are not yet distributed or reference tables; to place them, run tally migrate --distribute (docs/scale.md)\n", engine, n)
	}
	return nil
}
