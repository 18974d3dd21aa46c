// Package config reads Tally's settings: each from its environment variable,
// overridden by a command-line flag of the same meaning, with the defaults
// the brief sets. It validates the whole configuration before anything
// starts, and reports every problem at once.
//
// It never reads a setting anywhere else, and never echoes the value of a
// setting that may hold a secret (the database URL's password).
package config

import (
	"errors"
	"flag"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/robfig/cron/v3"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Config is the service's configuration.
type Config struct {
	// DatabaseURL is the Postgres URL; empty means the embedded cluster in
	// DataDir.
	DatabaseURL string
	// DataDir holds the embedded cluster's data and logs. Defaults to .tally.
	DataDir string
	// Listen is the HTTP address. Defaults to 127.0.0.1:8080.
	Listen string
	// LogFormat is "text" or "json". Defaults to text.
	LogFormat string
	// LogLevel is debug, info, warn or error. Defaults to info.
	LogLevel string
	// MaintenanceInterval is how often the outbox maintenance pass runs.
	// Defaults to 15 seconds.
	MaintenanceInterval time.Duration
	// ShutdownTimeout bounds a graceful shutdown. Defaults to 30 seconds.
	ShutdownTimeout time.Duration
	// Outbox holds the outbox's knobs.
	Outbox outbox.Config

	// StripeAPIKey is STRIPE_API_KEY; empty stalls export visibly.
	StripeAPIKey string
	// StripeAPIBase is STRIPE_API_BASE. Defaults to https://api.stripe.com.
	StripeAPIBase string
	// StripeMeterEventsBase is STRIPE_METER_EVENTS_BASE, the v2 stream's
	// host. Defaults to https://meter-events.stripe.com.
	StripeMeterEventsBase string
	// StripeAccount is STRIPE_ACCOUNT; empty means the key's own account.
	StripeAccount string
	// StripeWebhookSecret is STRIPE_WEBHOOK_SECRET, the signing secret of
	// the event destination that posts to /v1/stripe/events.
	StripeWebhookSecret string
	// Exporter is TALLY_EXPORTER. Defaults to stripe_meter_events.
	Exporter string
	// AdminToken is TALLY_ADMIN_TOKEN: an admin token with this value is
	// ensured at start.
	AdminToken string
	// StageInterval is how often windows are staged. Defaults to 10 seconds.
	StageInterval time.Duration
	// WindowGrace is how long after its end a window waits for late usage.
	// Defaults to 2 minutes.
	WindowGrace time.Duration

	// StripeTimeout bounds one call to Stripe. Defaults to 10 seconds.
	StripeTimeout time.Duration
	// RateLive and RateTest are the destination's calls a second in live and
	// test mode. Default to 900 and 20.
	RateLive, RateTest float64
	// StreamRateLive and StreamRateTest are the v2 stream's requests a
	// second (each up to 100 events) in live and test mode. Default to
	// 9,000 and 20.
	StreamRateLive, StreamRateTest float64
	// BasicRateLive and BasicRateTest are Tally's share of Stripe's basic
	// rate limit of the destination account (100 and 25 operations a
	// second), which every call counts toward: in test mode meter events
	// and stream requests too, in live mode everything else (and meter
	// events of a connected account). Default to 90 and 20.
	BasicRateLive, BasicRateTest float64
	// StreamInFlight bounds the stream's events in flight on a node.
	// Defaults to 2,000 (20 requests of 100).
	StreamInFlight int
	// DeliveryWorkers, DeliveryBatch and DeliveryInFlight size the
	// deliverer: claim loops, items per claim, sends in flight. Default to
	// 4, 50 and 64.
	DeliveryWorkers, DeliveryBatch, DeliveryInFlight int
	// PollInterval is how often idle deliverers look for due work when no
	// notification wakes them. Defaults to 1 second.
	PollInterval time.Duration

	// ReconcileSchedule is when the periodic reconcile run starts, in cron
	// syntax (UTC), or "off". Defaults to nightly at 02:00.
	ReconcileSchedule string
	// ReconcileSettle is how long an accepted item waits before a run
	// compares it. Defaults to 2 hours.
	ReconcileSettle time.Duration
}

// setting is one configurable value: an environment variable and a flag.
type setting struct {
	env, flag, usage string
	def              string
	set              func(c *Config, v string) error
}

func settings() []setting {
	dur := func(dst func(*Config) *time.Duration) func(*Config, string) error {
		return func(c *Config, v string) error {
			d, err := time.ParseDuration(v)
			if err != nil {
				return fmt.Errorf("not a duration (e.g. 30s, 5m, 20h): %q", v)
			}
			*dst(c) = d
			return nil
		}
	}
	integer := func(dst func(*Config) *int) func(*Config, string) error {
		return func(c *Config, v string) error {
			n, err := strconv.Atoi(v)
			if err != nil {
				return fmt.Errorf("not a whole number: %q", v)
			}
			*dst(c) = n
			return nil
		}
	}
	float := func(dst func(*Config) *float64) func(*Config, string) error {
		return func(c *Config, v string) error {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return fmt.Errorf("not a number: %q", v)
			}
			*dst(c) = f
			return nil
		}
	}
	str := func(dst func(*Config) *string) func(*Config, string) error {
		return func(c *Config, v string) error { *dst(c) = v; return nil }
	}
	return []setting{
		{"TALLY_DATABASE_URL", "database-url", "Postgres URL; unset: an embedded cluster in the data directory", "",
			str(func(c *Config) *string { return &c.DatabaseURL })},
		{"TALLY_DATA_DIR", "data-dir", "embedded Postgres data and logs", ".tally",
			str(func(c *Config) *string { return &c.DataDir })},
		{"TALLY_LISTEN", "listen", "HTTP address", "127.0.0.1:8080",
			str(func(c *Config) *string { return &c.Listen })},
		{"TALLY_LOG_FORMAT", "log-format", "log format: text or json (default: json for serve, text for dev and the operator commands)", "json",
			str(func(c *Config) *string { return &c.LogFormat })},
		{"TALLY_LOG_LEVEL", "log-level", "log level: debug, info, warn or error", "info",
			str(func(c *Config) *string { return &c.LogLevel })},
		{"TALLY_MAINTENANCE_INTERVAL", "maintenance-interval", "how often the outbox maintenance pass runs", "15s",
			dur(func(c *Config) *time.Duration { return &c.MaintenanceInterval })},
		{"TALLY_SHUTDOWN_TIMEOUT", "shutdown-timeout", "how long a graceful shutdown may take", "30s",
			dur(func(c *Config) *time.Duration { return &c.ShutdownTimeout })},
		{"TALLY_OUTBOX_LEASE", "outbox-lease", "how long a claim holds an item", outbox.DefaultLease.String(),
			dur(func(c *Config) *time.Duration { return &c.Outbox.Lease })},
		{"TALLY_OUTBOX_BACKOFF_BASE", "outbox-backoff-base", "first retry delay", outbox.DefaultBackoffBase.String(),
			dur(func(c *Config) *time.Duration { return &c.Outbox.BackoffBase })},
		{"TALLY_OUTBOX_BACKOFF_CAP", "outbox-backoff-cap", "largest retry delay", outbox.DefaultBackoffCap.String(),
			dur(func(c *Config) *time.Duration { return &c.Outbox.BackoffCap })},
		{"TALLY_OUTBOX_MAX_ATTEMPTS", "outbox-max-attempts", "attempt cap; past it an item becomes uncertain",
			strconv.Itoa(outbox.DefaultMaxAttempts), integer(func(c *Config) *int { return &c.Outbox.MaxAttempts })},
		{"TALLY_OUTBOX_RATE_LIMIT_DELAY", "outbox-rate-limit-delay", "retry delay after a rate-limit answer",
			outbox.DefaultRateLimitDelay.String(),
			dur(func(c *Config) *time.Duration { return &c.Outbox.RateLimitDelay })},
		{"TALLY_OUTBOX_HORIZON", "outbox-horizon", "how long after the first attempt an item may still be sent; below the provider's dedup window",
			outbox.DefaultHorizon.String(),
			dur(func(c *Config) *time.Duration { return &c.Outbox.Horizon })},
		{"STRIPE_API_KEY", "stripe-api-key", "Stripe secret or restricted key; its prefix gives the mode; a restricted key (rk_…) cannot use the v2 stream exporter or error reports; unset: export stalls visibly (prefer the variable: a flag shows in the process list)", "",
			str(func(c *Config) *string { return &c.StripeAPIKey })},
		{"STRIPE_API_BASE", "stripe-api-base", "Stripe API base URL (stripe-mock or the simulator in tests)", "https://api.stripe.com",
			str(func(c *Config) *string { return &c.StripeAPIBase })},
		{"STRIPE_METER_EVENTS_BASE", "stripe-meter-events-base", "base URL of Stripe's v2 meter event stream host (the simulator in tests)", "https://meter-events.stripe.com",
			str(func(c *Config) *string { return &c.StripeMeterEventsBase })},
		{"STRIPE_ACCOUNT", "stripe-account", "destination account (Connect); unset: the key's own account", "",
			str(func(c *Config) *string { return &c.StripeAccount })},
		{"STRIPE_WEBHOOK_SECRET", "stripe-webhook-secret", "signing secret of the event destination posting to /v1/stripe/events (whsec_…); unset: it answers 503", "",
			str(func(c *Config) *string { return &c.StripeWebhookSecret })},
		{"TALLY_EXPORTER", "exporter", "the exporter of features whose mapping names none: stripe_meter_events (v1) or stripe_meter_event_stream (v2)", "stripe_meter_events",
			str(func(c *Config) *string { return &c.Exporter })},
		{"TALLY_ADMIN_TOKEN", "admin-token", "if set, an admin token with this value is ensured at start (at least 24 characters)", "",
			str(func(c *Config) *string { return &c.AdminToken })},
		{"TALLY_STAGE_INTERVAL", "stage-interval", "how often windows are staged", "10s",
			dur(func(c *Config) *time.Duration { return &c.StageInterval })},
		{"TALLY_WINDOW_GRACE", "window-grace", "how long after its end a window waits for late usage", "2m",
			dur(func(c *Config) *time.Duration { return &c.WindowGrace })},
		{"TALLY_STRIPE_TIMEOUT", "stripe-timeout", "how long one call to Stripe may take", "10s",
			dur(func(c *Config) *time.Duration { return &c.StripeTimeout })},
		{"TALLY_RATE_LIVE", "rate-live", "calls a second to a live-mode destination (Stripe allows 1,000)", "900",
			float(func(c *Config) *float64 { return &c.RateLive })},
		{"TALLY_RATE_TEST", "rate-test", "calls a second to a test-mode destination (Stripe allows 25)", "20",
			float(func(c *Config) *float64 { return &c.RateTest })},
		{"TALLY_STREAM_RATE_LIVE", "stream-rate-live", "v2 stream requests a second (up to 100 events each) to a live-mode destination (Stripe allows 10,000)", "9000",
			float(func(c *Config) *float64 { return &c.StreamRateLive })},
		{"TALLY_STREAM_RATE_TEST", "stream-rate-test", "v2 stream requests a second to a test-mode destination", "20",
			float(func(c *Config) *float64 { return &c.StreamRateTest })},
		{"TALLY_BASIC_RATE_LIVE", "basic-rate-live", "calls a second, all kinds together, to a live-mode account's basic limit (Stripe allows 100; live meter events of the key's own account do not count)", "90",
			float(func(c *Config) *float64 { return &c.BasicRateLive })},
		{"TALLY_BASIC_RATE_TEST", "basic-rate-test", "calls a second, all kinds together, meter events included, to a test-mode account (Stripe allows 25)", "20",
			float(func(c *Config) *float64 { return &c.BasicRateTest })},
		{"TALLY_STREAM_INFLIGHT", "stream-inflight", "the most v2 stream events in flight on this node", "2000",
			integer(func(c *Config) *int { return &c.StreamInFlight })},
		{"TALLY_DELIVERY_WORKERS", "delivery-workers", "each deliverer's claim loops on this node (v1's and the stream's)", "4",
			integer(func(c *Config) *int { return &c.DeliveryWorkers })},
		{"TALLY_DELIVERY_BATCH", "delivery-batch", "the most items one claim takes", "50",
			integer(func(c *Config) *int { return &c.DeliveryBatch })},
		{"TALLY_DELIVERY_INFLIGHT", "delivery-inflight", "the most sends in flight on this node", "64",
			integer(func(c *Config) *int { return &c.DeliveryInFlight })},
		{"TALLY_POLL_INTERVAL", "poll-interval", "how often idle deliverers look for due work without a notification", "1s",
			dur(func(c *Config) *time.Duration { return &c.PollInterval })},
		{"TALLY_RECONCILE_SCHEDULE", "reconcile-schedule", "when the periodic reconcile run starts: cron syntax in UTC, or off", "0 2 * * *",
			str(func(c *Config) *string { return &c.ReconcileSchedule })},
		{"TALLY_RECONCILE_SETTLE", "reconcile-settle", "how long an accepted item waits before reconciliation compares it", "2h",
			dur(func(c *Config) *time.Duration { return &c.ReconcileSettle })},
		{"TALLY_OUTBOX_CLAIM_SCAN", "outbox-claim-scan", "how many due items per wanted item a per-key claim reads to find distinct keys",
			strconv.Itoa(outbox.DefaultClaimScan), integer(func(c *Config) *int { return &c.Outbox.ClaimScan })},
	}
}

