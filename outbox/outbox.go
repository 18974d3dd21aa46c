package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// State is an item's state.
type State string

// The states (docs/outbox.md, "The states"), superseded among them: an item
// re-addressed under a new identity (supersede, supersede_cancelled), whose
// successor carries its usage.
const (
	StatePending     State = "pending"
	StateLeased      State = "leased"
	StateAccepted    State = "accepted"
	StateConfirmed   State = "confirmed"
	StateUncertain   State = "uncertain"
	StateRejected    State = "rejected"
	StateQuarantined State = "quarantined"
	StateSuperseded  State = "superseded"
	// StateWithdrawn: the item's usage was cancelled before any attempt of
	// it could have reached the provider (stage_withdrawn, withdraw). Terminal;
	// never sent.
	StateWithdrawn State = "withdrawn"
)

// States lists every state in the order reports show them.
var States = []State{
	StatePending, StateLeased, StateAccepted, StateConfirmed,
	StateUncertain, StateRejected, StateQuarantined, StateSuperseded, StateWithdrawn,
}

// Reason says why an item is quarantined: a cause a human must fix, about
// which the software must not guess.
type Reason string

// Quarantine reasons. The first six are decided at staging
// (stage_quarantined) and again at claim (quarantine); meter_not_found,
// customer_not_found, payload_keys and provider_refused come from the
// provider's answer (quarantine) or its asynchronous error report
// (fail_accepted, or accept when the report came while the item was in
// flight); count_value is decided at staging, value_digits at staging and
// at claim.
const (
	ReasonFeatureUnmapped  Reason = "feature_unmapped"   // the feature has no mapping
	ReasonNoCustomer       Reason = "no_customer"        // the tenant has no Stripe customer
	ReasonNoAccount        Reason = "no_account"         // no destination account is configured
	ReasonAccountMismatch  Reason = "account_mismatch"   // staged for another account than this node's
	ReasonModeMismatch     Reason = "mode_mismatch"      // staged for another mode than this node's
	ReasonTimestampWindow  Reason = "timestamp_window"   // outside the timestamps the provider accepts
	ReasonMeterNotFound    Reason = "meter_not_found"    // the provider has no meter for the event name
	ReasonCustomerNotFound Reason = "customer_not_found" // the provider has no such customer
	// ReasonCountValue: an event of a count feature whose value is not 1
	// (a correction, a zero, several units). A count meter counts events,
	// so it cannot be billed as posted; a correction is a meter event
	// adjustment (cancel) of the event it corrects.
	ReasonCountValue Reason = "count_value"
	// ReasonValueDigits: the value has more digits than the provider
	// accepts (Stripe: 15 significant digits). It is never sent and never
	// truncated; decided at staging and again at claim.
	ReasonValueDigits Reason = "value_digits"
	// ReasonPayloadKeys: the provider found no customer or value under the
	// payload keys the item carries — the meter's keys differ from the
	// mapping's. Setting the feature mapping again reads the meter's keys.
	ReasonPayloadKeys Reason = "payload_keys"
	// ReasonProviderRefused: the provider refused the item with an answer
	// (or an error report code) Tally does not recognise. A human looks
	// before anything is decided: a mapping fix may cure it.
	ReasonProviderRefused Reason = "provider_refused"
	// ReasonPeriodClosed: staged after its billing period's invoice closed
	// (the period's end plus the invoice grace, TALLY_INVOICE_GRACE or the
	// tenant's): Stripe would record the usage and bill it on no invoice.
	// Decided at staging under TALLY_LATE_USAGE=quarantine (the default);
	// finance may requeue it knowingly (accept_period_closed).
	ReasonPeriodClosed Reason = "period_closed"
	// ReasonCancelTooLate: a cancellation of a count event Stripe received
	// more than 24 hours ago (counted from its item's first attempt, less
	// a margin): Stripe cannot apply it. Kept for finance; never sent.
	ReasonCancelTooLate Reason = "cancel_too_late"
	// ReasonCancelLastValue: a cancellation of an event of a last
	// feature's window Stripe may have: a last value cannot be taken back.
	// Kept for finance; never sent.
	ReasonCancelLastValue Reason = "cancel_last_value"
)

// Reasons lists every quarantine reason.
var Reasons = []Reason{
	ReasonFeatureUnmapped, ReasonNoCustomer, ReasonNoAccount, ReasonAccountMismatch,
	ReasonModeMismatch, ReasonTimestampWindow, ReasonMeterNotFound, ReasonCustomerNotFound, ReasonCountValue,
	ReasonValueDigits, ReasonPayloadKeys, ReasonProviderRefused, ReasonPeriodClosed,
	ReasonCancelTooLate, ReasonCancelLastValue,
}

func (r Reason) valid() bool {
	for _, v := range Reasons {
		if r == v {
			return true
		}
	}
	return false
}

