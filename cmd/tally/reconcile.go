package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// reconcileFlags are the flags of tally reconcile, and of its
// discrepancies and resolve forms (discrepancyFlags).
type reconcileFlags struct {
	settle  time.Duration
	since   string
	format  string
	planOut string
	discrepancyFlags
}

// reconcileCommand is tally reconcile: a reconcile run now, its result and
// its discrepancies, and on request the recovery plan it suggests; tally
// reconcile discrepancies lists discrepancies, and tally reconcile resolve
// ID resolves one.
func reconcileCommand() command {
	f := &reconcileFlags{}
	return command{name: "reconcile", flags: f.register, args: reconcileArgs, run: f.dispatch}
}

func (f *reconcileFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&f.settle, "settle", -1, "compare only items accepted longer ago than this (default: TALLY_RECONCILE_SETTLE)")
	fs.StringVar(&f.since, "since", "", "only hours from this event time on: RFC 3339 or YYYY-MM-DD (default: all)")
	fs.StringVar(&f.format, "format", "table", "table or json")
	fs.StringVar(&f.planOut, "plan-out", "", "write the run's recovery plan to this file, for review and tally recover --plan")
	f.discrepancyFlags.register(fs)
}

// exitOpen is tally reconcile's exit status when its run succeeded and
// discrepancies are open after it (of this run or an earlier one): finance
// has work. 1 stays "could not run"; 2 is also a mistake in how the
// command was called, which runs nothing.
const exitOpen = 2

// run runs a reconcile and reports it with the discrepancies open after it,
// Stripe-has-more first. A run that failed part way is reported too, and
// its error returned after the report; a run that succeeded and leaves any
// discrepancy open ends in exitOpen.
func (f *reconcileFlags) run(ctx context.Context, e *env) error {
	if e.parts.Reconciler == nil {
		return errors.New("no Stripe key (STRIPE_API_KEY): there is nothing to reconcile against")
	}
	if f.format != "table" && f.format != "json" {
		return usageError{"--format must be table or json"}
	}
	opts, err := f.options(e.cfg.ReconcileSettle)
	if err != nil {
		return err
	}
	run, err := e.parts.Reconciler.RunNow(ctx, e.db.Pool, reconcile.TriggerCommand, "tally reconcile", opts)
	if errors.Is(err, reconcile.ErrRunning) {
		return errors.New("another reconcile run is in progress; see GET /v1/reconcile/runs")
	}
	if err != nil && run.ID == 0 {
		return err
	}
	ds, derr := reconcile.Discrepancies(ctx, e.db.Pool, run.ID)
	if derr != nil {
		return derr
	}
	open, derr := reconcile.OpenDiscrepancies(ctx, e.db.Pool)
	if derr != nil {
		return derr
	}
	if f.planOut != "" {
		if perr := f.writePlan(ctx, e, run.ID); perr != nil {
			return perr
		}
	}
	if f.format == "json" {
		if perr := printJSON(e.stdout, map[string]any{"run": run, "discrepancies": ds, "open_discrepancies": open}); perr != nil {
			return perr
		}
	} else {
		if perr := printRun(e.stdout, run); perr != nil {
			return perr
		}
		if len(open) > 0 {
			fmt.Fprintf(e.stdout, "\nopen discrepancies, of this run and earlier ones (%s):\n", openSummary(open))
			if perr := printDiscrepancies(e.stdout, open); perr != nil {
				return perr
			}
		}
	}
	if err == nil && len(open) > 0 {
		return findingsError{status: exitOpen, msg: fmt.Sprintf("%d discrepancies are open (%s); "+
			"see them with tally reconcile discrepancies, resolve each with tally reconcile resolve ID", len(open), openSummary(open))}
	}
	return err
}

// openSummary counts open discrepancies by kind, Stripe-has-more first and
// said to mean a customer may be billed too much.
func openSummary(open []reconcile.Discrepancy) string {
	n := map[string]int{}
	for _, d := range open {
		n[d.Kind]++
	}
	return fmt.Sprintf("%d where Stripe has more: a customer may be billed too much; %d where Stripe has less; %d refused",
		n[reconcile.KindStripeHasMore], n[reconcile.KindStripeHasLess], n[reconcile.KindSummariesRefused])
}

// options are the run's options from the flags; settle is the configured
// settle time, for when --settle is not given.
func (f *reconcileFlags) options(settle time.Duration) (reconcile.Options, error) {
	opts := reconcile.Options{Settle: settle}
	if f.settle >= 0 {
		opts.Settle = f.settle
	}
	if f.since != "" {
		t, err := time.Parse(time.RFC3339, f.since)
		if err != nil {
			if t, err = time.Parse(time.DateOnly, f.since); err != nil {
				return opts, usageError{"--since must be RFC 3339 or YYYY-MM-DD"}
			}
		}
		opts.Since = t
	}
	return opts, nil
}

