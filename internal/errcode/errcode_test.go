package errcode_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/errcode"
)

type typed struct{}

func (typed) Error() string      { return "typed" }
func (typed) Code() errcode.Code { return errcode.Stale }

func TestOfFindsTheCodeThroughWrapping(t *testing.T) {
	t.Parallel()
	errGone := errcode.New(errcode.NotFound, "", "pkg: gone")
	errMoved := errcode.New(errcode.Conflict, "moved", "pkg: moved")
	for _, tc := range []struct {
		err       error
		code      errcode.Code
		condition string
	}{
		{errGone, errcode.NotFound, "not_found"},
		{fmt.Errorf("reading 4: %w", errGone), errcode.NotFound, "not_found"},
		{fmt.Errorf("%w: more", errMoved), errcode.Conflict, "moved"},
		{typed{}, errcode.Stale, "stale"},
		{errors.New("connection refused"), errcode.Internal, "internal"},
		{nil, errcode.Internal, "internal"},
	} {
		require.Equal(t, tc.code, errcode.Of(tc.err), "%v", tc.err)
		require.Equal(t, tc.condition, errcode.ConditionOf(tc.err), "%v", tc.err)
	}
	require.ErrorIs(t, fmt.Errorf("x: %w", errGone), errGone)
	require.NotErrorIs(t, errGone, errcode.New(errcode.NotFound, "", "pkg: gone"))
}
