package exporter

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Exporter names, part of every item's identity.
const (
	// StripeMeterEvents is the v1 exporter: POST /v1/billing/meter_events.
	StripeMeterEvents = "stripe_meter_events"
	// StripeMeterEventStream is the v2 exporter: POST
	// /v2/billing/meter_event_stream, in batches.
	StripeMeterEventStream = "stripe_meter_event_stream"
	// StripeMeterEventAdjustments is the exporter of cancellations: POST
	// /v1/billing/meter_event_adjustments, on a deliverer and a class of
	// the budget of its own (StripeAdjustments). Never a node's or a
	// feature's exporter: cancellation items are staged for it whichever
	// exporter sent the event.
	StripeMeterEventAdjustments = "stripe_meter_event_adjustments"
)

// What Stripe's v1 meter events accept.
const (
	// StripeDedupWindow is how long Stripe deduplicates meter-event
	// identifiers (at least 24 hours).
	StripeDedupWindow = 24 * time.Hour
	// StripeAcceptPast and StripeAcceptFuture bound a meter event's
	// timestamp: within the past 35 days, at most 5 minutes ahead.
	StripeAcceptPast   = 35 * 24 * time.Hour
	StripeAcceptFuture = 5 * time.Minute
)

// ValueFits reports whether Stripe takes v's digits (stripeapi.MaxValue).
func ValueFits(v int64) bool { return v >= -stripeapi.MaxValue && v <= stripeapi.MaxValue }

// payloadOf is the meter event payload of an item: the customer and the
// value under the meter's keys as the item carries them, Stripe's defaults
// when it carries none.
func payloadOf(p outbox.Payload) map[string]string {
	ck, vk := p.CustomerKey, p.ValueKey
	if ck == "" {
		ck = stripeapi.DefaultCustomerPayloadKey
	}
	if vk == "" {
		vk = stripeapi.DefaultValuePayloadKey
	}
	return map[string]string{ck: p.Customer, vk: strconv.FormatInt(p.Value, 10)}
}

// Settings are the Stripe settings of a node.
type Settings struct {
	// Key is STRIPE_API_KEY; empty stalls export visibly.
	Key string
	// APIBase is STRIPE_API_BASE.
	APIBase string
	// MeterEventsBase is STRIPE_METER_EVENTS_BASE, the v2 stream's host.
	MeterEventsBase string
	// Account is STRIPE_ACCOUNT; empty means the key's own account.
	Account string
	// Exporter is TALLY_EXPORTER.
	Exporter string
	// HTTPClient is used for Stripe calls; nil means stripeapi's default.
	HTTPClient *http.Client
	// Metrics counts the client's calls; nil counts nothing.
	Metrics *stripeapi.RequestMetrics
	// Rates are the destination's budget (Budget); zero fields take their
	// defaults for the key's mode.
	Rates Rates
}

// Destination is where this node exports.
type Destination struct {
	Exporter string
	// Account is empty when the key cannot read its own account (a
	// restricted key without that permission) and STRIPE_ACCOUNT is unset:
	// usage is then quarantined as no_account until it is set.
	Account string
	Mode    outbox.Mode
}

// ErrNoKey says STRIPE_API_KEY is unset: export is stalled.
var ErrNoKey = errors.New("export stalled: STRIPE_API_KEY is unset")

// Resolver finds and remembers this node's destination.
type Resolver struct {
	settings Settings
	client   *stripeapi.Client
	budget   *Budget

	mu       sync.Mutex
	resolved *Destination
	lastErr  error
	lastTry  time.Time
	// lookupStatus is the status of the failed account lookup in lastErr
	// (0: no answer).
	lookupStatus int
	keyErr       error // Stripe refused the key on a delivery
	// refused mirrors keyErr != nil, so that every accepted delivery (the
	// hot path) can skip the lock.
	refused atomic.Bool
	// reach hears whether this node's calls to Stripe get an answer
	// (stall.go).
	reach reachability
	// connected are the connected accounts tenant mappings name, and which
	// Stripe refused (accounts.go); nil without a key.
	connected *Connected
	// retry is how often a failed account lookup is tried again:
	// retryEvery unless a test sets it.
	retry time.Duration
}

// retryEvery bounds how often a failed account lookup is tried again.
const retryEvery = 30 * time.Second

// NewResolver validates the settings (the key's prefix gives the mode) and
// returns a resolver. It makes no call yet.
func NewResolver(s Settings) (*Resolver, error) {
	if s.Exporter == "" {
		s.Exporter = StripeMeterEvents
	}
	if s.Exporter != StripeMeterEvents && s.Exporter != StripeMeterEventStream {
		return nil, fmt.Errorf("TALLY_EXPORTER must be %s or %s", StripeMeterEvents, StripeMeterEventStream)
	}
	r := &Resolver{settings: s, retry: retryEvery}
	if s.Key == "" {
		return r, nil
	}
	mode, err := stripeapi.ModeOfKey(s.Key)
	if err != nil {
		return nil, err
	}
	r.budget = NewBudget(mode, s.Account != "", s.Rates)
	c, err := stripeapi.New(stripeapi.Config{Key: s.Key, APIBase: s.APIBase, MeterEventsBase: s.MeterEventsBase, Account: s.Account,
		HTTPClient: r.reach.client(s.HTTPClient, stripeapi.DefaultTimeout), Metrics: s.Metrics, Pace: r.budget.pace})
	if err != nil {
		return nil, err
	}
	r.client = c
	r.connected = NewConnected(nil, c.CheckAccess, nil)
	r.connected.onKnown = r.budget.connect
	return r, nil
}

