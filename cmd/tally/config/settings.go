package config

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// setting is one configurable value: an environment variable and a flag.
type setting struct {
	env, flag, usage string
	def              string
	set              func(c *Config, v string) error
}

// settings is the table of every setting, in the order problems with their
// values are reported.
func settings() []setting {
	current := slices.Concat(nodeSettings(), outboxSettings(), exportSettings(), deliverySettings(), reconcileSettings(), tlsSettings(), quotaSettings(), poolSettings(),
		[]setting{{"TALLY_OUTBOX_CLAIM_SCAN", "outbox-claim-scan", "how many due items per wanted item a per-key claim reads to find distinct keys",
			strconv.Itoa(outbox.DefaultClaimScan), integer(func(c *Config) *int { return &c.Outbox.ClaimScan })}},
		consoleSettings(), groupCommitSettings(), streamSettings(), archiveSettings())
	return append(current, oldNameSettings(current)...)
}

// nodeSettings are the node's own: its database, address, logs and
// lifecycle.
func nodeSettings() []setting {
	return []setting{
		{"TALLY_DATABASE_URL", "database-url", "Postgres URL; unset: an embedded cluster in the data directory", "",
			str(func(c *Config) *string { return &c.DatabaseURL })},
		{"TALLY_DATABASE_OWNER_URL", "database-owner-url", "Postgres URL of the role that owns the tables, which migrations run as; unset: the role of TALLY_DATABASE_URL (privileges not enforced)", "",
			str(func(c *Config) *string { return &c.DatabaseOwnerURL })},
		{"TALLY_DATABASE_POOLED", "database-pooled", "true: TALLY_DATABASE_URL and TALLY_DATABASE_OWNER_URL go through a transaction-mode pooler such as PgBouncer (docs/operations.md)", "false",
			boolean(func(c *Config) *bool { return &c.DatabasePooled })},
		{"TALLY_DATABASE_DIRECT_URL", "database-direct-url", "Postgres URL past the pooler, as TALLY_DATABASE_URL's role, for what needs a session (River, notifications); unset with a pooled URL: they poll", "",
			str(func(c *Config) *string { return &c.DatabaseDirectURL })},
		{"TALLY_DATA_DIR", "data-dir", "embedded Postgres data and logs", DefaultDataDir,
			str(func(c *Config) *string { return &c.DataDir })},
		{"TALLY_EMBEDDED_WORKERS", "embedded-workers", "Citus workers beside the embedded cluster, which becomes their coordinator, in the data directory's citus/ (built by make citus; docs/running.md); 0: plain PostgreSQL", "0",
			integer(func(c *Config) *int { return &c.EmbeddedWorkers })},
		{"TALLY_LISTEN", "listen", "HTTP address", DefaultListen,
			str(func(c *Config) *string { return &c.Listen })},
		{"TALLY_LOG_FORMAT", "log-format", "log format: text or json (default: json for serve, text for dev and the operator commands)", DefaultLogFormat,
			str(func(c *Config) *string { return &c.LogFormat })},
		{"TALLY_LOG_LEVEL", "log-level", "log level: debug, info, warn or error", DefaultLogLevel,
			str(func(c *Config) *string { return &c.LogLevel })},
		{"TALLY_MAINTENANCE_INTERVAL", "maintenance-interval", "how often the outbox maintenance pass runs", short(DefaultMaintenanceInterval),
			dur(func(c *Config) *time.Duration { return &c.MaintenanceInterval })},
		{"TALLY_SHUTDOWN_TIMEOUT", "shutdown-timeout", "how long a graceful shutdown may take", short(DefaultShutdownTimeout),
			dur(func(c *Config) *time.Duration { return &c.ShutdownTimeout })},
	}
}

// outboxSettings are the outbox's knobs (outbox.Config), but the claim
// scan.
func outboxSettings() []setting {
	return []setting{
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
	}
}

