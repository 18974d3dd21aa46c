package config

import (
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/tallymeter/tally/meter"

	"github.com/tallymeter/tally/outbox"
)

// The defaults of the node's own settings; every other setting's default
// is a constant of the package that owns it.
const (
	// DefaultDataDir holds the embedded cluster (TALLY_DATA_DIR).
	DefaultDataDir = ".tally"
	// DefaultListen is the HTTP address (TALLY_LISTEN).
	DefaultListen = "127.0.0.1:8080"
	// DefaultLogFormat is the log format of serve (TALLY_LOG_FORMAT); the
	// other commands log text unless it is set.
	DefaultLogFormat = "json"
	// DefaultLogLevel is the log level (TALLY_LOG_LEVEL).
	DefaultLogLevel = "info"
	// DefaultMaintenanceInterval is how often the outbox maintenance pass
	// runs (TALLY_MAINTENANCE_INTERVAL).
	DefaultMaintenanceInterval = 15 * time.Second
	// DefaultShutdownTimeout bounds a graceful shutdown
	// (TALLY_SHUTDOWN_TIMEOUT).
	DefaultShutdownTimeout = 30 * time.Second
)

// Config is the service's configuration. Each field's default is named
// once, as a constant (settings says which).
type Config struct {
	// DatabaseURL is the Postgres URL; empty means the embedded cluster in
	// DataDir.
	DatabaseURL string
	// DatabaseOwnerURL is the Postgres URL of the role that owns the
	// tables: migrations run as it. Empty means DatabaseURL's role (one
	// role: the privileges of docs/security.md are then not enforced).
	DatabaseOwnerURL string
	// DatabasePooled says DatabaseURL and DatabaseOwnerURL reach Postgres
	// through a transaction-mode pooler (PgBouncer): statements describe
	// themselves instead of being prepared, the workload pools send no
	// startup parameters, and what needs a session uses DatabaseDirectURL
	// or polls. Defaults to false.
	DatabasePooled bool
	// DatabaseDirectURL reaches Postgres past the pooler, as DatabaseURL's
	// role: River's pool and the deliverers' LISTEN use it. Empty with
	// DatabasePooled: River runs poll-only and the deliverers poll.
	DatabaseDirectURL string
	// DataDir holds the embedded cluster's data and logs. Defaults to
	// DefaultDataDir.
	DataDir string
	// EmbeddedWorkers is how many Citus workers the embedded cluster runs
	// beside its coordinator, in DataDir/citus (docs/running.md); 0, the
	// default, is a plain PostgreSQL server in DataDir. Not allowed with
	// DatabaseURL.
	EmbeddedWorkers int
	// ArchiveURL is where tally archive writes: a directory or
	// s3://bucket/prefix. Empty means the directory "archive" in DataDir.
	ArchiveURL string
	// ArchiveEndpoint, ArchiveRegion, ArchiveAccessKey and
	// ArchiveSecretKey reach an s3:// ArchiveURL; empty means Amazon S3,
	// the region the server names, and the AWS_* variables.
	ArchiveEndpoint, ArchiveRegion, ArchiveAccessKey, ArchiveSecretKey string
	// Listen is the HTTP address. Defaults to DefaultListen.
	Listen string
	// LogFormat is "text" or "json". Defaults to DefaultLogFormat (json);
	// the commands other than serve log text unless it is set.
	LogFormat string
	// LogLevel is debug, info, warn or error. Defaults to DefaultLogLevel.
	LogLevel string
	// MaintenanceInterval is how often the outbox maintenance pass runs.
	// Defaults to DefaultMaintenanceInterval.
	MaintenanceInterval time.Duration
	// ShutdownTimeout bounds a graceful shutdown. Defaults to
	// DefaultShutdownTimeout.
	ShutdownTimeout time.Duration
	// Outbox holds the outbox's knobs. Default to the outbox's Default…
	// constants.
	Outbox outbox.Config

	// StripeAPIKey is STRIPE_API_KEY; empty stalls export visibly.
	StripeAPIKey string
	// StripeAPIBase is STRIPE_API_BASE. Defaults to
	// stripeapi.DefaultAPIBase.
	StripeAPIBase string
	// StripeMeterEventsBase is STRIPE_METER_EVENTS_BASE, the v2 stream's
	// host. Defaults to stripeapi.DefaultMeterEventsBase.
	StripeMeterEventsBase string
	// StripeAccount is STRIPE_ACCOUNT; empty means the key's own account.
	StripeAccount string
	// StripeWebhookSecret is STRIPE_WEBHOOK_SECRET, the signing secret of
	// the event destination that posts to /v1/stripe/events.
	StripeWebhookSecret string
	// Exporter is TALLY_EXPORTER. Defaults to exporter.StripeMeterEvents.
	Exporter string
	// AdminToken is TALLY_ADMIN_TOKEN: an admin token with this value is
	// ensured at start.
	AdminToken string
	// StageInterval is how often windows are staged. Defaults to
	// meter.DefaultStageInterval.
	StageInterval time.Duration
	// StageWorkers is how many staging passes run at once, each over its
	// range of tenants (meter.StageWorkers); 0, the default, means the
	// node's cores.
	StageWorkers int
	// WindowGrace is how long after its end a window waits for late usage.
	// Defaults to meter.DefaultGrace.
	WindowGrace time.Duration
	// InvoiceGrace is how long after a billing period ends its invoice
	// stays open to usage (Stripe's invoice finalization grace period).
	// Defaults to meter.DefaultInvoiceGrace; at most meter.MaxInvoiceGrace.
	InvoiceGrace time.Duration
	// LateUsage is what staging does with usage staged after its period's
	// invoice closed: "quarantine" or "send". Defaults to
	// meter.DefaultLateUsage.
	LateUsage string
	// InvoiceHold is whether the invoice gate holds a draft whose period is
	// incomplete (TALLY_INVOICE_HOLD).
	InvoiceHold bool
	// InvoiceHoldMax bounds a hold (TALLY_INVOICE_HOLD_MAX); at most
	// invoices.MaxHoldMax.
	InvoiceHoldMax time.Duration

	// StripeTimeout bounds one call to Stripe. Defaults to
	// exporter.DefaultRequestTimeout.
	StripeTimeout time.Duration
	// RateLive and RateTest are the destination's calls a second in live and
	// test mode. Default to exporter.DefaultLiveRate and DefaultTestRate.
	RateLive, RateTest float64
	// StreamRateLive and StreamRateTest are the v2 stream's events a second
	// (a request of n events counts n) in live and test mode. Default to
	// exporter.DefaultStreamLiveRate and DefaultStreamTestRate.
	StreamRateLive, StreamRateTest float64
	// AdjustRateLive and AdjustRateTest are meter event adjustments
	// (cancellations) a second in live and test mode, inside the basic
	// limit. Default to exporter.DefaultAdjustLiveRate and
	// DefaultAdjustTestRate.
	AdjustRateLive, AdjustRateTest float64
	// BasicRateLive and BasicRateTest are Tally's share of Stripe's basic
	// rate limit of the destination account (100 and 25 operations a
	// second), which every call counts toward: in test mode meter events
	// and stream requests too, in live mode everything else (and meter
	// events of a connected account). Default to
	// exporter.DefaultBasicLiveRate and DefaultBasicTestRate.
	BasicRateLive, BasicRateTest float64
	// StreamInFlight bounds the stream's events in flight on a node.
	// Defaults to exporter.DefaultStreamInFlight.
	StreamInFlight int
	// DeliveryWorkers, DeliveryBatch and DeliveryInFlight size the v1
	// deliverer: claim loops, items per claim, sends in flight (the
	// stream's are Stream and StreamInFlight). Default to
	// exporter.DefaultWorkers, DefaultBatch and DefaultInFlight.
	DeliveryWorkers, DeliveryBatch, DeliveryInFlight int
	// PollInterval is how often idle deliverers look for due work when no
	// notification wakes them. Defaults to exporter.DefaultPollInterval.
	PollInterval time.Duration

	// ReconcileSchedule is when the periodic reconcile run starts, in cron
	// syntax (UTC), or "off". Defaults to reconcile.DefaultSchedule.
	ReconcileSchedule string
	// ReconcileSettle is how long an accepted item waits before a run
	// compares it. Defaults to reconcile.DefaultSettle.
	ReconcileSettle time.Duration
	// ReportsInterval is how often Stripe's error reports are listed
	// (GET /v2/core/events) to record those the event destination did
	// not deliver. Defaults to reconcile.DefaultBackfillInterval.
	ReportsInterval time.Duration

	// TLS is how the node meets its clients: its certificate, or the
	// reverse proxies it believes.
	TLS TLSConfig
	// Console is the web console's sessions (settings_console.go).
	Console ConsoleConfig
	// Quota bounds what one token may post (TALLY_INGEST_…).
	Quota QuotaConfig
	// GroupCommit is how concurrent small ingests share transactions
	// (settings_ingest_group_commit.go). Defaults to meter's
	// DefaultGroupCommit… constants.
	GroupCommit meter.GroupCommit
	// Stream sizes the v2 stream's deliverer where it differs from v1's
	// (settings_stream.go). Defaults to exporter's DefaultStream…
	// constants.
	Stream StreamConfig
	// Pools sizes serve's connection pools, one per workload, and bounds
	// its reads.
	Pools PoolsConfig
	// Dev says which settings came from tally dev's DevEnvFile (devenv.go).
	Dev DevConfig
	// OldNames lists the settings given by an old name, which still work:
	// the command logs a warning for each.
	OldNames []OldName
}

