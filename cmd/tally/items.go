package main

import (
	"context"
	"flag"
	"fmt"
	"slices"
	"text/tabwriter"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/outbox"
)

// itemsListFlags are the flags of tally items list: the filters of GET
// /v1/outbox/items.
type itemsListFlags struct {
	state, tenant, feature, format string
	limit                          int
	after                          int64
}

// itemsListCommand is tally items list: outbox items in id order, a page
// at a time, read through the outbox.
func itemsListCommand() command {
	f := &itemsListFlags{}
	return command{name: "items list", flags: f.register, run: f.run}
}

func (f *itemsListFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.state, "state", "", "only items in this state")
	fs.StringVar(&f.tenant, "tenant", "", "only this tenant's items")
	fs.StringVar(&f.feature, "feature", "", "only this feature's items")
	fs.IntVar(&f.limit, "limit", 100, "the page size, 1 to 1000")
	fs.Int64Var(&f.after, "after", 0, "items after this id (the last of the page before)")
	fs.StringVar(&f.format, "format", "table", "table or json")
}

func (f *itemsListFlags) run(ctx context.Context, e *env, _ []string) error {
	filter := outbox.ListFilter{State: outbox.State(f.state), Tenant: f.tenant, Feature: f.feature, After: f.after, Limit: f.limit}
	switch {
	case f.state != "" && !slices.Contains(outbox.States, filter.State):
		return usageError{fmt.Sprintf("--state must be one of %v", outbox.States)}
	case f.limit < 1 || f.limit > 1000:
		return usageError{"--limit must be 1 to 1000"}
	case f.after < 0:
		return usageError{"--after must be an item id"}
	case f.format != "table" && f.format != "json":
		return usageError{"--format must be table or json"}
	}
	items, err := e.parts.Outbox.List(ctx, e.db.Pool, filter)
	if err != nil {
		return err
	}
	if len(items) == f.limit {
		defer fmt.Fprintf(e.stderr, "more items may match: run again with --after %d\n", items[len(items)-1].ID)
	}
	if f.format == "json" {
		out := make([]api.ItemView, len(items))
		for i, it := range items {
			out[i] = api.ViewOf(it)
		}
		return printJSON(e.stdout, map[string]any{"items": out})
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTATE\tTENANT\tFEATURE\tPERIOD\tVALUE\tREASON\tATTEMPTS\tLAST ERROR")
	for _, it := range items {
		lastError := ""
		if e := it.CurrentError(); e != nil {
			lastError = e.Code
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%d\t%s\t%d\t%s\n", it.ID, it.State, it.TenantKey, it.Payload.Feature, it.Payload.Period,
			it.Payload.Value, it.QuarantineReason, it.Attempts, lastError)
	}
	return tw.Flush()
}
