package exporter

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// StallReason says why export is stalled: the reason label of
// tally_export_stalled.
type StallReason string

// The reasons export stalls. The first three are this node's (its Resolver
// knows them, and /readyz fails on them); retrying is the outbox's, the
// same on every node.
const (
	// StallNoKey: STRIPE_API_KEY is unset; nothing is staged.
	StallNoKey StallReason = "no_key"
	// StallKeyRefused: Stripe refused the key (401 or 403) on a delivery,
	// until one is accepted again, or on the account lookup.
	StallKeyRefused StallReason = "key_refused"
	// StallStripeUnreachable: the account lookup got no answer (or a 5xx),
	// or UnreachableAfter calls in a row to Stripe from this node did.
	StallStripeUnreachable StallReason = "stripe_unreachable"
	// StallRetrying: an outbox item has kept failing for
	// DefaultRetryingAfter since its first attempt.
	StallRetrying StallReason = "retrying"
	// StallAccountRefused: Stripe refused this node's key access to one or
	// more connected accounts (Connect): their items wait, the others
	// export; /readyz does not fail on it (Connected.Stalled names them).
	StallAccountRefused StallReason = "account_refused"
	// StallMeterDeactivated: every meter of an event name that items are
	// staged for is deactivated in its account: those items wait, the
	// others export; /readyz reports it as degraded (Stalls.Meters names
	// them).
	StallMeterDeactivated StallReason = "meter_deactivated"
)

// StallReasons lists every reason, in the order they are reported.
func StallReasons() []StallReason {
	return []StallReason{StallNoKey, StallKeyRefused, StallStripeUnreachable, StallRetrying, StallAccountRefused, StallMeterDeactivated}
}

// Explain says what a reason means, in words fit for the console's banner:
// no key, account, customer or provider text.
func (s StallReason) Explain() string {
	switch s {
	case StallNoKey:
		return "STRIPE_API_KEY is unset on this node: nothing is staged; usage waits in the ledger."
	case StallKeyRefused:
		return "Stripe refused this node's API key (401 or 403): deliveries are retried with backoff until a new key is deployed."
	case StallStripeUnreachable:
		return "Stripe does not answer this node's calls (no answer, or a 5xx): deliveries are retried with backoff."
	case StallRetrying:
		return "Outbox items have kept failing for minutes since their first attempt: Stripe answers, but not with success."
	case StallAccountRefused:
		return "Stripe refused this platform's access to a connected account: that account's items wait pending, every other account's export."
	case StallMeterDeactivated:
		return "A meter is deactivated in Stripe and no active meter has its event name: that event name's items wait pending until a meter of the name is active again."
	}
	return string(s)
}

// DefaultRetryingAfter is how long an outbox item may keep failing, from
// its first attempt, before export counts as stalled for sustained
// retries: about seven attempts at the outbox's default backoff (5 s,
// doubling).
const DefaultRetryingAfter = 10 * time.Minute

// UnreachableAfter is how many calls in a row from this node to Stripe may
// get no answer (or a 5xx) before it counts Stripe as unreachable; any
// other answer, a refusal included, resets the count.
const UnreachableAfter = 3

// errUnreachable is Ready's error while Stripe does not answer.
var errUnreachable = errors.New("export stalled: Stripe has not answered this node's last calls (no answer, or a 5xx)")

// reachability counts this node's calls to Stripe that got no answer in a
// row. Its transport (reachTransport) sits under the Stripe client of the
// Resolver, which the deliverers and the account lookup use.
type reachability struct {
	mu     sync.Mutex
	failed int // calls in a row with no answer or a 5xx, since the last answer
}

func (r *reachability) observe(answered bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if answered {
		r.failed = 0
		return
	}
	r.failed++
}

// down reports whether the last UnreachableAfter calls got no answer.
func (r *reachability) down() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failed >= UnreachableAfter
}

// client is hc (nil: stripeapi's default client with timeout) with its
// transport observed.
func (r *reachability) client(hc *http.Client, timeout time.Duration) *http.Client {
	if hc == nil {
		hc = stripeapi.DefaultHTTPClient(timeout)
	}
	observed := *hc
	observed.Transport = reachTransport{base: hc.Transport, reach: r}
	return &observed
}

// reachTransport tells reachability whether each call got an answer.
type reachTransport struct {
	base  http.RoundTripper
	reach *reachability
}

func (t reachTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := t.base
	if base == nil {
		base = stripeapi.Transport()
	}
	resp, err := base.RoundTrip(req)
	switch {
	case err != nil && errors.Is(req.Context().Err(), context.Canceled):
		// The caller gave up (a shutdown): that says nothing about Stripe.
	case err != nil:
		t.reach.observe(false)
	default:
		t.reach.observe(resp.StatusCode < 500)
	}
	return resp, err
}

