package config_test

import (
	"flag"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

func load(t *testing.T, env map[string]string, args ...string) (config.Config, error) {
	t.Helper()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	build := config.Flags(fs, func(k string) string { return env[k] })
	require.NoError(t, fs.Parse(args))
	return build()
}

func TestDefaults(t *testing.T) {
	t.Parallel()
	c, err := load(t, nil)
	require.NoError(t, err)
	abs, _ := filepath.Abs(".tally")
	require.Equal(t, "", c.DatabaseURL)
	require.Equal(t, abs, c.DataDir)
	require.Equal(t, "127.0.0.1:8080", c.Listen)
	require.Equal(t, 15*time.Second, c.MaintenanceInterval)
	require.Equal(t, outbox.Config{
		Lease: 2 * time.Minute, BackoffBase: 5 * time.Second, BackoffCap: 900 * time.Second, MaxAttempts: 20,
		RateLimitDelay: 30 * time.Second, Horizon: 20 * time.Hour, ClaimScan: 4,
	}, c.Outbox)
	require.Equal(t, "0 2 * * *", c.ReconcileSchedule)
	require.Equal(t, 2*time.Hour, c.ReconcileSettle)
}

// Every default is its owner's constant, written once: config's table
// refers to it.
func TestDefaultsAreTheOwnersConstants(t *testing.T) {
	t.Parallel()
	c, err := load(t, nil)
	require.NoError(t, err)
	abs, _ := filepath.Abs(config.DefaultDataDir)
	require.Equal(t, config.Config{
		DataDir: abs, Listen: config.DefaultListen, LogFormat: config.DefaultLogFormat, LogLevel: config.DefaultLogLevel,
		MaintenanceInterval: config.DefaultMaintenanceInterval, ShutdownTimeout: config.DefaultShutdownTimeout,
		Outbox: outbox.Config{Lease: outbox.DefaultLease, BackoffBase: outbox.DefaultBackoffBase, BackoffCap: outbox.DefaultBackoffCap,
			MaxAttempts: outbox.DefaultMaxAttempts, RateLimitDelay: outbox.DefaultRateLimitDelay, Horizon: outbox.DefaultHorizon,
			ClaimScan: outbox.DefaultClaimScan},
		StripeAPIBase: stripeapi.DefaultAPIBase, StripeMeterEventsBase: stripeapi.DefaultMeterEventsBase,
		Exporter: exporter.StripeMeterEvents, StageInterval: meter.DefaultStageInterval, WindowGrace: meter.DefaultGrace,
		InvoiceGrace: meter.DefaultInvoiceGrace, LateUsage: string(meter.DefaultLateUsage), InvoiceHoldMax: invoices.DefaultHoldMax,
		StripeTimeout: exporter.DefaultRequestTimeout,
		RateLive:      exporter.DefaultLiveRate, RateTest: exporter.DefaultTestRate,
		StreamRateLive: exporter.DefaultStreamLiveRate, StreamRateTest: exporter.DefaultStreamTestRate,
		AdjustRateLive: exporter.DefaultAdjustLiveRate, AdjustRateTest: exporter.DefaultAdjustTestRate,
		BasicRateLive: exporter.DefaultBasicLiveRate, BasicRateTest: exporter.DefaultBasicTestRate,
		StreamInFlight: exporter.DefaultStreamInFlight, DeliveryWorkers: exporter.DefaultWorkers,
		DeliveryBatch: exporter.DefaultBatch, DeliveryInFlight: exporter.DefaultInFlight, PollInterval: exporter.DefaultPollInterval,
		ReconcileSchedule: reconcile.DefaultSchedule, ReconcileSettle: reconcile.DefaultSettle,
		ReportsInterval: reconcile.DefaultBackfillInterval,
		Console:         config.ConsoleConfig{SessionTTL: console.DefaultSessionTTL, SessionIdle: console.DefaultSessionIdle},
		Quota:           config.QuotaConfig{Ingest: api.IngestQuota{EventsPerSecond: api.DefaultIngestEventsPerSecond, EventsBurst: api.DefaultIngestEventsBurst, RequestsPerSecond: api.DefaultIngestRequestsPerSecond, MaxEvents: meter.MaxEvents}, MaxQuarantined: meter.DefaultMaxQuarantined},
		Pools:           config.PoolsConfig{Ingest: config.DefaultPoolIngest, Export: config.DefaultPoolExport, River: config.DefaultPoolRiver, Reads: config.DefaultPoolReads, ReadTimeout: config.DefaultReadTimeout, ReadsPerToken: config.DefaultReadsPerToken, ReportMaxAge: config.DefaultReportMaxAge, ReportTimeout: quarantine.DefaultReportTimeout},
		GroupCommit:     meter.GroupCommit{Wait: meter.DefaultGroupCommitWait, MaxEvents: meter.DefaultGroupCommitEvents, MaxBytes: meter.DefaultGroupCommitBytes, Commits: meter.DefaultGroupCommitCommits},
		Stream:          config.StreamConfig{Workers: exporter.DefaultStreamWorkers, Batch: exporter.DefaultStreamBatch, RecordBatch: exporter.DefaultStreamRecordBatch, Recorders: exporter.DefaultStreamRecorders},
	}, c)
}

// The help prints a default as an operator writes it (2m, 2h), as it always
// has; the outbox's print in full (2m0s).
func TestHelpPrintsTheDefaults(t *testing.T) {
	t.Parallel()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	var help strings.Builder
	fs.SetOutput(&help)
	config.Flags(fs, func(string) string { return "" })
	fs.PrintDefaults()
	for _, want := range []string{
		`(env TALLY_WINDOW_GRACE) (default "2m")`, `(env TALLY_RECONCILE_SETTLE) (default "2h")`,
		`(env TALLY_INVOICE_GRACE) (default "1h")`, `(env TALLY_LATE_USAGE) (default "quarantine")`,
		`(env TALLY_STAGE_INTERVAL) (default "10s")`, `(env TALLY_POLL_INTERVAL) (default "1s")`,
		`(env TALLY_STRIPE_TIMEOUT) (default "10s")`, `(env TALLY_MAINTENANCE_INTERVAL) (default "15s")`,
		`(env TALLY_SHUTDOWN_TIMEOUT) (default "30s")`, `(env TALLY_OUTBOX_LEASE) (default "2m0s")`,
		`(env TALLY_OUTBOX_HORIZON) (default "20h0m0s")`, `(env TALLY_STREAM_RATE_LIVE) (default "9000")`,
		`(env TALLY_STREAM_INFLIGHT) (default "2000")`, `(env TALLY_DELIVERY_INFLIGHT) (default "64")`,
		`(env TALLY_RECONCILE_SCHEDULE) (default "0 2 * * *")`, `(env TALLY_LISTEN) (default "127.0.0.1:8080")`,
	} {
		require.Contains(t, help.String(), want)
	}
}

func TestReconcileSchedule(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ value, wantErr string }{
		{"0 2 * * *", ""}, {"*/15 * * * *", ""}, {"off", ""}, {"@daily", ""},
		{"nightly", "TALLY_RECONCILE_SCHEDULE must be a cron schedule"}, {"0 2 * *", "TALLY_RECONCILE_SCHEDULE"},
	} {
		_, err := load(t, map[string]string{"TALLY_RECONCILE_SCHEDULE": tc.value})
		if tc.wantErr == "" {
			require.NoError(t, err, tc.value)
		} else {
			require.ErrorContains(t, err, tc.wantErr, tc.value)
		}
	}
	_, err := load(t, map[string]string{"TALLY_RECONCILE_SETTLE": "-1h"})
	require.ErrorContains(t, err, "TALLY_RECONCILE_SETTLE must not be negative")
	_, err = load(t, map[string]string{"TALLY_REPORTS_INTERVAL": "0s"})
	require.ErrorContains(t, err, "TALLY_REPORTS_INTERVAL must be at least 1s")
}