// Connected is what this node knows of the connected accounts tenant
// mappings name; nil without a key. Give it its source of accounts
// (Connected.SetSource) before deliverers run.
func (r *Resolver) Connected() *Connected { return r.connected }

// Client is the Stripe client, nil without a key. Every call made with it
// but v1 meter events, stream requests and meter event adjustments waits
// for the budget's Other class; those are paced by their deliverers, on
// the budget's Events, Stream and Adjust classes.
func (r *Resolver) Client() *stripeapi.Client { return r.client }

// Budget is the destination account's budget, nil without a key.
func (r *Resolver) Budget() *Budget { return r.budget }

// LookupError is a failed account lookup: Stripe's error code and the
// status it answered (0: no answer). Resolve returns it until a lookup works.
type LookupError struct {
	Code   string
	Status int
}

func (e *LookupError) Error() string {
	return fmt.Sprintf("export stalled: Stripe's account lookup failed (%s, status %d)", e.Code, e.Status)
}

// errUnresolved says the destination has not been looked up yet.
var errUnresolved = errors.New("export stalled: the destination account is not resolved yet")

// Resolve returns this node's destination, looking it up when it is not
// known yet (STRIPE_ACCOUNT, or GET /v1/account). Without a key it is
// ErrNoKey; a failed lookup is tried again at most every 30 seconds and its
// error (a content-free description) returned meanwhile. It may call
// Stripe: keep it off request paths (see Destination).
func (r *Resolver) Resolve(ctx context.Context) (Destination, error) {
	if r.client == nil {
		return Destination{}, ErrNoKey
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.resolved != nil {
		return *r.resolved, nil
	}
	if r.lastErr != nil && time.Since(r.lastTry) < r.retry {
		return Destination{}, r.lastErr
	}
	r.lastTry = time.Now()
	d := Destination{Exporter: r.settings.Exporter, Mode: outbox.Mode(r.client.Mode())}
	account, err := r.client.AccountID(ctx)
	if err != nil {
		code, status, _ := stripeapi.Describe(err)
		if status == http.StatusForbidden {
			// The key may not read its account: a configuration problem a
			// human must fix; usage is quarantined as no_account meanwhile.
			r.resolved = &d
			return d, nil
		}
		r.lastErr = &LookupError{Code: code, Status: status}
		r.lookupStatus = status
		return Destination{}, r.lastErr
	}
	d.Account = account
	r.resolved, r.lastErr = &d, nil
	return d, nil
}

// Destination returns what Resolve found, without calling anyone: what the
// ingest path and readiness use.
func (r *Resolver) Destination() (Destination, error) {
	if r.client == nil {
		return Destination{}, ErrNoKey
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.resolved != nil:
		return *r.resolved, nil
	case r.lastErr != nil:
		return Destination{}, r.lastErr
	}
	return Destination{}, errUnresolved
}

// Header is the Stripe-Account header of a call for an item staged for
// account: none for the node's own destination (the client adds
// STRIPE_ACCOUNT, when set, to every call), else the account — a
// connected account a tenant mapping names.
func (r *Resolver) Header(account string) string {
	if d, err := r.Destination(); err == nil && account == d.Account {
		return ""
	}
	return account
}

// Run resolves the destination in the background until it is known or ctx
// ends, trying again every 30 seconds. It logs a failed lookup to logger
// once for each status it fails with (a refused key, 401 or 403, as an
// error; no answer or another status as a warning), not once a try, and
// that the lookup works after one was logged.
func (r *Resolver) Run(ctx context.Context, logger *slog.Logger) {
	if r.client == nil {
		return
	}
	logged := -1 // the status of the failure last logged; -1: none
	for {
		_, err := r.Resolve(ctx)
		if err == nil {
			if logged >= 0 {
				logger.Info("Stripe's account lookup works: export can start")
			}
			return
		}
		if status := r.failedStatus(); status >= 0 && status != logged && ctx.Err() == nil {
			logged = status
			if status == http.StatusUnauthorized || status == http.StatusForbidden {
				logger.Error("Stripe refused the API key on the account lookup: export is stalled until the key is fixed; the lookup is tried again every 30s",
					"status", status, "error", err)
			} else {
				logger.Warn("Stripe's account lookup failed: export is stalled until it answers; it is tried again every 30s",
					"status", status, "error", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(r.retry):
		}
	}
}

// failedStatus is the status of the failed account lookup (0: no answer),
// or -1 when none failed.
func (r *Resolver) failedStatus() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.lastErr == nil {
		return -1
	}
	return r.lookupStatus
}

// Check is a readiness check: nil when this node knows where it exports
// and Stripe has not refused its key since the last accepted delivery.
func (r *Resolver) Check(context.Context) error {
	if _, err := r.Destination(); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.keyErr
}

// KeyRefused records that Stripe refused the key on a delivery (401 or
// 403, a rolled or restricted key; account_invalid, a destination account
// the key may not act for): export is stalled — Check says so —
// until a delivery with it is accepted. It reports whether that is news.
func (r *Resolver) KeyRefused(status int) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	news := r.keyErr == nil
	r.keyErr = fmt.Errorf("export stalled: Stripe refused the API key, or its access to the destination account (status %d)", status)
	r.refused.Store(true)
	return news
}

// KeyWorks records an accepted delivery; it reports whether export was
// stalled on the key until now.
func (r *Resolver) KeyWorks() bool {
	if !r.refused.Load() {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	news := r.keyErr != nil
	r.keyErr = nil
	r.refused.Store(false)
	return news
}
