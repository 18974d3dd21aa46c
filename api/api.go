// Package api owns Tally's HTTP surface: routing, authentication and roles,
// request ids, the JSON error shape, the OpenAPI document of /v1
// (openapi.json, served at /v1/openapi.json), and thin handlers that
// decode, call a domain package, and encode.
//
// It never runs SQL of its own and never changes an outbox row: every write
// goes through the package that owns it, one transaction per request that
// writes. It never writes a token, key or provider body to a log or a
// response.
package api

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"regexp"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// Check is one readiness condition: nil when it holds. Its error text is
// shown on /readyz, so it must be content-free.
type Check struct {
	Name string
	Func func(ctx context.Context) error
	// Degraded marks a condition whose failure is reported ("degraded")
	// without taking the node out of service (/readyz still answers 200).
	Degraded bool
}

// Deps are the domain parts the /v1 API drives.
type Deps struct {
	Pool     *pgxpool.Pool
	Outbox   *outbox.Store
	Mappings *mappings.Store
	Ingester *meter.Ingester
	Requeuer *quarantine.Requeuer
	Metrics  *Metrics
	// Reads, when set, serves every GET and HEAD, their authentication
	// included, so that a burst of reports waits on it and never on Pool,
	// which then serves the writes alone.
	Reads *pgxpool.Pool
	// ReadLimit, when set, bounds the expensive reads in flight per token
	// and in all.
	ReadLimit *ReadLimiter
	// Reconcile serves /v1/reconcile; nil answers that export is stalled.
	Reconcile *ReconcileDeps
	// Webhook serves POST /v1/stripe/events; nil or without a secret it
	// answers 503.
	Webhook *WebhookDeps
	// Quota bounds what one token may post to POST /v1/usage; the zero
	// value is no limit.
	Quota IngestQuota
	// Reports answers the completeness report from its snapshots; nil
	// computes it whenever no computation of the month runs.
	Reports *quarantine.Reports

	quotas *quotas // Quota's limiters, made by New
}

// Options configures the handler.
type Options struct {
	// Logger logs requests that failed on the server side. Defaults to
	// slog.Default().
	Logger *slog.Logger
	// Ready lists the conditions /readyz checks, in order.
	Ready []Check
	// Metrics serves /metrics; nil leaves the route out.
	Metrics http.Handler
	// CheckTimeout bounds each readiness check. Defaults to 2 seconds.
	CheckTimeout time.Duration
	// V1, when set, mounts the /v1 API.
	V1 *Deps
	// Console, when set, is mounted at /console/ (the web console).
	Console http.Handler
}

// New returns the HTTP handler.
func New(opts Options) http.Handler {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.CheckTimeout <= 0 {
		opts.CheckTimeout = 2 * time.Second
	}
	r := chi.NewRouter()
	r.Use(saneRequestID, middleware.RequestID, accessLog(opts.Logger), middleware.Recoverer)
	r.Get("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	r.Get("/readyz", func(w http.ResponseWriter, req *http.Request) {
		status, body := http.StatusOK, readiness{Status: "ready", Checks: map[string]string{}}
		for _, c := range opts.Ready {
			ctx, cancel := context.WithTimeout(req.Context(), opts.CheckTimeout)
			err := c.Func(ctx)
			cancel()
			if err != nil {
				body.Checks[c.Name] = err.Error()
				if c.Degraded {
					if body.Status == "ready" {
						body.Status = "degraded"
					}
					continue
				}
				status, body.Status = http.StatusServiceUnavailable, "not_ready"
				continue
			}
			body.Checks[c.Name] = "ok"
		}
		writeJSON(w, status, body)
	})
	if opts.Metrics != nil {
		r.Method(http.MethodGet, "/metrics", opts.Metrics)
	}
	if opts.V1 != nil {
		d := *opts.V1
		d.quotas = newQuotas(d.Quota)
		r.Route("/v1", v1(&d, opts.Logger))
	}
	if opts.Console != nil {
		r.Get("/console", func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, "/console/", http.StatusMovedPermanently)
		})
		r.Mount("/console", opts.Console)
	}
	r.NotFound(notFound)
	r.MethodNotAllowed(methodNotAllowed)
	return r
}

