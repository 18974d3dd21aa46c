package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/tallymeter/tally/mappings"
)

// featureFlags are the flags of tally mappings features.
type featureFlags struct {
	eventName, aggregation, window string
	exporter                       string
}

// mappingsFeaturesCommand is tally mappings features list | get | set:
// which Stripe meter, aggregation and window each feature's usage goes to.
func mappingsFeaturesCommand() command {
	f := &featureFlags{}
	return command{name: "mappings features", flags: f.register, args: mappingArgs, run: f.run}
}

func (f *featureFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.eventName, "event-name", "", "set: the Stripe meter's event_name (the mapping takes that meter's payload keys, shown as customer_payload_key and value_payload_key)")
	fs.StringVar(&f.aggregation, "aggregation", "", "set: sum, last or count (the meter's formula)")
	fs.StringVar(&f.window, "window", "", "set: the window, dividing a day (default 1h)")
	f.registerExporter(fs)
}

// registerExporter makes --exporter of `mappings features set` the
// feature mapping's exporter, like --event-name and --aggregation are its
// other fields. The service's own --exporter (TALLY_EXPORTER, the node's
// default) is registered on this command's flags already and means nothing
// to it: it is taken over here, so that --exporter is never silently read as
// the node's setting while the mapping goes back to the default. The node's
// setting still comes from TALLY_EXPORTER in the environment.
func (f *featureFlags) registerExporter(fs *flag.FlagSet) {
	usage := "set: the exporter of the feature's items, " + strings.Join(mappings.Exporters, " or ") +
		" (default: none, the node's TALLY_EXPORTER)"
	set := func(v string) error { f.exporter = v; return nil }
	if fl := fs.Lookup("exporter"); fl != nil {
		fl.Value, fl.Usage, fl.DefValue = funcValue(set), usage, ""
		return
	}
	fs.Func("exporter", usage, set)
}

// funcValue is a flag.Value that hands what is set to a function.
type funcValue func(string) error

func (f funcValue) Set(v string) error { return f(v) }
func (f funcValue) String() string     { return "" }

func (f *featureFlags) run(ctx context.Context, e *env, args []string) error {
	m, pool := e.parts.Mappings, e.db.Pool
	switch args[0] {
	case "list":
		fs, err := m.Features(ctx, pool)
		if err != nil {
			return err
		}
		return printJSON(e.stdout, map[string]any{"features": fs})
	case "get":
		mf, err := m.GetFeature(ctx, pool, args[1])
		if err != nil {
			return err
		}
		hist, err := m.FeatureHistory(ctx, pool, args[1])
		if err != nil {
			return err
		}
		return printJSON(e.stdout, map[string]any{"mapping": mf, "history": hist})
	}
	in := mappings.FeatureInput{EventName: f.eventName, Aggregation: mappings.Aggregation(f.aggregation), Exporter: f.exporter}
	if f.window != "" {
		if err := in.Window.UnmarshalText([]byte(f.window)); err != nil {
			return usageError{"--window: " + err.Error()}
		}
	}
	mf, changed, err := m.PutFeature(ctx, pool, args[1], in, who())
	if err != nil {
		return mappingFailure(err)
	}
	return printSaved(e, mf, changed)
}

// tenantFlags are the flags of tally mappings tenants.
type tenantFlags struct {
	customer, anchor string
	invoiceGrace     string
	stripeAccount    string
}

// mappingsTenantsCommand is tally mappings tenants list | get | set: which
// Stripe customer each tenant is (in which connected account, if not the
// node's), and when its billing periods start.
func mappingsTenantsCommand() command {
	f := &tenantFlags{}
	return command{name: "mappings tenants", flags: f.register, args: mappingArgs, run: f.run}
}

func (f *tenantFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.customer, "customer", "", "set: the Stripe customer id (cus_…)")
	fs.StringVar(&f.anchor, "anchor", "", "set: the billing-period anchor, RFC 3339 (default: calendar months UTC)")
	f.registerInvoiceGrace(fs)
	f.registerStripeAccount(fs)
}

// registerStripeAccount makes --stripe-account of `mappings tenants set`
// the connected account the tenant mapping names, as registerInvoiceGrace
// does for --invoice-grace: the service's own --stripe-account
// (STRIPE_ACCOUNT, the node's destination) is taken over here, so that the
// mapping's field is never silently read as the node's setting, nor the
// node's as the mapping's. The node's setting still comes from
// STRIPE_ACCOUNT in the environment. Left out (or empty), the mapping
// names none: a set replaces the whole mapping, so setting a tenant again
// without it goes back to the node's destination.
func (f *tenantFlags) registerStripeAccount(fs *flag.FlagSet) {
	usage := "set: the Stripe Connect connected account (acct_…) the tenant's usage is exported to, whose customer --customer is (default: none, the node's destination: STRIPE_ACCOUNT or the key's own account)"
	set := func(v string) error { f.stripeAccount = v; return nil }
	if fl := fs.Lookup("stripe-account"); fl != nil {
		fl.Value, fl.Usage, fl.DefValue = funcValue(set), usage, ""
		return
	}
	fs.Func("stripe-account", usage, set)
}