func TestFlagBeatsEnvBeatsDefault(t *testing.T) {
	t.Parallel()
	env := map[string]string{"TALLY_LISTEN": "127.0.0.1:9000", "TALLY_OUTBOX_HORIZON": "10h", "TALLY_OUTBOX_MAX_ATTEMPTS": "7"}
	c, err := load(t, env, "--outbox-horizon", "12h")
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1:9000", c.Listen)
	require.Equal(t, 12*time.Hour, c.Outbox.Horizon)
	require.Equal(t, 7, c.Outbox.MaxAttempts)
}

func TestEveryProblemReportedAtOnce(t *testing.T) {
	t.Parallel()
	_, err := load(t, map[string]string{"TALLY_OUTBOX_LEASE": "soon", "TALLY_LISTEN": "nowhere"},
		"--log-level", "loud", "--outbox-horizon", "30h", "--maintenance-interval", "0s")
	require.Error(t, err)
	for _, want := range []string{
		"TALLY_OUTBOX_LEASE: not a duration", "TALLY_LISTEN must be host:port", "TALLY_LOG_LEVEL must be",
		"must be below the provider's dedup window", "TALLY_MAINTENANCE_INTERVAL must be positive",
	} {
		require.ErrorContains(t, err, want)
	}
}

func TestExporterChoice(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ value, wantErr string }{
		{"stripe_meter_events", ""},
		{"stripe_meter_event_stream", ""},
		{"kafka", "TALLY_EXPORTER must be"},
	} {
		_, err := load(t, map[string]string{"TALLY_EXPORTER": tc.value})
		if tc.wantErr == "" {
			require.NoError(t, err, tc.value)
		} else {
			require.ErrorContains(t, err, tc.wantErr, tc.value)
		}
	}
}

