package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/meter"
)

// maxCancellations is the most cancellations one request carries.
const maxCancellations = 1000

// maxCancelBody bounds the body of a cancellation request.
const maxCancelBody = 1 << 20

// cancelRequest is the body of POST /v1/usage/cancellations.
type cancelRequest struct {
	Cancellations []meter.Cancellation `json:"cancellations"`
}

// cancelResponse is its answer.
type cancelResponse struct {
	Cancellations []meter.CancelResult `json:"cancellations"`
}

// postCancellations is POST /v1/usage/cancellations: earlier events, by
// tenant and id, are cancelled in one transaction (meter.Stager.Cancel;
// docs/design.md), each with exactly one outcome. A
// cancellation is a correction: the token must be allowed to post
// corrections, and to post for every tenant named. Any problem stores
// nothing; a cancellation already made answers its first outcome.
func (h *handlers) postCancellations(w http.ResponseWriter, r *http.Request) {
	p := principal(r)
	if wait, ok := h.quotas.admitRequest(p.TokenID); !ok {
		h.throttle(w, throttledRequests, wait, fmt.Sprintf("this token may make %g requests a second to this node; nothing was stored", h.Quota.RequestsPerSecond))
		return
	}
	var in cancelRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxCancelBody))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&in); err != nil || dec.More() {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			WriteError(w, http.StatusRequestEntityTooLarge, "batch_too_large", fmt.Sprintf("a request is at most %d bytes", maxCancelBody))
			return
		}
		WriteError(w, http.StatusBadRequest, "invalid_json", `the body must be {"cancellations":[{"tenant":"…","id":"…"},…]}`)
		return
	}
	switch n := len(in.Cancellations); {
	case n == 0:
		writeProblems(w, "invalid_cancellations", "no cancellation; nothing was stored",
			[]meter.Problem{{Field: "cancellations", Reason: "at least one cancellation"}})
		return
	case n > maxCancellations:
		WriteError(w, http.StatusRequestEntityTooLarge, "batch_too_large", fmt.Sprintf("a request is at most %d cancellations", maxCancellations))
		return
	}
	denied := map[string]bool{}
	for _, c := range in.Cancellations {
		if !p.MayPostFor(c.Tenant) {
			denied[c.Tenant] = true
		}
	}
	if len(denied) > 0 {
		WriteError(w, http.StatusForbidden, "forbidden_tenant", fmt.Sprintf("this token may not cancel usage of %d of the request's tenants; nothing was stored", len(denied)))
		return
	}
	if !p.MayCorrect() {
		WriteError(w, http.StatusForbidden, "corrections_not_allowed",
			"cancelling usage is a correction, and this token may not post corrections: use a token made with tally tokens create --corrections; nothing was stored")
		return
	}
	var out []meter.CancelResult
	err := pgx.BeginTxFunc(r.Context(), h.Pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		var err error
		out, err = h.Ingester.Stager.Cancel(r.Context(), tx, by(r), in.Cancellations)
		return err
	})
	var (
		invalid *meter.InvalidBatchError
		ce      *meter.CancelError
	)
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, cancelResponse{Cancellations: out})
	case errors.As(err, &invalid):
		writeProblems(w, "invalid_cancellations", problemsCounted(len(invalid.Problems))+"; nothing was stored", invalid.Problems)
	case errors.As(err, &ce):
		msg := fmt.Sprintf("cancellation %d: its event's item %d is %s", ce.Index, ce.Item, ce.State)
		switch ce.Code {
		case meter.CodeCancelInFlight, meter.CodeCancelUnsettled:
			// The lease ends, or the retries settle, by themselves: ask
			// again (cancellations are idempotent).
			w.Header().Set("Retry-After", strconv.Itoa(max(1, int(h.Outbox.Config().Lease.Seconds()))))
			msg += " and may be sent meanwhile; ask again later; nothing was stored"
		case meter.CodeCancelUncertain:
			msg += ": it may have reached Stripe; settle it first (tally recover); nothing was stored"
		default:
			msg += ": Tally cannot tell how to take it back; nothing was stored"
		}
		WriteError(w, http.StatusConflict, ce.Code, msg)
	case errors.Is(err, meter.ErrStalled):
		WriteError(w, http.StatusServiceUnavailable, "export_stalled", "export is stalled (no Stripe key): usage cannot be addressed; nothing was stored")
	default:
		h.internal(w, r, err)
	}
}
