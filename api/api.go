// Package api owns Tally's HTTP surface: routing, request ids, the JSON
// error shape and the health endpoints. Handlers stay thin: decode, call a
// domain package, encode.
//
// It never runs SQL of its own and never changes an outbox row: every write
// goes through the package that owns it. It never writes a token, key or
// provider body to a log or a response.
package api

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
)

// Check is one readiness condition: nil when it holds. Its error text is
// shown on /readyz, so it must be content-free.
type Check struct {
	Name string
	Func func(ctx context.Context) error
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
	r.Use(middleware.RequestID, middleware.Recoverer)
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
				status, body.Status = http.StatusServiceUnavailable, "not_ready"
				body.Checks[c.Name] = err.Error()
				continue
			}
			body.Checks[c.Name] = "ok"
		}
		writeJSON(w, status, body)
	})
	if opts.Metrics != nil {
		r.Method(http.MethodGet, "/metrics", opts.Metrics)
	}
	r.NotFound(func(w http.ResponseWriter, _ *http.Request) {
		WriteError(w, http.StatusNotFound, "not_found", "no such route")
	})
	r.MethodNotAllowed(func(w http.ResponseWriter, _ *http.Request) {
		WriteError(w, http.StatusMethodNotAllowed, "method_not_allowed", "method not allowed on this route")
	})
	return r
}

type readiness struct {
	Status string            `json:"status"`
	Checks map[string]string `json:"checks"`
}

// WriteError writes the error shape every endpoint uses:
// {"error":{"code":"…","message":"…"}} with a stable code.
func WriteError(w http.ResponseWriter, status int, code, message string) {
	writeJSON(w, status, map[string]any{"error": map[string]string{"code": code, "message": message}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
