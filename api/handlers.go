package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tallymeter/tally/internal/auth"
)

// handlers serve /v1: each decodes a request, calls the package that owns
// what it asks for, and encodes the answer.
type handlers struct {
	*Deps
	log *slog.Logger
}

// maxJSONBody bounds every JSON body but a usage batch.
const maxJSONBody = 64 << 10

func (h *handlers) routes(r chi.Router) {
	// Stripe's event destination is authenticated by its Stripe-Signature
	// and the OpenAPI document is public; every other /v1 route needs a
	// token, and so do unknown ones, which answer 401 before 404 or 405.
	r.Post(stripeEventsPath, h.stripeEvents)
	r.Get(openAPIPath, serveOpenAPI)
	r.NotFound(h.authenticate(http.HandlerFunc(notFound)).ServeHTTP)
	r.MethodNotAllowed(h.authenticate(http.HandlerFunc(methodNotAllowed)).ServeHTTP)
	r.Group(h.authenticated)
}

func (h *handlers) authenticated(r chi.Router) {
	r.Use(h.authenticate)
	r.With(require(auth.RoleIngest)).Post("/usage", h.postUsage)
	r.With(require(auth.RoleIngest)).Post("/usage/cancellations", h.postCancellations)

	r.Group(func(r chi.Router) {
		r.Use(require(auth.RoleFinance))
		r.Get("/mappings/features", h.listFeatures)
		r.Get("/mappings/features/{feature}", h.getFeature)
		r.Get("/mappings/tenants", h.listTenants)
		r.Get("/mappings/tenants/{tenant}", h.getTenant)
		r.With(h.readSlot).Get("/quarantine", h.getQuarantine)
		r.With(h.readSlot).Get("/quarantine/items", h.getQuarantineItems)
		r.With(h.readSlot).Get("/reports/completeness", h.getCompleteness)
		r.Get("/reports/completeness/audit", h.getCompletenessAudit)
		r.Get("/outbox/summary", h.getSummary)
		r.Get("/outbox/items", h.listItems)
		r.Get("/outbox/items/{id}", h.getItem)
		r.With(h.readSlot).Get("/reconcile/runs", h.listReconcileRuns)
		r.With(h.readSlot).Get("/reconcile/runs/{id}", h.getReconcileRun)
		r.With(h.readSlot).Get("/reconcile/runs/{id}/plan", h.getReconcilePlan)
		r.With(h.readSlot).Get("/reconcile/discrepancies", h.listDiscrepancies)
		r.Get("/reconcile/discrepancies/{id}", h.getDiscrepancy)
		r.Post("/reconcile/discrepancies/{id}/resolve", h.resolveDiscrepancy) // finance decides
		r.With(h.readSlot).Get("/invoices/checks", h.listInvoiceChecks)
		r.Get("/invoices/checks/{id}", h.getInvoiceCheck)
		r.Post("/invoices/checks/{id}/resolve", h.resolveInvoiceCheck) // finance decides
		r.Get("/invoices/gates", h.listInvoiceGates)
		r.Get("/audit", h.listAudit)
	})
	r.Group(func(r chi.Router) {
		r.Use(require(auth.RoleOperator))
		r.Put("/mappings/features/{feature}", h.putFeature)
		r.Put("/mappings/tenants/{tenant}", h.putTenant)
		r.Post("/outbox/items/{id}/requeue", h.requeue)
		r.Post("/quarantine/requeue", h.requeueMatching)
		r.Post("/reconcile/runs", h.postReconcileRun)
		r.Post("/outbox/items/{id}/recover", h.recover)
	})
}

// sqlstateQueryCanceled is Postgres's query_canceled: a statement_timeout
// (or a cancel request) ended the query.
const sqlstateQueryCanceled = "57014"

// sqlstateDeadlock and sqlstateSerialization are the errors with which
// the database cancels a transaction to let a concurrent one go on (on
// Citus, a distributed deadlock's victim too): nothing of it was saved.
const (
	sqlstateDeadlock      = "40P01"
	sqlstateSerialization = "40001"
)

// internal answers 500 and logs the error with the request id; the body says
// nothing of it. A query cut by the pool's statement timeout (the client
// still waiting) answers 503 statement_timeout instead: the request is too
// big for now, the server is fine. A transaction the database cancelled
// for a concurrent one answers 503 retry: sent again, it goes through.
func (h *handlers) internal(w http.ResponseWriter, r *http.Request, err error) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == sqlstateDeadlock || pgErr.Code == sqlstateSerialization) && r.Context().Err() == nil {
		h.log.WarnContext(r.Context(), "request's transaction cancelled for a concurrent one", "method", r.Method,
			"route", chi.RouteContext(r.Context()).RoutePattern(), "request_id", middleware.GetReqID(r.Context()), "sqlstate", pgErr.Code)
		WriteError(w, http.StatusServiceUnavailable, "retry",
			"the database cancelled this request for a concurrent one; nothing was saved: send it again")
		return
	}
	if errors.As(err, &pgErr) && pgErr.Code == sqlstateQueryCanceled && r.Context().Err() == nil {
		// The pool's statement_timeout cut the query: the report is too
		// big for one request now, not a failure of the server.
		h.log.WarnContext(r.Context(), "request cut by the statement timeout", "method", r.Method,
			"route", chi.RouteContext(r.Context()).RoutePattern(), "request_id", middleware.GetReqID(r.Context()))
		WriteError(w, http.StatusServiceUnavailable, "statement_timeout",
			"the query took longer than this server allows (TALLY_READ_TIMEOUT for reports); narrow it (a tenant, a period) or try later")
		return
	}
	if r.Context().Err() != nil {
		// The client left (or the server is stopping): its query was
		// cancelled with it. Nobody reads the answer; not a failure.
		h.log.InfoContext(r.Context(), "request ended with its client", "method", r.Method,
			"route", chi.RouteContext(r.Context()).RoutePattern(), "request_id", middleware.GetReqID(r.Context()))
	} else {
		h.log.ErrorContext(r.Context(), "request failed", "method", r.Method, "route", chi.RouteContext(r.Context()).RoutePattern(),
			"request_id", middleware.GetReqID(r.Context()), "error", err)
	}
	WriteError(w, http.StatusInternalServerError, "internal", "the server failed; the request id is in the logs: "+middleware.GetReqID(r.Context()))
}

// decodeJSON reads a small JSON body strictly: unknown fields are an error.
func decodeJSON(w http.ResponseWriter, r *http.Request, v any) bool {
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxJSONBody))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			WriteError(w, http.StatusRequestEntityTooLarge, "body_too_large", fmt.Sprintf("the body is over %d bytes", maxJSONBody))
			return false
		}
		WriteError(w, http.StatusBadRequest, "invalid_json", "the body is not the expected JSON: "+err.Error())
		return false
	}
	if dec.More() {
		WriteError(w, http.StatusBadRequest, "invalid_json", "the body holds more than one JSON value")
		return false
	}
	return true
}

// by is the actor an audit entry names for the request: its token.
func by(r *http.Request) string { return "token:" + principal(r).Name }