// exportSettings say where usage goes — Stripe's key, hosts and account,
// the webhook secret, the default exporter — and how it is staged, with the
// admin token ensured at start.
func exportSettings() []setting {
	return []setting{
		{"STRIPE_API_KEY", "stripe-api-key", "Stripe secret or restricted key; its prefix gives the mode; a restricted key (rk_…) cannot use the v2 stream exporter or error reports; unset: export stalls visibly (prefer the variable: a flag shows in the process list)", "",
			str(func(c *Config) *string { return &c.StripeAPIKey })},
		{"STRIPE_API_BASE", "stripe-api-base", "Stripe API base URL (stripe-mock or the simulator in tests)", stripeapi.DefaultAPIBase,
			str(func(c *Config) *string { return &c.StripeAPIBase })},
		{"STRIPE_METER_EVENTS_BASE", "stripe-meter-events-base", "base URL of Stripe's v2 meter event stream host (the simulator in tests)", stripeapi.DefaultMeterEventsBase,
			str(func(c *Config) *string { return &c.StripeMeterEventsBase })},
		{"STRIPE_ACCOUNT", "stripe-account", "destination account (Connect); unset: the key's own account", "",
			str(func(c *Config) *string { return &c.StripeAccount })},
		{"STRIPE_WEBHOOK_SECRET", "stripe-webhook-secret", "signing secrets of the event destinations posting to /v1/stripe/events (whsec_…, separated by commas: a thin and a snapshot destination each have one); unset: it answers 503", "",
			str(func(c *Config) *string { return &c.StripeWebhookSecret })},
		{"TALLY_EXPORTER", "exporter", "the exporter of features whose mapping names none: stripe_meter_events (v1) or stripe_meter_event_stream (v2)", exporter.StripeMeterEvents,
			str(func(c *Config) *string { return &c.Exporter })},
		{"TALLY_ADMIN_TOKEN", "admin-token", "if set, seeds an admin token with this value at start (at least 32 characters, strong; a new value revokes the previous one, a revoked value is never revived)", "",
			str(func(c *Config) *string { return &c.AdminToken })},
		{"TALLY_STAGE_INTERVAL", "stage-interval", "how often windows are staged", short(meter.DefaultStageInterval),
			dur(func(c *Config) *time.Duration { return &c.StageInterval })},
		{"TALLY_STAGE_WORKERS", "stage-workers", "how many staging passes run at once, each over its own range of tenants (0: the node's cores)", "0",
			integer(func(c *Config) *int { return &c.StageWorkers })},
		{"TALLY_WINDOW_GRACE", "window-grace", "how long after its end a window waits for late usage", short(meter.DefaultGrace),
			dur(func(c *Config) *time.Duration { return &c.WindowGrace })},
		{"TALLY_INVOICE_GRACE", "invoice-grace", "how long after a billing period ends Stripe keeps its invoice open to usage (Stripe's invoice finalization grace period: 1h by default, at most 72h; a tenant mapping's invoice_grace overrides it); usage staged later is late", short(meter.DefaultInvoiceGrace),
			dur(func(c *Config) *time.Duration { return &c.InvoiceGrace })},
		{"TALLY_LATE_USAGE", "late-usage", "what staging does with late usage: quarantine (as period_closed, for finance to requeue knowingly) or send (Stripe records it on no finalized invoice)", string(meter.DefaultLateUsage),
			str(func(c *Config) *string { return &c.LateUsage })},
		{"TALLY_INVOICE_HOLD", "invoice-hold", "hold a subscription's draft invoice (auto_advance false) while usage of its period is quarantined, uncertain or still on its way, until the period is complete or TALLY_INVOICE_HOLD_MAX", "false",
			boolean(func(c *Config) *bool { return &c.InvoiceHold })},
		{"TALLY_INVOICE_HOLD_MAX", "invoice-hold-max", "the longest a draft invoice is held, then released incomplete and alerted (at most 71h, below the 72h Stripe documents as its longest delay of a finalization)", short(invoices.DefaultHoldMax),
			dur(func(c *Config) *time.Duration { return &c.InvoiceHoldMax })},
	}
}