// writePlan writes the recovery plan of run id to --plan-out and says so
// on stderr.
func (f *reconcileFlags) writePlan(ctx context.Context, e *env, id int64) error {
	p, err := reconcile.PlanOf(ctx, e.db.Pool, e.parts.Outbox, id)
	if err != nil {
		return err
	}
	b, err := json.MarshalIndent(p, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(f.planOut, append(b, '\n'), 0o600); err != nil {
		return err
	}
	fmt.Fprintf(e.stderr, "plan: %d recoveries written to %s (%d discrepancies without one); review it, then: tally recover --plan %s\n",
		len(p.Actions), f.planOut, p.Unplanned, f.planOut)
	return nil
}

// printRun writes a run's result as a table of two columns.
func printRun(out io.Writer, run reconcile.Run) error {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "run %d\t%s\n", run.ID, run.Status)
	fmt.Fprintf(w, "destination\t%s (%s)\n", run.Account, run.Mode)
	fmt.Fprintf(w, "settle\t%s\n", run.Settle)
	fmt.Fprintf(w, "keys (customer, meter)\t%d of %d\n", run.KeysDone, run.KeysTotal)
	fmt.Fprintf(w, "hours compared\t%d (%d matched, %d skipped: an item in flight or not settled)\n", run.HoursCompared, run.HoursMatched, run.HoursSkipped)
	fmt.Fprintf(w, "items confirmed\t%d\n", run.ItemsConfirmed)
	fmt.Fprintf(w, "discrepancies\t%d\n", run.Discrepancies)
	fmt.Fprintf(w, "stripe calls\t%d\n", run.StripeCalls)
	if run.Error != "" {
		fmt.Fprintf(w, "error\t%s: %s\n", run.ErrorCode, run.Error)
	}
	return w.Flush()
}

// printDiscrepancies writes discrepancies as a table, one a line: its kind
// and run, whose (tenants and features, customer and meter), the numbers,
// the items confirmed before Stripe's number moved, and whether it is open.
func printDiscrepancies(out io.Writer, ds []reconcile.Discrepancy) error {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ID\tKIND\tRUN\tTENANT\tFEATURE\tMETER\tCUSTOMER\tHOUR\tFORMULA\tEXPECTED\tSTRIPE\tDIFFERENCE\tEXPLANATION\tUNCERTAIN ITEMS\tCONFIRMED BEFORE\tRESOLVED")
	for _, d := range ds {
		provider, diff := "(none)", ""
		if d.Provider != nil {
			provider, diff = *d.Provider, *d.Difference
		}
		hour := d.Hour.Format(time.RFC3339)
		if d.Refused() {
			// Stripe refused the key's summaries: nothing was compared.
			hour, provider = "from "+hour, fmt.Sprintf("refused: %s (%d)", d.ErrorCode, d.ErrorStatus)
		}
		fmt.Fprintf(w, "%d\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%v\t%v\t%s\n", d.ID, d.Kind, d.RunID, listOr(d.Tenants),
			listOr(d.Features), d.EventName, d.Customer, hour, d.Formula, d.Expected, provider, diff, d.Explanation,
			d.UncertainItems, d.ConfirmedItems, resolvedText(d))
	}
	return w.Flush()
}

// recoverFlags are the flags of tally recover.
type recoverFlags struct {
	expect, to, reason string
	notReached         bool
	providerRef        string
	plan               string
}

// recoverCommand is tally recover ID or tally recover --plan FILE: an
// operator's decision about an uncertain item, or a reviewed plan of them.
func recoverCommand() command {
	f := &recoverFlags{}
	return command{name: "recover", flags: f.register, args: func(args []string) error {
		if len(args) > 1 {
			return errors.New("want one item id, or --plan FILE")
		}
		return nil
	}, run: f.run}
}

func (f *recoverFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.expect, "expect", "", "the item's state as you saw it: uncertain (required with an ID)")
	fs.StringVar(&f.to, "to", "", "accepted, pending or rejected (required with an ID)")
	fs.StringVar(&f.reason, "reason", "", "why (required to reject and with --not-reached)")
	fs.BoolVar(&f.notReached, "not-reached", false, "with --to pending: record that no attempt reached Stripe")
	fs.StringVar(&f.providerRef, "provider-ref", "", "with --to accepted: Stripe's evidence (optional)")
	fs.StringVar(&f.plan, "plan", "", "apply a reviewed plan file (from tally reconcile --plan-out or GET /v1/reconcile/runs/{id}/plan)")
}

func (f *recoverFlags) run(ctx context.Context, e *env, args []string) error {
	if f.plan != "" {
		if len(args) > 0 {
			return usageError{"give an item id or --plan, not both"}
		}
		return f.applyPlan(ctx, e)
	}
	if len(args) != 1 {
		return usageError{"want an item id (or --plan FILE)"}
	}
	id, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil || id < 1 {
		return usageError{"the item id must be a positive integer"}
	}
	if f.expect == "" || f.to == "" {
		return usageError{"--expect and --to are required"}
	}
	it, err := reconcile.Recover(ctx, e.db.Pool, e.parts.Outbox, id, reconcile.Recovery{
		Expect: outbox.State(f.expect), To: outbox.State(f.to), Reason: f.reason,
		NotReached: f.notReached, ProviderRef: f.providerRef, By: who()})
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "item %d: %s -> %s\n", id, f.expect, it.State)
	return nil
}

// applyPlan applies the plan in the --plan file and reports each recovery;
// it fails when any was refused.
func (f *recoverFlags) applyPlan(ctx context.Context, e *env) error {
	b, err := os.ReadFile(f.plan)
	if err != nil {
		return err
	}
	var p reconcile.Plan
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		return usageError{fmt.Sprintf("--plan %s: not a plan: %v", f.plan, err)}
	}
	results := reconcile.ApplyPlan(ctx, e.db.Pool, e.parts.Outbox, p, who())
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ITEM\tTO\tRESULT")
	failed := 0
	for _, r := range results {
		res := "applied"
		if !r.Applied {
			res, failed = "refused: "+r.Error, failed+1
		}
		fmt.Fprintf(w, "%d\t%s\t%s\n", r.Item, r.To, res)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d recoveries refused; the others were applied", failed, len(results))
	}
	return nil
}