// Flags registers every setting on fs and returns a function that, after
// fs.Parse, builds and validates the Config: flag values win over the
// environment (read with getenv), which wins over the defaults.
func Flags(fs *flag.FlagSet, getenv func(string) string) func() (Config, error) {
	all := settings()
	values := make([]string, len(all))
	given := make([]bool, len(all))
	for i, s := range all {
		usage := fmt.Sprintf("%s (env %s)", s.usage, s.env)
		if s.def != "" {
			usage += fmt.Sprintf(" (default %q)", s.def)
		}
		fs.Func(s.flag, usage, func(v string) error {
			values[i], given[i] = v, true
			return nil
		})
	}
	return func() (Config, error) {
		var (
			c    Config
			errs []error
		)
		for i, s := range all {
			v, from := s.def, "default"
			if e := getenv(s.env); e != "" {
				v, from = e, s.env
			}
			if given[i] {
				v, from = values[i], "--"+s.flag
			}
			if err := s.set(&c, v); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", from, err))
			}
		}
		if err := c.validate(); err != nil {
			errs = append(errs, err)
		}
		if len(errs) > 0 {
			return Config{}, errors.Join(errs...)
		}
		return c, nil
	}
}

// RestrictedKey reports whether key is a Stripe restricted key (rk_…).
// Stripe's v2 API takes only secret keys (sk_…): "You can only access APIs
// in the /v2 namespace with secret keys"
// (https://docs.stripe.com/api-v2-overview, "Key differences between the v1
// and v2 namespace"). With a restricted key, stream sessions (POST
// /v2/billing/meter_event_session) and error reports (GET
// /v2/core/events/{id}) fail.
func RestrictedKey(key string) bool { return strings.HasPrefix(key, "rk_") }