// v1 is the /v1 API: GET and HEAD on the reads pool, bounded by the read
// limiter; every other method on the writes pool. Both serve the one table
// of routes (handlers.routes); the router of the writes is the one mounted,
// so that walking it lists every route.
func v1(d *Deps, log *slog.Logger) func(chi.Router) {
	if d.Reports == nil {
		d.Reports, _ = quarantine.NewReports(0, nil) // no registry: cannot fail
	}
	writes := &handlers{Deps: d, log: log}
	reads := writes
	if d.Reads != nil {
		rd := *d
		rd.Pool = d.Reads
		reads = &handlers{Deps: &rd, log: log}
	}
	rr := chi.NewRouter()
	reads.routes(rr)
	return func(r chi.Router) {
		r.Use(func(next http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				if req.Method == http.MethodGet || req.Method == http.MethodHead {
					rr.ServeHTTP(w, req)
					return
				}
				next.ServeHTTP(w, req)
			})
		})
		writes.routes(r)
	}
}

// requestIDPattern is what a caller's X-Request-Id may be to be kept;
// anything else is replaced by one of ours.
var requestIDPattern = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,64}$`)

func saneRequestID(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if id := r.Header.Get(middleware.RequestIDHeader); id != "" && !requestIDPattern.MatchString(id) {
			r.Header.Del(middleware.RequestIDHeader)
		}
		next.ServeHTTP(w, r)
	})
}

// accessLog logs every request once it is answered, with its request id
// (also sent back as X-Request-Id): the method, the route pattern (never
// the path's ids or the query), the status, the size and the duration —
// never a header, so never a token. Probes and scrapes log at debug.
func accessLog(l *slog.Logger) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			id := middleware.GetReqID(r.Context())
			w.Header().Set("X-Request-Id", id)
			ww := middleware.NewWrapResponseWriter(w, r.ProtoMajor)
			start := time.Now()
			defer func() {
				route := "unmatched"
				if rc := chi.RouteContext(r.Context()); rc != nil && rc.RoutePattern() != "" {
					route = rc.RoutePattern()
				}
				level := slog.LevelInfo
				switch route {
				case "/healthz", "/readyz", "/metrics":
					level = slog.LevelDebug
				}
				l.Log(r.Context(), level, "request", "method", r.Method, "route", route, "status", ww.Status(),
					"bytes", ww.BytesWritten(), "duration_ms", time.Since(start).Milliseconds(), "request_id", id)
			}()
			next.ServeHTTP(ww, r)
		})
	}
}

func notFound(w http.ResponseWriter, _ *http.Request) {
	WriteError(w, http.StatusNotFound, "not_found", "no such route")
}

func methodNotAllowed(w http.ResponseWriter, _ *http.Request) {
	WriteError(w, http.StatusMethodNotAllowed, "method_not_allowed", "method not allowed on this route")
}

type readiness struct {
	Status string            `json:"status"`
	Checks map[string]string `json:"checks"`
}

// errorBody is the error shape every endpoint uses.
type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	// Problems lists what is wrong with an input, for 422 answers.
	Problems any `json:"problems,omitempty"`
}

// WriteError writes the error shape every endpoint uses:
// {"error":{"code":"…","message":"…"}} with a stable code.
func WriteError(w http.ResponseWriter, status int, code, message string) {
	writeJSON(w, status, errorBody{Error: errorDetail{Code: code, Message: message}})
}

// problemsCounted says how many problems an input has, for a message.
func problemsCounted(n int) string {
	if n == 1 {
		return "1 problem"
	}
	return strconv.Itoa(n) + " problems"
}

func writeProblems(w http.ResponseWriter, code, message string, problems any) {
	writeJSON(w, http.StatusUnprocessableEntity, errorBody{Error: errorDetail{Code: code, Message: message, Problems: problems}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