// Stripe's v2 API takes only secret keys: a restricted key with the stream
// exporter or with error reports (the webhook secret) is refused at start,
// with the other problems; a restricted key without them, and a secret key
// with them, are fine.
func TestRestrictedKeyRefusedWhereV2IsNeeded(t *testing.T) {
	t.Parallel()
	const rk, sk = "rk_test_abc123", "sk_test_abc123"
	for _, tc := range []struct {
		name    string
		env     map[string]string
		wantErr []string
	}{
		{"restricted key, stream exporter", map[string]string{"STRIPE_API_KEY": rk, "TALLY_EXPORTER": "stripe_meter_event_stream"},
			[]string{"STRIPE_API_KEY is a restricted key (rk_…)", "only secret keys", "TALLY_EXPORTER=stripe_meter_event_stream"}},
		{"restricted key, webhook secret", map[string]string{"STRIPE_API_KEY": rk, "STRIPE_WEBHOOK_SECRET": "whsec_x"},
			[]string{"STRIPE_API_KEY is a restricted key (rk_…)", "STRIPE_WEBHOOK_SECRET", "GET /v2/core/events"}},
		{"restricted live key, both, and another problem", map[string]string{"STRIPE_API_KEY": "rk_live_abc123",
			"TALLY_EXPORTER": "stripe_meter_event_stream", "STRIPE_WEBHOOK_SECRET": "whsec_x", "TALLY_LISTEN": "nowhere"},
			[]string{"TALLY_EXPORTER=stripe_meter_event_stream", "GET /v2/core/events", "TALLY_LISTEN must be host:port"}},
		{"restricted key, v1 only", map[string]string{"STRIPE_API_KEY": rk, "TALLY_EXPORTER": "stripe_meter_events"}, nil},
		{"secret key, stream and webhook", map[string]string{"STRIPE_API_KEY": sk, "TALLY_EXPORTER": "stripe_meter_event_stream",
			"STRIPE_WEBHOOK_SECRET": "whsec_x"}, nil},
	} {
		_, err := load(t, tc.env)
		if tc.wantErr == nil {
			require.NoError(t, err, tc.name)
			continue
		}
		for _, want := range tc.wantErr {
			require.ErrorContains(t, err, want, tc.name)
		}
		require.NotContains(t, err.Error(), "abc123", "%s: the key is never echoed", tc.name)
	}
	require.True(t, config.RestrictedKey("rk_live_x"))
	require.False(t, config.RestrictedKey("sk_live_x"))
	require.False(t, config.RestrictedKey(""))
}

