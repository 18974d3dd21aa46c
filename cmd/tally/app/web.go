package app

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/console"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/httpsec"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/invoices"
	"github.com/tallymeter/tally/migrations"
	"github.com/tallymeter/tally/reconcile"
)

// The HTTP server's bounds on slow or idle clients.
const (
	readHeaderTimeout = 10 * time.Second
	readTimeout       = 30 * time.Second
	writeTimeout      = 60 * time.Second
	idleTimeout       = 120 * time.Second
	maxHeaderBytes    = 64 << 10
)

// webServer is the service of the HTTP API on cfg.Listen, with the console,
// health, readiness and metrics: over TLS with cfg.TLS's certificate (reloaded
// when its files change), else plain HTTP, and every response with the
// security headers (httpsec). Start opens the listener, says so (the log
// line and ready) and serves; Stop shuts the server down gracefully, bounded
// by its ctx.
type webServer struct {
	cfg   config.Config
	db    *DB
	pools *Pools
	parts *Parts
	// events records Stripe's events posted to /v1/stripe/events; nil
	// without a key.
	events *reconcile.Events
	// backfill is the listing of Stripe's events; nil without a secret key.
	backfill *reconcile.Backfill
	logger   *slog.Logger
	// enqueue inserts a reconcile run's job in the caller's transaction.
	enqueue func(ctx context.Context, tx pgx.Tx, runID int64) error
	// ready, if not nil, receives the bound address once the listener is
	// open.
	ready func(addr string)

	srv *http.Server
	// failed receives the error the server ended with by itself; written
	// once by the serve goroutine, read by Serve.
	failed chan error
}

func (w *webServer) Start(context.Context) error {
	handler, err := w.handler()
	if err != nil {
		return err
	}
	w.srv = &http.Server{
		// Every response carries the security headers; whether the
		// client's side is HTTPS is worked out once, believing
		// X-Forwarded-* only from the configured proxies.
		Handler:           httpsec.Client(w.cfg.TLS.TrustedProxies)(httpsec.Headers(handler)),
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       readTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       idleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		// The server's own complaints (a failed TLS handshake, say) go to
		// the node's log, not to stderr.
		ErrorLog: slog.NewLogLogger(w.logger.Handler(), slog.LevelWarn),
	}
	scheme := "http"
	if w.cfg.TLS.Enabled() {
		certs, err := httpsec.NewCertReloader(w.cfg.TLS.CertFile, w.cfg.TLS.KeyFile, httpsec.DefaultCertCheckInterval, w.logger)
		if err != nil {
			return err
		}
		// GetCertificate alone, never Certificates: with both, a hello
		// without a server name would not ask for the reloaded one.
		w.srv.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: certs.GetCertificate}
		scheme = "https"
	}
	ln, err := net.Listen("tcp", w.cfg.Listen)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", w.cfg.Listen, err)
	}
	w.logger.Info("tally listening", "addr", scheme+"://"+ln.Addr().String())
	if w.ready != nil {
		w.ready(ln.Addr().String())
	}
	w.failed = make(chan error, 1)
	go func() {
		if w.srv.TLSConfig != nil {
			w.failed <- w.srv.ServeTLS(ln, "", "")
			return
		}
		w.failed <- w.srv.Serve(ln)
	}()
	return nil
}

func (w *webServer) Stop(ctx context.Context) error { return w.srv.Shutdown(ctx) }

// handler is the node's routes: the API, the console, health, readiness
// and metrics.
func (w *webServer) handler() (http.Handler, error) {
	cfg, db, p := w.cfg, w.db, w.parts
	// The console offers a reconcile run only when there is a reconciler.
	var consoleEnqueue func(ctx context.Context, tx pgx.Tx, runID int64) error
	if p.Reconciler != nil {
		consoleEnqueue = w.enqueue
	}
	// Why export is stalled: tally_export_stalled on /metrics, and the
	// console's banner.
	stalls := exporter.NewStalls(p.Resolver, p.Outbox, db.Pool, 0).WithMeters(p.Meters)
	if err := p.Registry.Register(stalls); err != nil {
		return nil, err
	}
	con, err := console.New(console.Deps{Pool: w.pools.Reads, ReadLimit: p.ReadLimit, Outbox: p.Outbox, Mappings: p.Mappings, Requeuer: p.Requeuer,
		Reports: p.Reports, Reconcile: consoleEnqueue, Settle: cfg.ReconcileSettle, SessionTTL: cfg.Console.SessionTTL, SessionIdle: cfg.Console.SessionIdle,
		ExportStalls: consoleStalls(stalls), Logger: w.logger})
	if err != nil {
		return nil, err
	}
	full := api.New(api.Options{
		Console: con.Handler(),
		Logger:  w.logger,
		Ready:   readiness(db, p, stalls),
		Metrics: promhttp.HandlerFor(p.Registry, promhttp.HandlerOpts{}),
		V1: &api.Deps{Pool: w.pools.Ingest, Reads: w.pools.Reads, ReadLimit: p.ReadLimit, Outbox: p.Outbox, Mappings: p.Mappings, Ingester: p.Ingester,
			Requeuer: p.Requeuer, Metrics: p.API, Reconcile: &api.ReconcileDeps{
				Enabled: p.Reconciler != nil, Settle: cfg.ReconcileSettle, Enqueue: w.enqueue},
			Webhook: webhookDeps(cfg, p, w.events, w.backfill), Quota: cfg.Quota.Ingest, Reports: p.Reports},
	})
	// /readyz?scope=ingest is what a load balancer should ask: ingest and
	// the reports need the database and its schema, not Stripe.
	ingest := api.New(api.Options{Logger: w.logger, Ready: ingestReadiness(db)})
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/readyz" || !r.URL.Query().Has("scope") {
			full.ServeHTTP(rw, r)
			return
		}
		if r.URL.Query().Get("scope") != readyScopeIngest {
			// A misspelt scope in a probe is found at once, not taken for
			// the full check.
			rw.Header().Set("Content-Type", "application/json")
			rw.WriteHeader(http.StatusBadRequest)
			_, _ = rw.Write([]byte(`{"error":{"code":"invalid_scope","message":"scope must be ingest, or absent"}}` + "\n"))
			return
		}
		ingest.ServeHTTP(rw, r)
	}), nil
}

