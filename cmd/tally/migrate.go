package main

import (
	"context"
	"flag"
	"fmt"

	"github.com/tallymeter/tally/migrations"
)

// migrateCommand is tally migrate: opening the database applies the
// migrations (Tally's and River's), as the owner; --grant-runtime ROLE then
// makes a login role a member of the runtime role the nodes connect as.
func migrateCommand() command {
	var grant string
	return command{name: "migrate",
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&grant, "grant-runtime", "", "make this login role a member of "+migrations.RuntimeRole+", the role tally serve should connect as (docs/security.md)")
		},
		run: func(ctx context.Context, e *env, _ []string) error {
			fmt.Fprintln(e.stdout, "migrations applied")
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
