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
}

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
	writeJSON(w, e.Status, map[string]*apiError{"error": e})
}

func errInvalid(status int, code, param, format string, args ...any) *apiError {
	return &apiError{Status: status, Type: typeInvalidRequest, Code: code, Param: param, Message: fmt.Sprintf(format, args...)}
}

func errMissingParam(param string) *apiError {
	return errInvalid(http.StatusBadRequest, "parameter_missing", param, "Missing required param: %s.", param)
}

func errUnknownParam(param string) *apiError {
	return errInvalid(http.StatusBadRequest, "parameter_unknown", param, "Received unknown parameter: %s", param)
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
