package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strconv"

	"github.com/tallymeter/tally/quarantine"
)

// quarantineFlags are the flags of tally quarantine.
type quarantineFlags struct {
	format, reason, tenant, feature, period string
}

// quarantineCommand is tally quarantine: the quarantine report.
func quarantineCommand() command {
	f := &quarantineFlags{}
	return command{name: "quarantine", flags: f.register, run: f.run}
}

func (f *quarantineFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.format, "format", "table", "table, csv or json")
	fs.StringVar(&f.reason, "reason", "", "only this quarantine reason")
	fs.StringVar(&f.tenant, "tenant", "", "only this tenant")
	fs.StringVar(&f.feature, "feature", "", "only this feature")
	fs.StringVar(&f.period, "period", "", "only billing periods starting in this month (YYYY-MM)")
}

func (f *quarantineFlags) run(ctx context.Context, e *env, _ []string) error {
	if f.period != "" {
		if _, _, err := quarantine.ParsePeriod(f.period); err != nil {
			return usageError{err.Error()}
		}
	}
	rep, err := quarantine.Quarantined(ctx, e.db.Pool, quarantine.Filter{Reason: f.reason, Tenant: f.tenant, Feature: f.feature, Period: f.period})
	if err != nil {
		return err
	}
	switch f.format {
	case "table":
		return rep.Table(e.stdout)
	case "csv":
		return rep.CSV(e.stdout)
	case "json":
		return printJSON(e.stdout, rep)
	}
	return usageError{"--format must be table, csv or json"}
}

// requeueFlags are the flags of tally requeue.
type requeueFlags struct {
	mappingVersion     int
	acceptPeriodClosed bool
}

// requeueCommand is tally requeue ID: a quarantined item back to export,
// under its tenant's and feature's current mapping.
func requeueCommand() command {
	f := &requeueFlags{}
	return command{name: "requeue", flags: f.register, args: exactly(1, "an item id"), run: f.run}
}

func (f *requeueFlags) register(fs *flag.FlagSet) {
	fs.IntVar(&f.mappingVersion, "mapping-version", -1, "the current mapping version of the item's tenant and feature (required)")
	fs.BoolVar(&f.acceptPeriodClosed, acceptPeriodClosedFlag, false,
		"send usage whose billing period's invoice has closed (period_closed), knowingly: Stripe bills it on no finalized invoice")
}

// acceptPeriodClosedFlag names the flag, shared by both forms of tally
// requeue, that sends late usage knowingly.
const acceptPeriodClosedFlag = "accept-period-closed"

func (f *requeueFlags) run(ctx context.Context, e *env, args []string) error {
	id, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil || id < 1 {
		return usageError{"the item id must be a positive number"}
	}
	if f.mappingVersion < 0 {
		return usageError{"--mapping-version is required: the current mapping version of the item's tenant and feature"}
	}
	res, err := e.parts.Requeuer.RequeueWith(ctx, e.db.Pool, id, f.mappingVersion, who(),
		quarantine.RequeueOptions{AcceptPeriodClosed: f.acceptPeriodClosed})
	if err != nil {
		return err
	}
	return printJSON(e.stdout, res)
}

// completenessFlags are the flags of tally report completeness.
type completenessFlags struct {
	period, tenant, format string
	verify, repair         bool
}

// completenessCommand is tally report completeness: the usage of a month's
// billing periods by the state of the items that carry it; it fails when
// the conservation identity does not hold.
func completenessCommand() command {
	f := &completenessFlags{}
	return command{name: "report completeness", flags: f.register, run: f.run}
}

func (f *completenessFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.period, "period", "", "billing periods starting in this month, YYYY-MM (required)")
	fs.StringVar(&f.tenant, "tenant", "", "only this tenant")
	fs.StringVar(&f.format, "format", "table", "table or json")
	fs.BoolVar(&f.verify, "verify", false,
		"recompute the month from the ledger, compare it with the counters bucket by bucket, print every key that differs and record the audit")
	fs.BoolVar(&f.repair, "repair", false,
		"rewrite the month's counters from the ledger (holds ingest meanwhile), audited; only after --verify named the drift")
}

func (f *completenessFlags) run(ctx context.Context, e *env, _ []string) error {
	if _, _, err := quarantine.ParsePeriod(f.period); err != nil {
		return usageError{"--period is required, as YYYY-MM"}
	}
	if f.verify || f.repair {
		return f.audit(ctx, e)
	}
	// The command computes now (a refresh): it waits for a computation of
	// the month a node runs, and leaves its snapshot for the nodes.
	reports, err := quarantine.NewReports(0, nil)
	if err != nil {
		return err
	}
	c, err := reports.Completeness(ctx, e.db.Pool, f.period, f.tenant, true)
	if err != nil {
		return err
	}
	switch f.format {
	case "table":
		if err := c.Table(e.stdout); err != nil {
			return err
		}
	case "json":
		if err := printJSON(e.stdout, c); err != nil {
			return err
		}
	default:
		return usageError{"--format must be table or json"}
	}
	if !c.Holds {
		return errors.New("the conservation identity does not hold for every line")
	}
	return nil
}

// audit is --verify and --repair: the month, every tenant, compared with
// the full computation; with --repair rewritten from it first.
func (f *completenessFlags) audit(ctx context.Context, e *env) error {
	switch {
	case f.verify && f.repair:
		return usageError{"--verify and --repair are separate steps: read the drift with --verify, then --repair"}
	case f.tenant != "":
		return usageError{"--verify and --repair audit every tenant of the month; drop --tenant"}
	case f.format != "table" && f.format != "json":
		return usageError{"--format must be table or json"}
	}
	var (
		a   quarantine.Audit
		err error
	)
	if f.repair {
		a, err = quarantine.RepairCompleteness(ctx, e.db.Pool, f.period, who(), quarantine.DefaultAuditTimeout)
	} else {
		a, err = quarantine.AuditCompleteness(ctx, e.db.Pool, f.period, quarantine.AuditVerify, quarantine.DefaultAuditTimeout)
		if err == nil {
			err = quarantine.RecordAudit(ctx, e.db.Pool, &a, who())
		}
	}
	if err != nil {
		return err
	}
	if f.format == "json" {
		if err := printJSON(e.stdout, a); err != nil {
			return err
		}
	} else if err := a.Table(e.stdout); err != nil {
		return err
	}
	switch {
	case f.repair:
		return nil
	case a.DriftKeys > 0:
		return fmt.Errorf("%d keys of %s differ between the counters and the ledger (audit %d)", a.DriftKeys, f.period, a.ID)
	}
	return nil
}