// Payload is the financial intent of an item: what is sent, byte for byte
// the same on every attempt. It is immutable once enqueued.
type Payload struct {
	// Customer is the provider's customer id; empty only when quarantined.
	Customer string `json:"customer,omitempty"`
	// EventName is the provider meter's event name; empty only when quarantined.
	EventName string `json:"event_name,omitempty"`
	// Value is the whole-number usage; negative is a correction.
	Value int64 `json:"value"`
	// Timestamp is the event time in Unix seconds.
	Timestamp int64 `json:"timestamp"`
	// Identifier is the identity's identifier; Enqueue sets it.
	Identifier string `json:"identifier"`
	// Feature is Tally's feature the usage was posted for.
	Feature string `json:"feature"`
	// Period is the start of the billing period, RFC 3339 UTC.
	Period string `json:"period"`
	// CustomerKey and ValueKey are the payload keys the provider's meter
	// reads the customer and the value from, as the feature mapping had
	// them when the item was built; empty means the provider's defaults
	// (Stripe: stripe_customer_id and value). Items staged before the
	// mapping carried keys have neither.
	CustomerKey string `json:"customer_key,omitempty"`
	ValueKey    string `json:"value_key,omitempty"`
	// Cancels is, on an item of SubjectUsageCancellation, the identifier
	// of the meter event it cancels; empty on every other item.
	Cancels string `json:"cancels,omitempty"`
	// CancelBy is, on an item that cancels a meter event (Cancels), the
	// last moment (Unix seconds, by the database's clock) the provider
	// takes the cancellation: the original's first attempt plus Stripe's
	// 24 hours, rounded down. A claim whose lease would end after it says
	// so (Lease.PastDeadline). Zero when unknown (items made before it).
	CancelBy int64 `json:"cancel_by,omitempty"`
	// Late says the item was staged after its billing period's invoice
	// closed (Reason period_closed): quarantined so, or sent under
	// TALLY_LATE_USAGE=send, it stays marked, and the completeness report
	// counts it. Never sent to the provider.
	Late bool `json:"late,omitempty"`
}

// Item is an outbox row as read back.
type Item struct {
	ID int64
	Identity
	Identifier  string
	Payload     Payload
	OrderingKey string
	State       State

	Attempts        int
	RefusedAttempts int
	AttemptsBase    int
	NextAttemptAt   time.Time
	FirstAttemptAt  *time.Time

	LeaseOwner     string
	LeasedAt       *time.Time
	LeaseExpiresAt *time.Time
	LeaseToken     int64

	ProviderRef string
	AcceptedAt  *time.Time
	ConfirmedAt *time.Time

	LastError        *ErrorInfo
	QuarantineReason Reason
	SupersededBy     *int64

	CreatedAt time.Time
	UpdatedAt time.Time
}

// CurrentError is the item's last error while it still tells something
// about the item: nil once the provider accepted it (accepted, confirmed),
// when LastError is an earlier attempt's, which the attempt log keeps. A
// failure reported after the acceptance (fail_accepted) moves the item out of
// accepted, so it shows.
func (it Item) CurrentError() *ErrorInfo {
	if it.State == StateAccepted || it.State == StateConfirmed {
		return nil
	}
	return it.LastError
}

// Lease is a claim on an item: the item as claimed, whose LeaseToken fences
// every write its holder makes.
type Lease struct {
	Item
	// TimestampOutside says the payload's timestamp is outside what the
	// provider accepts (ClaimOptions.AcceptPast/AcceptFuture), by the
	// database clock at the claim.
	TimestampOutside bool
	// PastDeadline says the item has a CancelBy that the lease ends after,
	// by the database clock at the claim: the provider may refuse to apply
	// it by the time it is sent. Decided in the claim's own statement.
	PastDeadline bool
}

// Config holds the outbox's knobs. The zero value of each field means its
// default; Validate checks the whole config before anything starts.
type Config struct {
	// Lease is how long a claim holds an item before another deliverer may
	// claim it again. Defaults to 120 seconds.
	Lease time.Duration
	// BackoffBase is the first retry delay. Defaults to 5 seconds.
	BackoffBase time.Duration
	// BackoffCap caps the exponential delay. Defaults to 900 seconds.
	BackoffCap time.Duration
	// MaxAttempts is the attempt cap: a retry after this many attempts
	// becomes uncertain, never rejected. Defaults to 20.
	MaxAttempts int
	// RateLimitDelay is the delay after a rate-limited answer, instead of the
	// exponential backoff. Defaults to 30 seconds.
	RateLimitDelay time.Duration
	// Horizon is how long after first_attempt_at an item that may have reached
	// the provider may still be sent; past it a resend could double-bill, so
	// the item becomes uncertain. Defaults to 20 hours.
	Horizon time.Duration
	// DedupWindow is how long the provider deduplicates identifiers; Horizon
	// must be below it. Defaults to 24 hours (Stripe v1 meter events).
	DedupWindow time.Duration
	// ClaimScan bounds how many due items the per-key claim looks at to find
	// distinct keys: ClaimScan × the batch size. Defaults to 4.
	ClaimScan int
}

