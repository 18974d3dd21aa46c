package config

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/robfig/cron/v3"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// restrictedKeyProblems are the settings that need Stripe's v2 API while
// STRIPE_API_KEY is a restricted key: none when it is not.
func (c *Config) restrictedKeyProblems() []error {
	if !RestrictedKey(c.StripeAPIKey) {
		return nil
	}
	const why = "STRIPE_API_KEY is a restricted key (rk_…) and Stripe's v2 API takes only secret keys (sk_…): "
	var errs []error
	if c.Exporter == exporter.StripeMeterEventStream {
		errs = append(errs, errors.New(why+"TALLY_EXPORTER=stripe_meter_event_stream sends through the v2 meter event stream; "+
			"use a secret key, or TALLY_EXPORTER=stripe_meter_events"))
	}
	if c.StripeWebhookSecret != "" {
		errs = append(errs, errors.New(why+"with STRIPE_WEBHOOK_SECRET set, Stripe's meter error reports are read with GET /v2/core/events; "+
			"use a secret key, or unset STRIPE_WEBHOOK_SECRET (error reports are then not received)"))
	}
	return errs
}

// validate checks the whole configuration and reports every problem, in
// the order of the settings' groups.
func (c *Config) validate() error {
	errs := slices.Concat(c.nodeProblems(), c.exportProblems(), c.deliveryProblems(), c.tlsProblems(), c.poolProblems())
	if c.ReconcileSchedule != "off" {
		if _, err := cron.ParseStandard(c.ReconcileSchedule); err != nil {
			errs = append(errs, fmt.Errorf("TALLY_RECONCILE_SCHEDULE must be a cron schedule (minute hour day month weekday) or off: %v", err))
		}
	}
	if c.ReconcileSettle < 0 {
		errs = append(errs, fmt.Errorf("TALLY_RECONCILE_SETTLE must not be negative, got %s", c.ReconcileSettle))
	}
	if c.ReportsInterval < time.Second {
		errs = append(errs, fmt.Errorf("TALLY_REPORTS_INTERVAL must be at least 1s, got %s", c.ReportsInterval))
	}
	if c.PollInterval <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_POLL_INTERVAL must be positive, got %s", c.PollInterval))
	}
	if err := c.Outbox.Validate(); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, c.consoleProblems()...)
	errs = append(errs, c.quotaProblems()...)
	errs = append(errs, c.groupCommitProblems()...)
	errs = append(errs, c.streamProblems()...)
	return errors.Join(errs...)
}

