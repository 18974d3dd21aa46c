package console

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

// Each refusal an action's page can meet has a flash the page knows; a
// thing that does not exist is not found; an error without a code is a
// failure, never a flash.
func TestEveryRefusalHasItsPagesFlash(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		action   string
		err      error
		flash    string
		notFound bool
	}{
		{"requeue", fmt.Errorf("requeue 4: %w", outbox.ErrNotFound), "not_found", true},
		{"requeue", &quarantine.PeriodClosedError{}, "period_closed", false},
		{"requeue", &quarantine.MappingChangedError{Given: 1, Current: 2}, "mapping_changed", false},
		{"requeue", &quarantine.StillIneligibleError{}, "still_ineligible", false},
		{"requeue", outbox.ErrMayHaveReached, "may_have_reached", false},
		{"requeue", &outbox.StateError{Current: outbox.StatePending}, "not_quarantined", false},
		{"requeue", outbox.ErrNotSendable, "requeue_refused", false},
		{"requeue", meter.ErrStalled, "requeue_refused", false},
		{"recover", outbox.ErrNotFound, "not_found", true},
		{"recover", &reconcile.ExpectedStateError{}, "expected_state", false},
		{"recover", fmt.Errorf("%w: a reason is required", reconcile.ErrInvalidRecovery), "invalid_recovery", false},
		{"recover", outbox.ErrPastHorizon, "past_horizon", false},
		{"recover_all", outbox.ErrNotFound, "not_found", true},
		{"recover_all", &reconcile.ExpectedStateError{}, "bulk_moved", false},
		{"recover_all", fmt.Errorf("%w: too many", reconcile.ErrInvalidRecovery), "bulk_too_many", false},
		{"recover_all", outbox.ErrPastHorizon, "past_horizon", false},
		{"resolve", reconcile.ErrDiscrepancyNotFound, "not_found", true},
		{"resolve", reconcile.ErrInvalidResolution, "invalid_resolution", false},
		{"resolve", reconcile.ErrResolved, "already_resolved", false},
		{"resolve", reconcile.ErrSuperseded, "superseded", false},
		{"resolve", &reconcile.ItemsMovedError{}, "items_moved", false},
	} {
		flash, notFound, ok := flashOf(tc.action, tc.err)
		require.True(t, ok, "%s: %v", tc.action, tc.err)
		require.Equal(t, tc.flash, flash, "%s: %v", tc.action, tc.err)
		require.Equal(t, tc.notFound, notFound, "%s: %v", tc.action, tc.err)
		if !notFound {
			_, page := flashes[flash]
			_, notice := reconcileNotices[flash]
			_, recovery := recoveryNotices[flash]
			require.True(t, page || notice || recovery, "the console has no message for %s", flash)
		}
	}
	for _, action := range []string{"requeue", "recover", "recover_all", "resolve"} {
		for _, c := range errcode.Codes {
			_, _, ok := flashOf(action, errcode.New(c, "", "x"))
			require.Equal(t, c != errcode.Internal && (c == errcode.NotFound || action == "requeue"), ok, "%s %s", action, c)
		}
		_, _, ok := flashOf(action, errors.New("connection refused"))
		require.False(t, ok)
	}
}
