package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/doctor"
	"github.com/tallymeter/tally/exporter"
)

// doctorFlags are the flags of tally doctor, besides every service setting.
type doctorFlags struct {
	format string
}

// doctorCommand is tally doctor: the checks of the configuration, the
// database, Stripe, the mappings and the clocks. It opens no database the
// way the other commands do: a database it cannot reach is one of its
// findings.
func doctorCommand() command {
	f := &doctorFlags{}
	return command{name: "doctor", noDB: true, settings: true, flags: f.register, run: f.run}
}

func (f *doctorFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.format, "format", "table", "table or json")
}

func (f *doctorFlags) run(ctx context.Context, e *env, _ []string) error {
	if f.format != "table" && f.format != "json" {
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
	if f.format == "json" {
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