// nodeProblems are those of the node's own settings; it makes DataDir
// absolute.
func (c *Config) nodeProblems() []error {
	var errs []error
	if c.DatabaseURL == "" && c.DataDir == "" {
		errs = append(errs, errors.New("TALLY_DATA_DIR must not be empty when TALLY_DATABASE_URL is unset"))
	}
	if (c.DatabasePooled || c.DatabaseDirectURL != "") && c.DatabaseURL == "" {
		errs = append(errs, errors.New("TALLY_DATABASE_POOLED and TALLY_DATABASE_DIRECT_URL need TALLY_DATABASE_URL (the embedded cluster has no pooler)"))
	}
	if c.DatabaseDirectURL != "" && !c.DatabasePooled {
		errs = append(errs, errors.New("TALLY_DATABASE_DIRECT_URL is for a pooled TALLY_DATABASE_URL: set TALLY_DATABASE_POOLED=true, or unset it"))
	}
	if c.EmbeddedWorkers < 0 {
		errs = append(errs, fmt.Errorf("TALLY_EMBEDDED_WORKERS must not be negative, got %d", c.EmbeddedWorkers))
	}
	if c.EmbeddedWorkers > 0 && c.DatabaseURL != "" {
		errs = append(errs, errors.New("TALLY_EMBEDDED_WORKERS is for the embedded cluster: unset it, or TALLY_DATABASE_URL"))
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
	return errs
}

// exportProblems are those of where usage goes and how it is staged.
func (c *Config) exportProblems() []error {
	var errs []error
	if c.StripeAPIKey != "" {
		if _, err := stripeapi.ModeOfKey(c.StripeAPIKey); err != nil {
			errs = append(errs, fmt.Errorf("STRIPE_API_KEY: %w", err))
		}
	}
	if c.StripeAccount != "" && !strings.HasPrefix(c.StripeAccount, "acct_") {
		errs = append(errs, errors.New("STRIPE_ACCOUNT must be an account id (acct_…)"))
	}
	if c.StripeWebhookSecret != "" {
		for _, secret := range strings.Split(c.StripeWebhookSecret, ",") {
			if !strings.HasPrefix(strings.TrimSpace(secret), "whsec_") {
				errs = append(errs, errors.New("STRIPE_WEBHOOK_SECRET must be the signing secrets of the event destinations (whsec_…), separated by commas"))
				break
			}
		}
	}
	switch c.Exporter {
	case exporter.StripeMeterEvents:
	case exporter.StripeMeterEventStream:
	default:
		errs = append(errs, fmt.Errorf("TALLY_EXPORTER must be stripe_meter_events or stripe_meter_event_stream, got %q", c.Exporter))
	}
	errs = append(errs, c.restrictedKeyProblems()...)
	if c.AdminToken != "" {
		if err := auth.CheckConfiguredSecret("TALLY_ADMIN_TOKEN", c.AdminToken); err != nil {
			errs = append(errs, err)
		}
	}
	if c.StageInterval <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_STAGE_INTERVAL must be positive, got %s", c.StageInterval))
	}
	if c.StageWorkers < 0 || (c.StageWorkers > 0 && c.StageWorkers >= c.Pools.Export) {
		errs = append(errs, fmt.Errorf("TALLY_STAGE_WORKERS must be 0 (the node's cores) or fewer than TALLY_POOL_EXPORT's %d connections, which the deliverers share, got %d",
			c.Pools.Export, c.StageWorkers))
	}
	if c.WindowGrace < 0 {
		errs = append(errs, fmt.Errorf("TALLY_WINDOW_GRACE must not be negative, got %s", c.WindowGrace))
	}
	if c.InvoiceGrace < 0 || c.InvoiceGrace > meter.MaxInvoiceGrace || c.InvoiceGrace%time.Second != 0 {
		errs = append(errs, fmt.Errorf("TALLY_INVOICE_GRACE must be 0s to %s (Stripe's longest invoice finalization grace period), in whole seconds, got %s",
			short(meter.MaxInvoiceGrace), c.InvoiceGrace))
	}
	if c.InvoiceHoldMax <= 0 || c.InvoiceHoldMax > invoices.MaxHoldMax {
		errs = append(errs, fmt.Errorf("TALLY_INVOICE_HOLD_MAX must be more than 0 and at most %s, got %s", short(invoices.MaxHoldMax), c.InvoiceHoldMax))
	}
	if p := meter.LatePolicy(c.LateUsage); p != meter.LateQuarantine && p != meter.LateSend {
		errs = append(errs, fmt.Errorf("TALLY_LATE_USAGE must be quarantine or send, got %q", c.LateUsage))
	}
	return errs
}

// deliveryProblems are those of the deliverers' sizes and pace.
func (c *Config) deliveryProblems() []error {
	var errs []error
	if c.StripeTimeout <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_STRIPE_TIMEOUT must be positive, got %s", c.StripeTimeout))
	}
	if c.RateLive <= 0 || c.RateTest <= 0 {
		errs = append(errs, errors.New("TALLY_RATE_LIVE and TALLY_RATE_TEST must be positive"))
	}
	if c.BasicRateLive <= 0 || c.BasicRateTest <= 0 {
		errs = append(errs, errors.New("TALLY_BASIC_RATE_LIVE and TALLY_BASIC_RATE_TEST must be positive"))
	}
	if c.AdjustRateLive <= 0 || c.AdjustRateTest <= 0 {
		errs = append(errs, errors.New("TALLY_ADJUST_RATE_LIVE and TALLY_ADJUST_RATE_TEST must be positive"))
	}
	if c.StreamRateLive <= 0 || c.StreamRateTest <= 0 || c.StreamInFlight < 1 {
		errs = append(errs, errors.New("TALLY_STREAM_RATE_LIVE and TALLY_STREAM_RATE_TEST must be positive, TALLY_STREAM_INFLIGHT at least 1"))
	}
	if c.DeliveryWorkers < 1 || c.DeliveryBatch < 1 || c.DeliveryBatch > outbox.MaxClaim || c.DeliveryInFlight < 1 {
		errs = append(errs, fmt.Errorf("TALLY_DELIVERY_WORKERS and TALLY_DELIVERY_INFLIGHT must be at least 1, TALLY_DELIVERY_BATCH 1 to %d", outbox.MaxClaim))
	}
	return errs
}
