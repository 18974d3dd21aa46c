package console

import (
	"net/http"

	"github.com/tallymeter/tally/internal/errcode"
)

// pageNames renames a refusal's condition where an action's page calls its
// flash something else.
var pageNames = map[string]map[string]string{
	"requeue":     {"expected_state_mismatch": "not_quarantined"},
	"recover":     {"expected_state_mismatch": "expected_state"},
	"recover_all": {"expected_state_mismatch": "bulk_moved", "invalid_recovery": "bulk_too_many"},
	"resolve":     {"resolved": "already_resolved"},
}

// pageFallback is the flash of an action's refusal its page has no message
// of its own for.
var pageFallback = map[string]string{"requeue": "requeue_refused"}

// flashOf is how the console answers err, a refusal of action ("requeue",
// "recover", "recover_all", "resolve"): the flash its page shows, named by the error's
// condition. notFound says the thing acted on does not exist. ok is false
// for an error without a code, or one the page has no flash for: a failure
// of the server.
func flashOf(action string, err error) (flash string, notFound, ok bool) {
	switch errcode.Of(err) {
	case errcode.Internal:
		return "", false, false
	case errcode.NotFound:
		return "not_found", true, true
	}
	flash = errcode.ConditionOf(err)
	if name, ok := pageNames[action][flash]; ok {
		flash = name
	}
	if _, ok := flashes[flash]; ok {
		return flash, false, true
	}
	if _, ok := reconcileNotices[flash]; ok && action == "resolve" {
		return flash, false, true
	}
	if _, ok := recoveryNotices[flash]; ok && (action == "recover" || action == "recover_all") {
		return flash, false, true
	}
	if fb, ok := pageFallback[action]; ok {
		return fb, false, true
	}
	return "", false, false
}

// refused answers err, a refusal of action: a redirect to the page to with
// flashOf's flash, 404 for a thing that does not exist, and 500 (the error
// only in the log) for anything else.
func (c *Console) refused(w http.ResponseWriter, r *http.Request, action, to string, err error) {
	flash, notFound, ok := flashOf(action, err)
	switch {
	case !ok:
		c.fail(w, r, err)
	case notFound:
		http.NotFound(w, r)
	default:
		back(w, r, to, flash)
	}
}