// Stall is why this node cannot export, "" when it can: no key, a key
// Stripe refused (on a delivery, or the account lookup), or Stripe not
// answering (the account lookup, or this node's last calls).
func (r *Resolver) Stall() StallReason {
	if r.client == nil {
		return StallNoKey
	}
	r.mu.Lock()
	keyRefused := r.keyErr != nil
	lookupFailed := r.resolved == nil && r.lastErr != nil
	status := r.lookupStatus
	r.mu.Unlock()
	switch {
	case keyRefused, lookupFailed && (status == http.StatusUnauthorized || status == http.StatusForbidden):
		return StallKeyRefused
	case lookupFailed, r.reach.down():
		return StallStripeUnreachable
	}
	return ""
}

// Ready is /readyz's export check: nil when this node can export. It is
// Check, failing also while Stripe does not answer this node's calls.
func (r *Resolver) Ready(ctx context.Context) error {
	if err := r.Check(ctx); err != nil {
		return err
	}
	if r.reach.down() {
		return errUnreachable
	}
	return nil
}

// Stalls reads why export is stalled: this node's reason (Resolver.Stall)
// and the outbox's sustained retries (any node's). It is the collector of
// tally_export_stalled{reason} and what the console's banner says.
type Stalls struct {
	resolver *Resolver
	outbox   *outbox.Store
	db       pgdb.Querier
	// retryingAfter is how long an item fails before retrying counts.
	retryingAfter time.Duration
	desc          *prometheus.Desc
	// meters, when set, names the paused event names.
	meters *MeterDirectory
}

// WithMeters makes s report the event names whose meters are all
// deactivated (StallMeterDeactivated), from m; it returns s.
func (s *Stalls) WithMeters(m *MeterDirectory) *Stalls {
	s.meters = m
	return s
}

// Meters lists the event names of this node's mode whose meters are all
// deactivated (the detail of meter_deactivated); none without a directory
// or a destination.
func (s *Stalls) Meters(ctx context.Context) ([]PausedMeter, error) {
	if s.meters == nil {
		return nil, nil
	}
	dest, err := s.resolver.Destination()
	if err != nil {
		return nil, nil
	}
	all, err := s.meters.Paused(ctx, s.db)
	if err != nil {
		return nil, err
	}
	out := all[:0]
	for _, p := range all {
		if p.Mode == string(dest.Mode) {
			out = append(out, p)
		}
	}
	return out, nil
}

// NewStalls reads r, and the outbox ob through db; retryingAfter (0:
// DefaultRetryingAfter) is how long an item may keep failing before export
// counts as stalled for sustained retries.
func NewStalls(r *Resolver, ob *outbox.Store, db pgdb.Querier, retryingAfter time.Duration) *Stalls {
	if retryingAfter <= 0 {
		retryingAfter = DefaultRetryingAfter
	}
	return &Stalls{resolver: r, outbox: ob, db: db, retryingAfter: retryingAfter, desc: prometheus.NewDesc("tally_export_stalled",
		fmt.Sprintf("1 while export is stalled for the reason, else 0: no_key, key_refused, stripe_unreachable (this node's), retrying (an outbox item failing for over %s since its first attempt, any node's), account_refused (a connected account Stripe refused this node's key, its items only), meter_deactivated (an event name whose meters are all deactivated, its items only).", retryingAfter),
		[]string{"reason"}, nil)}
}

// Reasons are why export is stalled now, in StallReasons' order; none when
// it is not. When the outbox cannot be read, retrying is left out and the
// error returned with the rest.
func (s *Stalls) Reasons(ctx context.Context) ([]StallReason, error) {
	var out []StallReason
	if r := s.resolver.Stall(); r != "" {
		out = append(out, r)
	}
	age, retrying, err := s.outbox.OldestRetrying(ctx, s.db)
	if retrying && age >= s.retryingAfter {
		out = append(out, StallRetrying)
	}
	if c := s.resolver.Connected(); c != nil && len(c.Skip()) > 0 {
		out = append(out, StallAccountRefused)
	}
	paused, merr := s.Meters(ctx)
	if len(paused) > 0 {
		out = append(out, StallMeterDeactivated)
	}
	return out, errors.Join(err, merr)
}

// Connected lists the connected accounts Stripe refused this node's key
// (the detail of account_refused); none without a key.
func (s *Stalls) Connected() []AccountStall {
	if c := s.resolver.Connected(); c != nil {
		return c.Stalled()
	}
	return nil
}

func (s *Stalls) Describe(ch chan<- *prometheus.Desc) { ch <- s.desc }

// Collect reports every reason, 1 or 0. When the database cannot be read
// the retrying and meter_deactivated series are absent meanwhile (the
// database's health is /readyz's).
func (s *Stalls) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	reasons, err := s.Reasons(ctx)
	for _, r := range StallReasons() {
		if (r == StallRetrying || r == StallMeterDeactivated) && err != nil {
			continue // unread: absent rather than a false 0
		}
		v := 0.0
		for _, got := range reasons {
			if got == r {
				v = 1
			}
		}
		ch <- prometheus.MustNewConstMetric(s.desc, prometheus.GaugeValue, v, string(r))
	}
}
