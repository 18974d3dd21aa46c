package main

import (
	"context"
	"flag"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/meter"
)

// cancelFlags are the flags of tally cancel.
type cancelFlags struct {
	tenant string
}

// cancelCommand is tally cancel: earlier events of a tenant, by id,
// cancelled as POST /v1/usage/cancellations does (meter.Stager.Cancel),
// whole or nothing, with the operator as the actor; it prints each
// cancellation's outcome.
func cancelCommand() command {
	f := &cancelFlags{}
	return command{name: "cancel", flags: f.register,
		args: func(args []string) error {
			if len(args) == 0 {
				return usageError{"want the ids of the events to cancel"}
			}
			return nil
		},
		run: f.run}
}

func (f *cancelFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.tenant, "tenant", "", "the tenant whose events to cancel (required)")
}

func (f *cancelFlags) run(ctx context.Context, e *env, ids []string) error {
	if f.tenant == "" {
		return usageError{"--tenant is required"}
	}
	cs := make([]meter.Cancellation, len(ids))
	for i, id := range ids {
		cs[i] = meter.Cancellation{Tenant: f.tenant, ID: id}
	}
	var out []meter.CancelResult
	err := pgx.BeginTxFunc(ctx, e.db.Pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		var err error
		out, err = e.parts.Stager.Cancel(ctx, tx, who(), cs)
		return err
	})
	if err != nil {
		return err
	}
	return printJSON(e.stdout, struct {
		Cancellations []meter.CancelResult `json:"cancellations"`
	}{out})
}