// OldName is a setting given by its old name (a variable or a --flag),
// with the name to use instead.
type OldName struct{ Old, New string }

// Flags registers every setting on fs and returns a function that, after
// fs.Parse, builds and validates the Config: flag values win over the
// environment (read with getenv), which wins over the defaults. It never
// reads tally dev's DevEnvFile: a service must never send to a simulator
// it found on disk (OperatorFlags does, for the operator commands).
func Flags(fs *flag.FlagSet, getenv func(string) string) func() (Config, error) {
	return flags(fs, getenv, false)
}

// OperatorFlags is Flags for an operator command run beside tally dev: the
// environment wins over dev's DevEnvFile in the data directory, which wins
// over the defaults.
func OperatorFlags(fs *flag.FlagSet, getenv func(string) string) func() (Config, error) {
	return flags(fs, getenv, true)
}

func flags(fs *flag.FlagSet, getenv func(string) string, devEnv bool) func() (Config, error) {
	all := settings()
	values := make([]string, len(all))
	given := make([]bool, len(all))
	for i, s := range all {
		usage := fmt.Sprintf("%s (env %s)", s.usage, s.env)
		if slices.Contains(secretSettings, s.env) {
			usage += fmt.Sprintf(" (or a file holding it: env %s_FILE)", s.env)
		}
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
		getenv, dev, err := devEnvFor(devEnv, all, values, given, getenv)
		if err != nil {
			errs = append(errs, err)
		}
		c.Dev = dev
		chosen := map[string]bool{} // the settings given by their current names
		for i, s := range all {
			v, from := s.def, "default"
			if e := getenv(s.env); e != "" {
				v, from = e, s.env
			}
			if given[i] {
				v, from = values[i], "--"+s.flag
			}
			if fv, ok, err := secretFromFile(getenv, s.env, from); err != nil {
				errs = append(errs, err)
				continue
			} else if ok {
				v, from = fv, s.env+"_FILE"
			}
			if r, old := renamedFrom(s.env); old {
				if from == "default" {
					continue
				}
				c.OldNames = append(c.OldNames, newNameOf(all, r, from))
				if chosen[r.to] {
					continue
				}
			}
			chosen[s.env] = from != "default"
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

// renamedFrom is the rename of the setting named env, if env is an old
// name.
func renamedFrom(env string) (renamedSetting, bool) {
	i := slices.IndexFunc(renamedSettings, func(r renamedSetting) bool { return r.env == env })
	if i < 0 {
		return renamedSetting{}, false
	}
	return renamedSettings[i], true
}

// newNameOf is the OldName of a setting renamed r, given as from: its old
// variable or its old --flag.
func newNameOf(all []setting, r renamedSetting, from string) OldName {
	if from == r.env {
		return OldName{Old: r.env, New: r.to}
	}
	i := slices.IndexFunc(all, func(s setting) bool { return s.env == r.to })
	return OldName{Old: from, New: "--" + all[i].flag}
}

// RestrictedKey reports whether key is a Stripe restricted key (rk_…).
// Stripe's v2 API takes only secret keys (sk_…): "You can only access APIs
// in the /v2 namespace with secret keys"
// (https://docs.stripe.com/api-v2-overview, "Key differences between the v1
// and v2 namespace"). With a restricted key, stream sessions (POST
// /v2/billing/meter_event_session) and error reports (GET
// /v2/core/events/{id}) fail.
func RestrictedKey(key string) bool { return strings.HasPrefix(key, "rk_") }
