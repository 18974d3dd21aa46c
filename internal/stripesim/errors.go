package stripesim

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// Stripe error types used by the simulator.
const (
	typeInvalidRequest = "invalid_request_error"
	typeIdempotency    = "idempotency_error"
	typeAPI            = "api_error"
)

// apiError is one Stripe error, written as
// {"error":{"type","code","message","param"}} with its HTTP status.
type apiError struct {
	Status  int    `json:"-"`
	Type    string `json:"type"`
	Code    string `json:"code,omitempty"`
	Message string `json:"message"`
	Param   string `json:"param,omitempty"`
	// Validation marks an error in the request's parameters that Stripe
	// finds before the endpoint starts executing: a missing, unknown or
	// malformed parameter. Stripe keeps no idempotent result for it, so a
	// later request with the same Idempotency-Key is processed anew. An
	// error found while executing (no such customer, no active meter, a
	// duplicate identifier) is not a validation error and is kept.
	Validation bool `json:"-"`
	// notExecuted marks an answer given before the endpoint started
	// executing for another reason: a rate limit (429) or a request held
	// until the client gave up. It is not kept for the key either.
	notExecuted bool
	// rateLimitedReason is the Stripe-Rate-Limited-Reason header of a 429
	// from a rate or concurrency limiter: which limiter refused the call
	// (https://docs.stripe.com/rate-limits, "Rate limited requests").
	rateLimitedReason string
}

// kept reports whether the idempotency layer keeps e as the answer to its
// Idempotency-Key, as Stripe keeps the result of every request whose
// endpoint started executing.
func (e *apiError) kept() bool { return !e.Validation && !e.notExecuted }

// errorNoter is a response writer that wants to know the error written
// through it: the idempotency layer's recorder.
type errorNoter interface{ noteError(*apiError) }

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status = http.StatusInternalServerError
		b = []byte(`{"error":{"type":"api_error","message":"stripesim: cannot encode response"}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

func writeError(w http.ResponseWriter, e *apiError) {
	if n, ok := w.(errorNoter); ok {
		n.noteError(e)
	}
	if e.rateLimitedReason != "" {
		w.Header().Set("Stripe-Rate-Limited-Reason", e.rateLimitedReason)
	}
	writeJSON(w, e.Status, map[string]*apiError{"error": e})
}

func errInvalid(status int, code, param, format string, args ...any) *apiError {
	return &apiError{Status: status, Type: typeInvalidRequest, Code: code, Param: param, Message: fmt.Sprintf(format, args...)}
}

// errValidation is a 400 invalid_request_error about a parameter, found
// before the endpoint executes (see apiError.Validation).
func errValidation(code, param, format string, args ...any) *apiError {
	e := errInvalid(http.StatusBadRequest, code, param, format, args...)
	e.Validation = true
	return e
}

func errMissingParam(param string) *apiError {
	return errValidation("parameter_missing", param, "Missing required param: %s.", param)
}

func errUnknownParam(param string) *apiError {
	return errValidation("parameter_unknown", param, "Received unknown parameter: %s", param)
}

// errServer is Stripe's own failure: 500 api_error. Its Stripe-Should-Retry
// header is set by the caller.
func errServer(message string) *apiError {
	return &apiError{Status: http.StatusInternalServerError, Type: typeAPI, Message: message}
}

// errHeld is the answer to a request held before its endpoint executed
// (latency or the Hang fault) until the client gave up or the simulator
// closed: nothing was executed and nothing is kept for its key.
func errHeld(message string) *apiError {
	e := errServer(message)
	e.notExecuted = true
	return e
}

func errNoSuch(status int, object, param, id string) *apiError {
	return errInvalid(status, "resource_missing", param, "No such %s: '%s'", object, id)
}

// unrecognized answers every route the simulator does not know, like Stripe.
func (s *Server) unrecognized(w http.ResponseWriter, r *http.Request) {
	writeError(w, errInvalid(http.StatusNotFound, "", "",
		"Unrecognized request URL (%s: %s). Please see https://stripe.com/docs or we can help at https://support.stripe.com/.",
		r.Method, r.URL.Path))
}
