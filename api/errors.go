package api

import (
	"net/http"

	"github.com/tallymeter/tally/internal/errcode"
)

// statusOf is the HTTP status of each refusal code.
var statusOf = map[errcode.Code]int{
	errcode.NotFound:    http.StatusNotFound,
	errcode.Conflict:    http.StatusConflict,
	errcode.Stale:       http.StatusConflict,
	errcode.Invalid:     http.StatusUnprocessableEntity,
	errcode.Forbidden:   http.StatusForbidden,
	errcode.Unavailable: http.StatusServiceUnavailable,
}

// problemOf is how the API answers err: the status of its code and its
// condition as the problem code. ok is false for an error without a code,
// which is the server's failure.
func problemOf(err error) (status int, code string, ok bool) {
	status, ok = statusOf[errcode.Of(err)]
	return status, errcode.ConditionOf(err), ok
}

// refuse answers err, a domain package's refusal, with problemOf's status
// and code and the error's text; any other error is the server's failure,
// answered 500 internal with its text only in the log.
func (h *handlers) refuse(w http.ResponseWriter, r *http.Request, err error) {
	status, code, ok := problemOf(err)
	if !ok {
		h.internal(w, r, err)
		return
	}
	WriteError(w, status, code, err.Error())
}
