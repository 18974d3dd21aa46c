package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/tallymeter/tally/quarantine"
)

// requeueMatchingFlags are the flags of tally requeue without an item id:
// the quarantine report's filters, a page, a dry run, the format and
// whether a dry run lists its items.
type requeueMatchingFlags struct {
	reason, tenant, feature, period, format string
	after                                   int64
	limit                                   int
	dryRun, all, list                       bool
	// fs is the command's flag set, to tell which flags were given.
	fs *flag.FlagSet
}

// matchingFlagNames are the flags that only the form without an item id
// takes.
var matchingFlagNames = []string{"reason", "tenant", "feature", "period", "after", "limit", "dry-run", "all", "format", "list"}

// requeueMatchingCommand is tally requeue: with an item id, that one
// quarantined item under the mapping version given (requeueCommand); with
// none, every quarantined item the filters match, under the current
// mappings — the same requeue as POST /v1/quarantine/requeue.
func requeueMatchingCommand() command {
	one := requeueCommand()
	f := &requeueMatchingFlags{}
	return command{name: "requeue",
		flags: func(fs *flag.FlagSet) { one.flags(fs); f.register(fs) },
		args: func(args []string) error {
			if len(args) > 1 {
				return errors.New("want one item id, or none and filters (--reason, --tenant, --feature, --period, or --all)")
			}
			return nil
		},
		run: func(ctx context.Context, e *env, args []string) error {
			if len(args) == 1 {
				if name := f.given(matchingFlagNames...); name != "" {
					return usageError{"--" + name + " requeues every matching item: give it without an item id"}
				}
				return one.run(ctx, e, args)
			}
			return f.run(ctx, e)
		},
	}
}

func (f *requeueMatchingFlags) register(fs *flag.FlagSet) {
	f.fs = fs
	fs.StringVar(&f.reason, "reason", "", "without an item id: only items quarantined for this reason")
	fs.StringVar(&f.tenant, "tenant", "", "without an item id: only this tenant's items")
	fs.StringVar(&f.feature, "feature", "", "without an item id: only this feature's items")
	fs.StringVar(&f.period, "period", "", "without an item id: only billing periods starting in this month (YYYY-MM)")
	fs.BoolVar(&f.all, "all", false, "without an item id and filters: every quarantined item")
	fs.BoolVar(&f.dryRun, "dry-run", false, "say what the requeue would do; change nothing")
	fs.BoolVar(&f.list, "list", false, "with --dry-run and the table format: list each item before the totals (default: the totals only)")
	fs.Int64Var(&f.after, "after", 0, "continue after this item id (the next_after of the run before)")
	fs.IntVar(&f.limit, "limit", quarantine.DefaultBulkLimit, fmt.Sprintf("the most items one run takes, 1 to %d", quarantine.MaxBulkLimit))
	fs.StringVar(&f.format, "format", "table", "table or json")
}

// given is the first of names that was set on the command line, or "".
func (f *requeueMatchingFlags) given(names ...string) string {
	set := ""
	f.fs.Visit(func(fl *flag.Flag) {
		for _, n := range names {
			if fl.Name == n && set == "" {
				set = n
			}
		}
	})
	return set
}

func (f *requeueMatchingFlags) run(ctx context.Context, e *env) error {
	filter := quarantine.Filter{Reason: f.reason, Tenant: f.tenant, Feature: f.feature, Period: f.period}
	switch {
	case f.given("mapping-version") != "":
		return usageError{"--mapping-version goes with an item id; without one each item is requeued under its current mapping version"}
	case filter == (quarantine.Filter{}) && !f.all:
		return usageError{"give an item id, or filters (--reason, --tenant, --feature, --period), or --all for every quarantined item"}
	case f.format != "table" && f.format != "json":
		return usageError{"--format must be table or json"}
	case f.limit < 1 || f.limit > quarantine.MaxBulkLimit:
		return usageError{fmt.Sprintf("--limit must be 1 to %d", quarantine.MaxBulkLimit)}
	case f.after < 0:
		return usageError{"--after must be an item id"}
	}
	if f.period != "" {
		if _, _, err := quarantine.ParsePeriod(f.period); err != nil {
			return usageError{err.Error()}
		}
	}
	// The flag is registered by the one-item form (requeueFlags), whose
	// flag set this is too.
	accept := f.fs.Lookup(acceptPeriodClosedFlag).Value.(flag.Getter).Get().(bool)
	res, err := e.parts.Requeuer.RequeueMatching(ctx, e.db.Pool, quarantine.BulkRequest{Filter: filter, After: f.after,
		Limit: f.limit, DryRun: f.dryRun, By: who(), Options: quarantine.RequeueOptions{AcceptPeriodClosed: accept}})
	if err != nil {
		return err
	}
	if f.format == "json" {
		err = printJSON(e.stdout, res)
	} else {
		err = bulkTable(e.stdout, res, !res.DryRun || f.list)
	}
	if err != nil {
		return err
	}
	if res.NextAfter != nil {
		fmt.Fprintf(e.stderr, "more items may match: run again with --after %d\n", *res.NextAfter)
	}
	if !res.DryRun && res.Totals.Refused > 0 {
		return fmt.Errorf("%d of %d items refused", res.Totals.Refused, len(res.Items))
	}
	return nil
}

// bulkTable writes a bulk requeue's totals for a terminal, after its
// items if list is set: a run lists what it did, a dry run only counts
// unless asked, since its lines would bury the totals.
func bulkTable(w io.Writer, res quarantine.BulkResult, list bool) error {
	if !list {
		return bulkTotals(w, res)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ITEM\tACTION\tREFUSAL\tMAPPING VERSION\tSUCCESSOR")
	for _, it := range res.Items {
		successor := ""
		if it.Successor != nil {
			successor = strconv.FormatInt(*it.Successor, 10)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%s\n", it.ItemID, it.Action, it.Refusal, it.MappingVersion, successor)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	return bulkTotals(w, res)
}

// bulkTotals writes a bulk requeue's totals on one line.
func bulkTotals(w io.Writer, res quarantine.BulkResult) error {
	t := res.Totals
	fmt.Fprintf(w, "requeued %d, readdressed %d, refused %d", t.Requeued, t.Readdressed, t.Refused)
	for code, n := range t.RefusedBy {
		fmt.Fprintf(w, " (%s %d)", code, n)
	}
	if res.DryRun {
		fmt.Fprint(w, " — dry run: nothing changed")
	}
	_, err := fmt.Fprintln(w)
	return err
}