// restrictedKeyProblems are the settings that need Stripe's v2 API while
// STRIPE_API_KEY is a restricted key: none when it is not.
func (c *Config) restrictedKeyProblems() []error {
	if !RestrictedKey(c.StripeAPIKey) {
		return nil
	}
	const why = "STRIPE_API_KEY is a restricted key (rk_…) and Stripe's v2 API takes only secret keys (sk_…): "
	var errs []error
	if c.Exporter == "stripe_meter_event_stream" {
		errs = append(errs, errors.New(why+"TALLY_EXPORTER=stripe_meter_event_stream sends through the v2 meter event stream; "+
			"use a secret key, or TALLY_EXPORTER=stripe_meter_events"))
	}
	if c.StripeWebhookSecret != "" {
		errs = append(errs, errors.New(why+"with STRIPE_WEBHOOK_SECRET set, Stripe's meter error reports are read with GET /v2/core/events; "+
			"use a secret key, or unset STRIPE_WEBHOOK_SECRET (error reports are then not received)"))
	}
	return errs
}

func (c *Config) validate() error {
	var errs []error
	if c.DatabaseURL == "" && c.DataDir == "" {
		errs = append(errs, errors.New("TALLY_DATA_DIR must not be empty when TALLY_DATABASE_URL is unset"))
	}
	if c.DataDir != "" {
		abs, err := filepath.Abs(c.DataDir)
		if err != nil {
			errs = append(errs, fmt.Errorf("TALLY_DATA_DIR: %w", err))
		}
		c.DataDir = abs
	}
	if c.Listen == "" || !strings.Contains(c.Listen, ":") {
		errs = append(errs, fmt.Errorf("TALLY_LISTEN must be host:port, got %q", c.Listen))
	}
	switch c.LogFormat {
	case "text", "json":
	default:
		errs = append(errs, fmt.Errorf("TALLY_LOG_FORMAT must be text or json, got %q", c.LogFormat))
	}
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		errs = append(errs, fmt.Errorf("TALLY_LOG_LEVEL must be debug, info, warn or error, got %q", c.LogLevel))
	}
	if c.MaintenanceInterval <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_MAINTENANCE_INTERVAL must be positive, got %s", c.MaintenanceInterval))
	}
	if c.ShutdownTimeout <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_SHUTDOWN_TIMEOUT must be positive, got %s", c.ShutdownTimeout))
	}
	if c.StripeAPIKey != "" {
		if _, err := stripeapi.ModeOfKey(c.StripeAPIKey); err != nil {
			errs = append(errs, fmt.Errorf("STRIPE_API_KEY: %w", err))
		}
	}
	if c.StripeAccount != "" && !strings.HasPrefix(c.StripeAccount, "acct_") {
		errs = append(errs, errors.New("STRIPE_ACCOUNT must be an account id (acct_…)"))
	}
	if c.StripeWebhookSecret != "" && !strings.HasPrefix(c.StripeWebhookSecret, "whsec_") {
		errs = append(errs, errors.New("STRIPE_WEBHOOK_SECRET must be an event destination's signing secret (whsec_…)"))
	}
	switch c.Exporter {
	case "stripe_meter_events":
	case "stripe_meter_event_stream":
	default:
		errs = append(errs, fmt.Errorf("TALLY_EXPORTER must be stripe_meter_events or stripe_meter_event_stream, got %q", c.Exporter))
	}
	errs = append(errs, c.restrictedKeyProblems()...)
	if c.AdminToken != "" && len(c.AdminToken) < auth.MinAdminTokenLength {
		errs = append(errs, fmt.Errorf("TALLY_ADMIN_TOKEN must be at least %d characters", auth.MinAdminTokenLength))
	}
	if c.StageInterval <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_STAGE_INTERVAL must be positive, got %s", c.StageInterval))
	}
	if c.WindowGrace < 0 {
		errs = append(errs, fmt.Errorf("TALLY_WINDOW_GRACE must not be negative, got %s", c.WindowGrace))
	}
	if c.StripeTimeout <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_STRIPE_TIMEOUT must be positive, got %s", c.StripeTimeout))
	}
	if c.RateLive <= 0 || c.RateTest <= 0 {
		errs = append(errs, errors.New("TALLY_RATE_LIVE and TALLY_RATE_TEST must be positive"))
	}
	if c.BasicRateLive <= 0 || c.BasicRateTest <= 0 {
		errs = append(errs, errors.New("TALLY_BASIC_RATE_LIVE and TALLY_BASIC_RATE_TEST must be positive"))
	}
	if c.StreamRateLive <= 0 || c.StreamRateTest <= 0 || c.StreamInFlight < 1 {
		errs = append(errs, errors.New("TALLY_STREAM_RATE_LIVE and TALLY_STREAM_RATE_TEST must be positive, TALLY_STREAM_INFLIGHT at least 1"))
	}
	if c.DeliveryWorkers < 1 || c.DeliveryBatch < 1 || c.DeliveryBatch > 1000 || c.DeliveryInFlight < 1 {
		errs = append(errs, errors.New("TALLY_DELIVERY_WORKERS and TALLY_DELIVERY_INFLIGHT must be at least 1, TALLY_DELIVERY_BATCH 1 to 1000"))
	}
	if c.ReconcileSchedule != "off" {
		if _, err := cron.ParseStandard(c.ReconcileSchedule); err != nil {
			errs = append(errs, fmt.Errorf("TALLY_RECONCILE_SCHEDULE must be a cron schedule (minute hour day month weekday) or off: %v", err))
		}
	}
	if c.ReconcileSettle < 0 {
		errs = append(errs, fmt.Errorf("TALLY_RECONCILE_SETTLE must not be negative, got %s", c.ReconcileSettle))
	}
	if c.PollInterval <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_POLL_INTERVAL must be positive, got %s", c.PollInterval))
	}
	if err := c.Outbox.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
