package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/go-chi/chi/v5"
	must "github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// Every refusal code has an HTTP status; an error without a code is the
// server's failure.
func TestEveryCodeHasAStatus(t *testing.T) {
	t.Parallel()
	want := map[errcode.Code]int{
		errcode.NotFound: 404, errcode.Conflict: 409, errcode.Stale: 409, errcode.Invalid: 422,
		errcode.Forbidden: 403, errcode.Unavailable: 503,
	}
	for _, c := range errcode.Codes {
		status, code, ok := problemOf(errcode.New(c, "", "x"))
		if c == errcode.Internal {
			must.False(t, ok)
			continue
		}
		must.True(t, ok, c)
		must.Equal(t, want[c], status, c)
		must.Equal(t, string(c), code)
	}
}

// The domain errors keep the status and problem code the API has always
// answered them with (api/openapi.json).
func TestDomainErrorsKeepTheirProblemCodes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err    error
		status int
		code   string
	}{
		{outbox.ErrNotFound, 404, "not_found"},
		{reconcile.ErrNotFound, 404, "not_found"},
		{reconcile.ErrDiscrepancyNotFound, 404, "not_found"},
		{fmt.Errorf("requeue 4: %w", &quarantine.PeriodClosedError{}), 409, "period_closed"},
		{&quarantine.MappingChangedError{Given: 1, Current: 2}, 409, "mapping_changed"},
		{&quarantine.StillIneligibleError{Reason: outbox.ReasonNoCustomer}, 409, "still_ineligible"},
		{outbox.ErrMayHaveReached, 409, "may_have_reached"},
		{outbox.ErrNotSendable, 409, "not_sendable"},
		{meter.ErrAggregationChanged, 409, "aggregation_changed"},
		{meter.ErrStalled, 409, "export_stalled"},
		{outbox.ErrSuccessorExists, 409, "successor_exists"},
		{outbox.ErrPastHorizon, 409, "past_horizon"},
		{&reconcile.ExpectedStateError{ID: 1}, 409, "expected_state_mismatch"},
		{fmt.Errorf("%w: to must be accepted, pending or rejected", reconcile.ErrInvalidRecovery), 422, "invalid_recovery"},
		{fmt.Errorf("%w: a note is required", reconcile.ErrInvalidResolution), 422, "invalid_resolution"},
		{reconcile.ErrResolved, 409, "resolved"},
		{reconcile.ErrSuperseded, 409, "superseded"},
		{&reconcile.ItemsMovedError{}, 409, "items_moved"},
	} {
		status, code, ok := problemOf(tc.err)
		must.True(t, ok, "%v", tc.err)
		must.Equal(t, tc.status, status, "%v", tc.err)
		must.Equal(t, tc.code, code, "%v", tc.err)
	}
}

// An error without a code answers 500 internal and never shows its text.
func TestAnUnknownErrorIsInternalWithoutItsText(t *testing.T) {
	t.Parallel()
	h := &handlers{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	r := httptest.NewRequest(http.MethodGet, "/v1/items/1", nil)
	r = r.WithContext(context.WithValue(r.Context(), chi.RouteCtxKey, chi.NewRouteContext()))
	w := httptest.NewRecorder()
	h.refuse(w, r, errors.New("dial tcp 10.0.0.7:5432: password authentication failed for user tally"))
	must.Equal(t, http.StatusInternalServerError, w.Code)
	must.Contains(t, w.Body.String(), `"code":"internal"`)
	must.NotContains(t, w.Body.String(), "10.0.0.7")
	must.NotContains(t, w.Body.String(), "password")
}