// deliverySettings size the deliverers and pace them: the request timeout,
// the rates of the destination's budget, the sends in flight.
func deliverySettings() []setting {
	return []setting{
		{"TALLY_STRIPE_TIMEOUT", "stripe-timeout", "how long one call to Stripe may take", short(exporter.DefaultRequestTimeout),
			dur(func(c *Config) *time.Duration { return &c.StripeTimeout })},
		{"TALLY_RATE_LIVE", "rate-live", "calls a second to a live-mode destination (Stripe allows 1,000)", strconv.Itoa(exporter.DefaultLiveRate),
			float(func(c *Config) *float64 { return &c.RateLive })},
		{"TALLY_RATE_TEST", "rate-test", "calls a second to a test-mode destination (Stripe allows 25)", strconv.Itoa(exporter.DefaultTestRate),
			float(func(c *Config) *float64 { return &c.RateTest })},
		{"TALLY_STREAM_RATE_LIVE", "stream-rate-live", "v2 stream events a second (a request of n events counts n) to a live-mode destination (Stripe's pages say 10,000 requests and 10,000 events: raise it only if Stripe confirms requests)", strconv.Itoa(exporter.DefaultStreamLiveRate),
			float(func(c *Config) *float64 { return &c.StreamRateLive })},
		{"TALLY_STREAM_RATE_TEST", "stream-rate-test", "v2 stream events a second to a test-mode destination (its requests count toward the basic limit)", strconv.Itoa(exporter.DefaultStreamTestRate),
			float(func(c *Config) *float64 { return &c.StreamRateTest })},
		{"TALLY_ADJUST_RATE_LIVE", "adjust-rate-live", "meter event adjustments (cancellations) a second to a live-mode destination (Stripe allows an endpoint 25, inside the basic limit)", strconv.Itoa(exporter.DefaultAdjustLiveRate),
			float(func(c *Config) *float64 { return &c.AdjustRateLive })},
		{"TALLY_ADJUST_RATE_TEST", "adjust-rate-test", "meter event adjustments a second to a test-mode destination (inside the basic limit)", strconv.Itoa(exporter.DefaultAdjustTestRate),
			float(func(c *Config) *float64 { return &c.AdjustRateTest })},
		{"TALLY_BASIC_RATE_LIVE", "basic-rate-live", "calls a second, all kinds together, to a live-mode account's basic limit (Stripe allows 100; live meter events of the key's own account do not count)", strconv.Itoa(exporter.DefaultBasicLiveRate),
			float(func(c *Config) *float64 { return &c.BasicRateLive })},
		{"TALLY_BASIC_RATE_TEST", "basic-rate-test", "calls a second, all kinds together, meter events included, to a test-mode account (Stripe allows 25)", strconv.Itoa(exporter.DefaultBasicTestRate),
			float(func(c *Config) *float64 { return &c.BasicRateTest })},
		{"TALLY_STREAM_INFLIGHT", "stream-inflight", "the most v2 stream events in flight on this node", strconv.Itoa(exporter.DefaultStreamInFlight),
			integer(func(c *Config) *int { return &c.StreamInFlight })},
		{"TALLY_DELIVERY_WORKERS", "delivery-workers", "the v1 deliverer's claim loops on this node (the v2 stream's: TALLY_STREAM_WORKERS)", strconv.Itoa(exporter.DefaultWorkers),
			integer(func(c *Config) *int { return &c.DeliveryWorkers })},
		{"TALLY_DELIVERY_BATCH", "delivery-batch", "the most items one claim of the v1 deliverer takes (the v2 stream's: TALLY_STREAM_BATCH)", strconv.Itoa(exporter.DefaultBatch),
			integer(func(c *Config) *int { return &c.DeliveryBatch })},
		{"TALLY_DELIVERY_INFLIGHT", "delivery-inflight", "the most v1 sends in flight on this node (the v2 stream's: TALLY_STREAM_INFLIGHT)", strconv.Itoa(exporter.DefaultInFlight),
			integer(func(c *Config) *int { return &c.DeliveryInFlight })},
		{"TALLY_POLL_INTERVAL", "poll-interval", "how often idle deliverers look for due work without a notification", short(exporter.DefaultPollInterval),
			dur(func(c *Config) *time.Duration { return &c.PollInterval })},
	}
}

// reconcileSettings say when reconciliation runs and what it compares.
func reconcileSettings() []setting {
	return []setting{
		{"TALLY_RECONCILE_SCHEDULE", "reconcile-schedule", "when the periodic reconcile run starts: cron syntax in UTC, or off", reconcile.DefaultSchedule,
			str(func(c *Config) *string { return &c.ReconcileSchedule })},
		{"TALLY_RECONCILE_SETTLE", "reconcile-settle", "how long an accepted item waits before reconciliation compares it", short(reconcile.DefaultSettle),
			dur(func(c *Config) *time.Duration { return &c.ReconcileSettle })},
		{"TALLY_REPORTS_INTERVAL", "reports-interval", "how often Stripe's error reports of every account Tally exports to are listed (GET /v2/core/events), to record those the event destination did not deliver; also once at start", short(reconcile.DefaultBackfillInterval),
			dur(func(c *Config) *time.Duration { return &c.ReportsInterval })},
	}
}

// short is a duration as the help prints these defaults: without a zero
// tail of minutes or seconds (2m, not 2m0s; 2h, not 2h0m0s). The outbox's
// defaults print in full (2m0s).
func short(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// dur, integer, float, boolean and str are the setters of a setting of each kind:
// they parse the value into the field dst points to.
func dur(dst func(*Config) *time.Duration) func(*Config, string) error {
	return func(c *Config, v string) error {
		d, err := time.ParseDuration(v)
		if err != nil {
			return fmt.Errorf("not a duration (e.g. 30s, 5m, 20h): %q", v)
		}
		*dst(c) = d
		return nil
	}
}

func integer(dst func(*Config) *int) func(*Config, string) error {
	return func(c *Config, v string) error {
		n, err := strconv.Atoi(v)
		if err != nil {
			return fmt.Errorf("not a whole number: %q", v)
		}
		*dst(c) = n
		return nil
	}
}

func float(dst func(*Config) *float64) func(*Config, string) error {
	return func(c *Config, v string) error {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return fmt.Errorf("not a number: %q", v)
		}
		*dst(c) = f
		return nil
	}
}

func boolean(dst func(*Config) *bool) func(*Config, string) error {
	return func(c *Config, v string) error {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return fmt.Errorf("not true or false: %q", v)
		}
		*dst(c) = b
		return nil
	}
}

func str(dst func(*Config) *string) func(*Config, string) error {
	return func(c *Config, v string) error { *dst(c) = v; return nil }
}
