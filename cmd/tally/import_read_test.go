package main

import (
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// endless is an endless cell: "x" forever, counting what was read of it.
type endless struct{ n int64 }

func (e *endless) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'x'
	}
	e.n += int64(len(p))
	return len(p), nil
}

// A CSV record with a huge cell, quoted or not, is not read whole: the
// reader stops a read-ahead past the bound and names the record's line.
func TestCSVRecordPastTheBoundStopsReading(t *testing.T) {
	t.Parallel()
	for _, open := range []string{"", `"`} {
		cell := &endless{}
		src, err := newCSVSource(io.MultiReader(strings.NewReader("id,tenant,feature,value\na,acme,api,1\n\n"+open), cell))
		require.NoError(t, err)
		line, obj, reason, err := src.next()
		require.NoError(t, err)
		require.Equal(t, 2, line)
		require.Empty(t, reason)
		require.Contains(t, string(obj), `"id":"a"`)

		_, _, _, err = src.next()
		var tooLong recordTooLongError
		require.True(t, errors.As(err, &tooLong), "%v", err)
		require.Equal(t, 4, tooLong.line)
		require.ErrorContains(t, err, "longer than 1048576 bytes")
		require.LessOrEqual(t, cell.n, int64(maxCSVRecord+csvReadAhead), "the cell is read no further than the bound")
	}
}
