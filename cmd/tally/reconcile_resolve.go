package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/tallymeter/tally/reconcile"
)

// discrepancyFlags are the flags of tally reconcile discrepancies and tally
// reconcile resolve.
type discrepancyFlags struct {
	runID  int64
	status string
	reason string
	note   string
}

func (f *discrepancyFlags) register(fs *flag.FlagSet) {
	fs.Int64Var(&f.runID, "run", 0, "with discrepancies: the run to list (default: across runs)")
	fs.StringVar(&f.status, "status", string(reconcile.DefaultStatus), "with discrepancies: open, resolved or all")
	fs.StringVar(&f.reason, "reason", "", "with resolve: credited_in_stripe, reposted, accept_stripe or accept_tally (required)")
	fs.StringVar(&f.note, "note", "", "with resolve: what was done, and where to find it (required)")
}

// reconcileArgs checks the positional arguments of tally reconcile: none
// (a run), discrepancies, or resolve and a discrepancy id.
func reconcileArgs(args []string) error {
	switch {
	case len(args) == 0:
		return nil
	case args[0] == "discrepancies" && len(args) == 1:
		return nil
	case args[0] == "resolve" && len(args) == 2:
		return nil
	}
	return errors.New("want no argument (a run now), discrepancies, or resolve ID")
}

// dispatch runs the form of tally reconcile its arguments name, refusing
// the flags of the other forms.
func (f *reconcileFlags) dispatch(ctx context.Context, e *env, args []string) error {
	runFlags := f.settle >= 0 || f.since != "" || f.planOut != ""
	listFlags := f.runID != 0 || f.status != string(reconcile.DefaultStatus)
	resolveFlags := f.reason != "" || f.note != ""
	form := ""
	if len(args) > 0 {
		form = args[0]
	}
	switch {
	case form == "" && (listFlags || resolveFlags):
		return usageError{"--run and --status go with reconcile discrepancies; --reason and --note with reconcile resolve ID"}
	case form == "discrepancies" && (runFlags || resolveFlags):
		return usageError{"reconcile discrepancies takes --run, --status and --format only"}
	case form == "resolve" && (runFlags || listFlags):
		return usageError{"reconcile resolve ID takes --reason, --note and --format only"}
	case f.format != "table" && f.format != "json":
		return usageError{"--format must be table or json"}
	case form == "discrepancies":
		return f.listDiscrepancies(ctx, e)
	case form == "resolve":
		return f.resolve(ctx, e, args[1])
	}
	return f.run(ctx, e)
}

// listDiscrepancies prints the discrepancies with the status asked for,
// Stripe-has-more first: across runs (the open ones, every one resolved,
// or both) unless --run names one.
func (f *reconcileFlags) listDiscrepancies(ctx context.Context, e *env) error {
	if f.runID < 0 {
		return usageError{"--run must be a positive run id"}
	}
	status, err := reconcile.ParseStatus(f.status)
	if err != nil {
		return usageError{"--status must be open, resolved or all"}
	}
	run, ds, err := reconcile.ListDiscrepancies(ctx, e.db.Pool, f.runID, status)
	if errors.Is(err, reconcile.ErrNotFound) {
		return fmt.Errorf("no run %d", f.runID)
	}
	if err != nil {
		return err
	}
	if f.format == "json" {
		return printJSON(e.stdout, map[string]any{"run": run, "status": status, "discrepancies": ds})
	}
	switch {
	case f.runID != 0:
		fmt.Fprintf(e.stdout, "run %d: %d %s discrepancies\n", run, len(ds), status)
	case run == 0:
		fmt.Fprintf(e.stdout, "%d %s discrepancies (no reconcile run has succeeded yet)\n", len(ds), status)
	default:
		fmt.Fprintf(e.stdout, "%d %s discrepancies, of every run (the latest that succeeded: %d)\n", len(ds), status, run)
	}
	if len(ds) == 0 {
		return nil
	}
	return printDiscrepancies(e.stdout, ds)
}

// resolve resolves discrepancy arg with --reason and --note.
func (f *reconcileFlags) resolve(ctx context.Context, e *env, arg string) error {
	id, err := strconv.ParseInt(arg, 10, 64)
	if err != nil || id < 1 {
		return usageError{"the discrepancy id must be a positive integer"}
	}
	if !reconcile.ResolutionReason(f.reason).Valid() {
		return usageError{"--reason must be credited_in_stripe, reposted, accept_stripe or accept_tally"}
	}
	if strings.TrimSpace(f.note) == "" {
		return usageError{"--note is required: what was done, and where to find it"}
	}
	d, err := reconcile.Resolve(ctx, e.db.Pool, e.parts.Outbox, id,
		reconcile.Decision{Reason: reconcile.ResolutionReason(f.reason), Note: f.note, By: who()})
	if err != nil {
		return err
	}
	if f.format == "json" {
		return printJSON(e.stdout, d)
	}
	fmt.Fprintf(e.stdout, "discrepancy %d: %s; %d accepted items confirmed\n", d.ID, resolvedText(d),
		len(d.Resolution.SettledItems))
	return nil
}

// resolvedText says who resolved a discrepancy, when and why; "open"
// while nobody has and no later run cleared it, else the run that did.
func resolvedText(d reconcile.Discrepancy) string {
	r := d.Resolution
	switch {
	case r != nil:
		return fmt.Sprintf("%s by %s at %s: %s", r.Reason, r.By, r.At.Format(time.RFC3339), r.Note)
	case d.ClearedByRun != nil:
		return fmt.Sprintf("cleared by run %d", *d.ClearedByRun)
	}
	return "open"
}

// listOr joins a list with commas; "-" when it is empty.
func listOr(s []string) string {
	if len(s) == 0 {
		return "-"
	}
	return strings.Join(s, ",")
}
