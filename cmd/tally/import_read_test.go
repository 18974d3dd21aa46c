package main

import (
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
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

// Text from a file reaches the operator escaped: an unknown key carrying
// a terminal escape and a carriage return is printed as \x1b and \r.
func TestImportEscapesControlCharacters(t *testing.T) {
	t.Parallel()
	pool := testdb.New(t)
	file := importWriteFile(t, t.TempDir(), "u.jsonl",
		`{"id":"a","tenant":"acme","feature":"api","value":1,"\u001b[31mred\r":1,"\u009b2J":1}`+"\n")
	code, _, errs := tally(t, testdb.URLOf(t, pool), "import", file)
	require.Equal(t, 1, code, errs)
	require.Contains(t, errs, `u.jsonl:1: \x1b[31mred\r: unknown field; \u009b2J: unknown field`)
	require.NotContains(t, errs, "\x1b")
	require.NotContains(t, errs, "\r")
	require.NotContains(t, errs, "\u009b")
}

func TestPrintable(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"u.csv:2: value: required":   "u.csv:2: value: required",
		`unknown column "é" \ ok`:    `unknown column "é" \ ok`,
		"\x1b[2J\r\n\t\x7f":          `\x1b[2J\r\n\t\x7f`,
		"\u0085\u009b\u202e":         `\u0085\u009b\u202e`,
		"bad \xff byte, real \ufffd": `bad \xff byte, real ` + "\ufffd",
	} {
		require.Equal(t, want, printable(in), "%q", in)
	}
}