// registerInvoiceGrace makes --invoice-grace of `mappings tenants set` the
// tenant mapping's invoice grace, like --anchor is its anchor. The
// service's own --invoice-grace (TALLY_INVOICE_GRACE, the node's default)
// is taken over here when it is registered on this command's flags, as
// registerExporter takes over --exporter: the mapping's field is never
// silently read as the node's setting. The node's setting still comes from
// TALLY_INVOICE_GRACE in the environment.
func (f *tenantFlags) registerInvoiceGrace(fs *flag.FlagSet) {
	usage := "set: the tenant's invoice finalization grace period, a duration from 0s to 72h, e.g. 2h (default: none, the node's TALLY_INVOICE_GRACE)"
	set := func(v string) error { f.invoiceGrace = v; return nil }
	if fl := fs.Lookup("invoice-grace"); fl != nil {
		fl.Value, fl.Usage, fl.DefValue = funcValue(set), usage, ""
		return
	}
	fs.Func("invoice-grace", usage, set)
}

func (f *tenantFlags) run(ctx context.Context, e *env, args []string) error {
	m, pool := e.parts.Mappings, e.db.Pool
	switch args[0] {
	case "list":
		ts, err := m.Tenants(ctx, pool)
		if err != nil {
			return err
		}
		return printJSON(e.stdout, map[string]any{"tenants": ts})
	case "get":
		t, err := m.GetTenant(ctx, pool, args[1])
		if err != nil {
			return err
		}
		hist, err := m.TenantHistory(ctx, pool, args[1])
		if err != nil {
			return err
		}
		return printJSON(e.stdout, map[string]any{"mapping": t, "history": hist})
	}
	in := mappings.TenantInput{StripeCustomerID: f.customer, StripeAccount: f.stripeAccount}
	if f.anchor != "" {
		a, err := time.Parse(time.RFC3339, f.anchor)
		if err != nil {
			return usageError{"--anchor: want RFC 3339, e.g. 2026-01-15T00:00:00Z"}
		}
		in.PeriodAnchor = &a
	}
	if f.invoiceGrace != "" {
		g, err := time.ParseDuration(f.invoiceGrace)
		if err != nil {
			return usageError{"--invoice-grace: want a duration from 0s to 72h, e.g. 2h or 90m"}
		}
		grace := mappings.Duration(g)
		in.InvoiceGrace = &grace
	}
	t, changed, err := m.PutTenant(ctx, pool, args[1], in, who())
	if err != nil {
		return mappingFailure(err)
	}
	return printSaved(e, t, changed)
}

// mappingArgs checks the action of a mappings command and its name.
func mappingArgs(args []string) error {
	if len(args) == 0 {
		return errors.New("want list, get NAME or set NAME")
	}
	switch args[0] {
	case "list":
		if len(args) != 1 {
			return errors.New("list takes no name")
		}
	case "get", "set":
		if len(args) != 2 {
			return fmt.Errorf("%s needs one name", args[0])
		}
	default:
		return fmt.Errorf("unknown action %q: want list, get or set", args[0])
	}
	return nil
}

// mappingFailure reports a mapping the mappings package refused by its
// code and message, as the API and the console do: "customer_not_found:
// Stripe has no customer …". Malformed input is a mistake in how the
// command was called (exit status 2); the other refusals are failures (1).
// Any other error (the database's) is returned as it is.
func mappingFailure(err error) error {
	refusal, ok := mappings.RefusalOf(err)
	if !ok {
		return err
	}
	msg := refusal.Code + ": " + refusal.Message
	if refusal.Code == mappings.CodeInvalidMapping {
		return usageError{msg}
	}
	return errors.New(msg)
}

// printSaved prints a saved mapping, and on stderr the warning of one saved
// without checking Stripe (no key: see mappings.UncheckedWarning), which the
// JSON carries too.
func printSaved(e *env, mapping any, changed bool) error {
	out := map[string]any{"mapping": mapping, "changed": changed}
	if w := e.parts.Mappings.Warning(); w != "" {
		out["warning"] = w
		fmt.Fprintf(e.stderr, "warning: %s\n", w)
	}
	return printJSON(e.stdout, out)
}