// readyScopeIngest is /readyz's scope without export.
const readyScopeIngest = "ingest"

// readiness are /readyz's checks: the database, its schema, export, and
// (with a key) the paused event names, a degraded check.
// A node that cannot export (no key, a refused key, Stripe not answering)
// is not ready: 503, with the reason. It is readiness, not liveness (a
// restart fixes none of them), and ingest still works on the node, so a
// load balancer asks /readyz?scope=ingest instead (docs/monitoring.md).
func readiness(db *DB, p *Parts, stalls *exporter.Stalls) []api.Check {
	checks := append(ingestReadiness(db), api.Check{Name: "export", Func: p.Resolver.Ready})
	if p.Meters != nil {
		checks = append(checks, api.Check{Name: "meters", Func: pausedMeters(stalls), Degraded: true})
	}
	return checks
}

// pausedMeters is /readyz's degraded check of the event names whose
// meters are all deactivated: their items wait, the others export, so the
// node stays in service and says which.
func pausedMeters(s *exporter.Stalls) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		paused, err := s.Meters(ctx)
		if err != nil {
			return errors.New("unreadable")
		}
		if len(paused) == 0 {
			return nil
		}
		names := make([]string, len(paused))
		for i, m := range paused {
			names[i] = m.Account + "/" + m.EventName
		}
		return fmt.Errorf("items wait: every meter of %s is deactivated", strings.Join(names, ", "))
	}
}

// ingestReadiness are /readyz?scope=ingest's checks: the database and its
// schema.
func ingestReadiness(db *DB) []api.Check {
	return []api.Check{
		{Name: "database", Func: func(ctx context.Context) error {
			if err := db.Pool.Ping(ctx); err != nil {
				return errors.New("unreachable")
			}
			return nil
		}},
		{Name: "schema", Func: func(ctx context.Context) error {
			if err := migrations.Check(ctx, db.Pool); err != nil {
				if errors.Is(err, migrations.ErrBehind) {
					return err
				}
				return errors.New("unreadable")
			}
			return nil
		}},
	}
}

// consoleStalls is the console's banner: why export is stalled, in words
// without content. An outbox it cannot read leaves sustained retries out.
func consoleStalls(s *exporter.Stalls) func(context.Context) []console.ExportStall {
	return func(ctx context.Context) []console.ExportStall {
		reasons, _ := s.Reasons(ctx)
		out := make([]console.ExportStall, 0, len(reasons))
		for _, r := range reasons {
			switch r {
			case exporter.StallAccountRefused:
				// One line per connected account Stripe refused, naming it:
				// the metric counts them, the console says which.
				for _, a := range s.Connected() {
					out = append(out, console.ExportStall{Reason: string(r), Text: a.Explain()})
				}
			case exporter.StallMeterDeactivated:
				// One line per paused event name, naming its account and
				// meter.
				paused, _ := s.Meters(ctx)
				for _, m := range paused {
					out = append(out, console.ExportStall{Reason: string(r), Text: m.Explain()})
				}
			default:
				out = append(out, console.ExportStall{Reason: string(r), Text: r.Explain()})
			}
		}
		return out
	}
}

// webhookDeps are the event destination's: the secret, the recorder of
// events, and Stripe to read full events from in their context (none
// without a key).
func webhookDeps(cfg config.Config, p *Parts, events *reconcile.Events, backfill *reconcile.Backfill) *api.WebhookDeps {
	d := &api.WebhookDeps{Secret: cfg.StripeWebhookSecret, Events: events}
	if c := p.Resolver.Client(); c != nil {
		d.Fetch = c.Event
	}
	if backfill != nil {
		// A billing.meter.* event reads its account's meters at once.
		d.Meters = backfill.MetersChanged
	}
	if c := p.Resolver.Client(); c != nil {
		// An invoice.* event reads the invoice at once.
		d.Invoices = func(ctx context.Context, db pgdb.Beginner, customer, invoice string) (int, error) {
			r, err := invoices.Receiver{Reader: invoices.Stripe{Client: c}, Maps: p.Mappings, Gate: p.Gate}.Receive(ctx, db, customer, invoice)
			return r.Recorded, err
		}
	}
	if lister := p.Mappings.Subscriptions; lister != nil {
		// A customer.subscription.* event reads the customer's
		// subscriptions at once.
		d.Subscriptions = func(ctx context.Context, db pgdb.Beginner, customer string) (int, error) {
			return p.Mappings.SyncCustomer(ctx, db, lister, customer)
		}
	}
	return d
}