func TestLateUsageSettings(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env     map[string]string
		wantErr string
	}{
		{map[string]string{"TALLY_INVOICE_GRACE": "72h", "TALLY_LATE_USAGE": "send"}, ""},
		{map[string]string{"TALLY_INVOICE_GRACE": "0s"}, ""},
		{map[string]string{"TALLY_INVOICE_GRACE": "73h"}, "TALLY_INVOICE_GRACE must be 0s to 72h"},
		{map[string]string{"TALLY_INVOICE_GRACE": "-1m"}, "TALLY_INVOICE_GRACE must be 0s to 72h"},
		{map[string]string{"TALLY_INVOICE_GRACE": "1.5s"}, "in whole seconds"},
		{map[string]string{"TALLY_LATE_USAGE": "drop"}, `TALLY_LATE_USAGE must be quarantine or send, got "drop"`},
		{map[string]string{"TALLY_INVOICE_HOLD": "true", "TALLY_INVOICE_HOLD_MAX": "71h"}, ""},
		{map[string]string{"TALLY_INVOICE_HOLD_MAX": "72h"}, "TALLY_INVOICE_HOLD_MAX must be more than 0 and at most 71h"},
		{map[string]string{"TALLY_INVOICE_HOLD_MAX": "0s"}, "TALLY_INVOICE_HOLD_MAX must be more than 0"},
	} {
		c, err := load(t, tc.env)
		if tc.wantErr != "" {
			require.ErrorContains(t, err, tc.wantErr, tc.env)
			continue
		}
		require.NoError(t, err, tc.env)
		if v, ok := tc.env["TALLY_LATE_USAGE"]; ok {
			require.Equal(t, v, c.LateUsage)
		}
	}
}

// A pooled database needs a URL (the embedded cluster has no pooler), and a
// direct URL is only for a pooled one.
func TestPooledDatabaseSettings(t *testing.T) {
	t.Parallel()
	const url = "postgres://u@pgbouncer:6432/tally"
	for _, tc := range []struct {
		env     map[string]string
		wantErr string
	}{
		{map[string]string{"TALLY_DATABASE_URL": url, "TALLY_DATABASE_POOLED": "true"}, ""},
		{map[string]string{"TALLY_DATABASE_URL": url, "TALLY_DATABASE_POOLED": "true", "TALLY_DATABASE_DIRECT_URL": "postgres://u@db/tally"}, ""},
		{map[string]string{"TALLY_DATABASE_POOLED": "true"}, "need TALLY_DATABASE_URL"},
		{map[string]string{"TALLY_DATABASE_URL": url, "TALLY_DATABASE_POOLED": "yes please"}, "TALLY_DATABASE_POOLED: not true or false"},
		{map[string]string{"TALLY_DATABASE_URL": url, "TALLY_DATABASE_DIRECT_URL": "postgres://u@db/tally"}, "set TALLY_DATABASE_POOLED=true"},
	} {
		cfg, err := load(t, tc.env)
		if tc.wantErr == "" {
			require.NoError(t, err, "%v", tc.env)
			require.True(t, cfg.DatabasePooled)
		} else {
			require.ErrorContains(t, err, tc.wantErr, "%v", tc.env)
		}
	}
}

func TestEmbeddedWorkers(t *testing.T) {
	t.Parallel()
	cfg, err := load(t, nil)
	require.NoError(t, err)
	require.Zero(t, cfg.EmbeddedWorkers, "a plain embedded cluster by default")
	cfg, err = load(t, map[string]string{"TALLY_EMBEDDED_WORKERS": "2"})
	require.NoError(t, err)
	require.Equal(t, 2, cfg.EmbeddedWorkers)
	_, err = load(t, map[string]string{"TALLY_EMBEDDED_WORKERS": "-1"})
	require.ErrorContains(t, err, "TALLY_EMBEDDED_WORKERS must not be negative")
	_, err = load(t, map[string]string{"TALLY_EMBEDDED_WORKERS": "2", "TALLY_DATABASE_URL": "postgres://u@db/tally"})
	require.ErrorContains(t, err, "TALLY_EMBEDDED_WORKERS is for the embedded cluster")
}
