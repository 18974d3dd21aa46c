package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/tallymeter/tally/internal/stripesim"
)

// devWebhookSecret signs the simulator's events in tally dev.
const devWebhookSecret = "whsec_tally_dev_simulator"

// stripeSimFlags are the flags of tally stripe-sim.
type stripeSimFlags struct {
	listen, key, account      string
	meters, customers         stringList
	limits                    stripesim.Limits
	webhookURL, webhookSecret string
}

// stripeSimCommand is tally stripe-sim: the built-in Stripe simulator on its
// own, with the meters, customers, limits and faults asked for.
func stripeSimCommand() command {
	f := &stripeSimFlags{}
	return command{name: "stripe-sim", noDB: true, flags: f.register, run: f.run}
}

func (f *stripeSimFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.listen, "sim-listen", "127.0.0.1:12111", "the simulator's HTTP address")
	fs.StringVar(&f.key, "sim-key", stripesim.DefaultKey, "the API key it accepts")
	fs.StringVar(&f.account, "sim-account", stripesim.DefaultAccount, "the account of that key")
	fs.Var(&f.meters, "meter", "create a meter at start, as EVENT_NAME:FORMULA (sum, count or last; repeatable)")
	fs.Var(&f.customers, "customer", "create a customer at start, by id (cus_…; repeatable)")
	fs.Float64Var(&f.limits.RatePerSecond, "rate", 0, "v1 meter-event calls a second before 429 (0: no limit)")
	fs.Float64Var(&f.limits.StreamRatePerSecond, "stream-rate", 0, "v2 meter event stream requests a second before 429 (0: no limit)")
	fs.BoolVar(&f.limits.OneCallPerCustomerMeter, "one-call-per-key", true, "answer 429 to a second concurrent call for one customer and meter, as Stripe does")
	fs.Float64Var(&f.limits.BasicRatePerSecond, "basic-rate", 0, "calls a second, every kind together, before 429: Stripe's basic limit (0: no limit)")
	fs.Float64Var(&f.limits.EndpointRatePerSecond, "endpoint-rate", 0, "calls a second per endpoint before 429, meter events aside (Stripe: 25; 0: no limit)")
	fs.BoolVar(&f.limits.AsyncValidation, "async-validation", false, "v1 answers 200 to an event that fails validation Stripe may make later (unknown customer, …) and reports it")
	registerFaults(fs, &f.limits.Faults)
	fs.StringVar(&f.webhookURL, "webhook-url", "", "post meter error reports as signed thin events here (e.g. http://127.0.0.1:8080/v1/stripe/events)")
	fs.StringVar(&f.webhookSecret, "webhook-secret", devWebhookSecret, "the signing secret of those events (Tally's STRIPE_WEBHOOK_SECRET)")
}

// registerFaults registers the simulator's fault switches on fs, into
// faults: tally stripe-sim's flags, and the names tally dev's --sim-fault
// takes.
func registerFaults(fs *flag.FlagSet, faults *stripesim.Faults) {
	fs.Float64Var(&faults.FailBeforeRecord, "fail-before-record", 0, "probability of a 500 before recording (kept for its Idempotency-Key)")
	fs.Float64Var(&faults.FailAfterRecord, "fail-after-record", 0, "probability of recording, then answering 500 (kept for its Idempotency-Key)")
	fs.Float64Var(&faults.LoseReply, "lose-reply", 0, "probability of recording, then answering 502 (a lost reply)")
	fs.Float64Var(&faults.RateLimitFault, "rate-limit-fault", 0, "probability of a 429 without recording")
	fs.Float64Var(&faults.Hang, "hang", 0, "probability of not answering until the client gives up")
	fs.Float64Var(&faults.AsyncDrop, "async-drop", 0, "probability of answering 200 and dropping the event later")
	fs.DurationVar(&faults.Latency, "latency", 0, "added latency of every meter-event call and stream request")
	fs.Float64Var(&faults.ReadFault, "read-fault", 0, "probability of a 500 or 429 to a read (meters, summaries)")
}

// simFaults is tally dev's --sim-fault: the simulator's fault switches, as
// NAME=VALUE with the names of tally stripe-sim's fault flags.
type simFaults struct {
	faults stripesim.Faults
	fs     *flag.FlagSet
	given  bool
}

func (s *simFaults) switches() *flag.FlagSet {
	if s.fs == nil {
		s.fs = flag.NewFlagSet("sim-fault", flag.ContinueOnError)
		registerFaults(s.fs, &s.faults)
	}
	return s.fs
}

// names lists the fault switches, for the flag's usage and its errors.
func (s *simFaults) names() string {
	var names []string
	s.switches().VisitAll(func(fl *flag.Flag) { names = append(names, fl.Name) })
	return strings.Join(names, ", ")
}

func (s *simFaults) String() string { return "" }

// Set sets one switch from NAME=VALUE.
func (s *simFaults) Set(v string) error {
	name, value, ok := strings.Cut(v, "=")
	if !ok {
		return fmt.Errorf("want NAME=VALUE, NAME one of %s", s.names())
	}
	if s.switches().Lookup(name) == nil {
		return fmt.Errorf("no fault %q: the faults are %s", name, s.names())
	}
	if err := s.switches().Set(name, value); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	s.given = true
	return nil
}

// run serves the simulator until ctx is done.
func (f *stripeSimFlags) run(ctx context.Context, e *env, _ []string) error {
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{f.key: f.account}, Limits: f.limits})
	defer sim.Close()
	if err := f.populate(sim); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: sim.Handler(), ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintf(e.stdout, "Stripe simulator on http://%s\nUse: STRIPE_API_BASE=http://%s STRIPE_METER_EVENTS_BASE=http://%s STRIPE_API_KEY=%s\nRecorded events: http://%s/_sim/events\n",
		ln.Addr(), ln.Addr(), ln.Addr(), f.key, ln.Addr())
	if f.webhookURL != "" {
		stop := make(chan struct{})
		defer close(stop)
		go deliverReports(sim, f.account, f.webhookURL, f.webhookSecret, stop)
		fmt.Fprintf(e.stdout, "Meter error reports: posted to %s (STRIPE_WEBHOOK_SECRET=%s)\n", f.webhookURL, f.webhookSecret)
	}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// populate creates the customers and meters of --customer and --meter.
func (f *stripeSimFlags) populate(sim *stripesim.Server) error {
	for _, c := range f.customers {
		sim.CreateCustomer(f.account, c)
	}
	for _, m := range f.meters {
		event, formula, ok := strings.Cut(m, ":")
		if !ok || event == "" {
			return usageError{fmt.Sprintf("--meter %q: want EVENT_NAME:FORMULA", m)}
		}
		switch formula {
		case "sum", "count", "last":
		default:
			return usageError{fmt.Sprintf("--meter %q: the formula is sum, count or last", m)}
		}
		sim.CreateMeter(f.account, stripesim.MeterSpec{DisplayName: event, EventName: event, Formula: formula})
	}
	return nil
}

// deliverReports posts the simulator's meter error reports to url every
// few seconds until stop is closed; a delivery that fails is tried again
// on the next round, as Stripe retries.
func deliverReports(sim *stripesim.Server, account, url, secret string, stop <-chan struct{}) {
	t := time.NewTicker(3 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, _ = sim.DeliverReports(ctx, account, url, secret)
			cancel()
		}
	}
}