// Defaults.
const (
	DefaultLease          = 120 * time.Second
	DefaultBackoffBase    = 5 * time.Second
	DefaultBackoffCap     = 900 * time.Second
	DefaultMaxAttempts    = 20
	DefaultRateLimitDelay = 30 * time.Second
	DefaultHorizon        = 20 * time.Hour
	DefaultDedupWindow    = 24 * time.Hour
	DefaultClaimScan      = 4
)

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&c.Lease, DefaultLease)
	def(&c.BackoffBase, DefaultBackoffBase)
	def(&c.BackoffCap, DefaultBackoffCap)
	def(&c.RateLimitDelay, DefaultRateLimitDelay)
	def(&c.Horizon, DefaultHorizon)
	def(&c.DedupWindow, DefaultDedupWindow)
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.ClaimScan == 0 {
		c.ClaimScan = DefaultClaimScan
	}
	return c
}

// Validate reports every problem with c (after defaults), joined.
func (c Config) Validate() error {
	c = c.WithDefaults()
	var errs []error
	positive := func(name string, d time.Duration) {
		if d <= 0 {
			errs = append(errs, fmt.Errorf("%s must be positive, got %s", name, d))
		}
	}
	positive("lease", c.Lease)
	positive("backoff base", c.BackoffBase)
	positive("backoff cap", c.BackoffCap)
	positive("rate-limit delay", c.RateLimitDelay)
	positive("horizon", c.Horizon)
	positive("dedup window", c.DedupWindow)
	if c.BackoffBase > c.BackoffCap {
		errs = append(errs, fmt.Errorf("backoff base %s is above the cap %s", c.BackoffBase, c.BackoffCap))
	}
	if c.MaxAttempts < 1 {
		errs = append(errs, fmt.Errorf("max attempts must be at least 1, got %d", c.MaxAttempts))
	}
	if c.ClaimScan < 1 {
		errs = append(errs, fmt.Errorf("claim scan must be at least 1, got %d", c.ClaimScan))
	}
	if c.Horizon >= c.DedupWindow {
		errs = append(errs, fmt.Errorf("horizon %s must be below the provider's dedup window %s", c.Horizon, c.DedupWindow))
	}
	if c.Lease >= c.Horizon {
		errs = append(errs, fmt.Errorf("lease %s must be below the horizon %s", c.Lease, c.Horizon))
	}
	if c.Horizon+c.Lease >= c.DedupWindow {
		errs = append(errs, fmt.Errorf("horizon %s plus lease %s must stay below the provider's dedup window %s: an item claimed just inside the horizon may be sent until its lease ends",
			c.Horizon, c.Lease, c.DedupWindow))
	}
	if len(errs) > 0 {
		return fmt.Errorf("outbox: invalid config: %w", errors.Join(errs...))
	}
	return nil
}

// Store is the outbox. It holds no connection: every method takes the
// Querier (or transaction) to run on, so callers choose the transaction.
// It is safe for concurrent use.
type Store struct {
	cfg     Config
	metrics *metrics
	// lastMaintained is when this process's maintenance pass last
	// succeeded (Unix nanoseconds; 0: never): a heartbeat for metrics only.
	lastMaintained atomic.Int64
	// shards is the buckets' placement, read on first use (Shards).
	shards tenantbucket.Placement
	// quiet is the shard groups claims found empty (quietGroups).
	quiet quietGroups
}

// Shards is the placement of the buckets the Store's statements are split
// by: read from the database on first use and kept, until ForgetShards.
func (s *Store) Shards(ctx context.Context, q pgdb.Querier) (*tenantbucket.Shards, error) {
	sh, err := s.shards.Get(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	return sh, nil
}

// ForgetShards makes the next Shards read the placement again: after a
// statement naming one group's buckets was refused as spanning shards
// (the shards were split), or after the tables were distributed.
func (s *Store) ForgetShards() { s.shards.Forget() }

// LastMaintained is when this process's maintenance pass last succeeded;
// zero before the first.
func (s *Store) LastMaintained() time.Time {
	if n := s.lastMaintained.Load(); n > 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// New validates cfg and returns a Store whose metrics are registered on reg
// (nil: not registered anywhere).
func New(cfg Config, reg prometheus.Registerer) (*Store, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m := newMetrics().zero()
	if reg != nil {
		if err := m.register(reg); err != nil {
			return nil, fmt.Errorf("outbox: registering metrics: %w", err)
		}
	}
	return &Store{cfg: cfg.WithDefaults(), metrics: m}, nil
}

// Config returns the Store's config with defaults filled in.
func (s *Store) Config() Config { return s.cfg }
