package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/tallymeter/tally/meter"
)

// maxImportLine is the longest row (a JSONL line, or the JSON object a CSV
// record makes) read as an event: ten times what
// the longest valid event takes.
const maxImportLine = 64 << 10

// batchPrefix and batchSuffix wrap a batch's events into the body of a
// POST /v1/usage, which meter.Decoder reads.
const (
	batchPrefix = `{"events":[`
	batchSuffix = `]}`
)

// maxCSVRecord bounds the bytes of one CSV record as written, so that a
// huge cell cannot take the memory of its size: encoding/csv holds a record
// whole. A record longer than maxImportLine but within it is a bad row; one
// past it stops the import, as its end cannot be found without reading it.
const maxCSVRecord = 1 << 20

// csvReadAhead is what encoding/csv's reader buffers past the record it is
// reading.
const csvReadAhead = 4096

// utf8BOM may start a file written on Windows.
var utf8BOM = []byte{0xEF, 0xBB, 0xBF}

// badRow is a row that is not stored, and why.
type badRow struct {
	line   int
	reason string
}

// importBatch is a batch of one file's rows as read sends it to be stored.
type importBatch struct {
	file string
	// body holds the rows' JSON objects, as a POST /v1/usage body
	// (batchPrefix, the objects separated by commas, batchSuffix once
	// sealed).
	body []byte
	// rows are the rows in body: each one's line and its object's span.
	rows []bodyRow
	// events are the rows' events once decoded, and lines their lines.
	events []meter.Event
	lines  []int
	// bad are the rows refused, by reading, decoding or storing.
	bad []badRow
	// read counts the rows of the batch, good and bad; first and last are
	// the first and last lines read into it.
	read        int
	first, last int
	// offset is the bytes of every file read up to the end of the batch.
	offset int64
	// fileEnd says the batch is its file's last.
	fileEnd bool
	// err stops the import: the file could not be read.
	err error
}

// bodyRow is a row in a batch's body.
type bodyRow struct {
	line       int
	start, end int
}

func newImportBatch(file string, size int) *importBatch {
	b := &importBatch{file: file, body: make([]byte, 0, size)}
	b.body = append(b.body, batchPrefix...)
	return b
}

// fits reports whether an object of n bytes fits in the body of a request.
func (b *importBatch) fits(n int) bool {
	return len(b.body)+n+1+len(batchSuffix) <= meter.MaxBodyBytes
}

func (b *importBatch) note(line int) {
	if b.first == 0 {
		b.first = line
	}
	b.last = line
	b.read++
}

// add copies a row's object into the body.
func (b *importBatch) add(line int, obj []byte) {
	b.note(line)
	if len(b.rows) > 0 {
		b.body = append(b.body, ',')
	}
	start := len(b.body)
	b.body = append(b.body, obj...)
	b.rows = append(b.rows, bodyRow{line: line, start: start, end: len(b.body)})
}

func (b *importBatch) refuse(line int, reason string) {
	b.note(line)
	b.bad = append(b.bad, badRow{line: line, reason: reason})
}

// seal ends the body.
func (b *importBatch) seal() { b.body = append(b.body, batchSuffix...) }

// without rebuilds the body with the rows not in drop.
func (b *importBatch) without(drop map[int]bool) {
	body := make([]byte, 0, len(b.body))
	body = append(body, batchPrefix...)
	rows := b.rows[:0:0]
	for i, r := range b.rows {
		if drop[i] {
			continue
		}
		if len(rows) > 0 {
			body = append(body, ',')
		}
		start := len(body)
		body = append(body, b.body[r.start:r.end]...)
		rows = append(rows, bodyRow{line: r.line, start: start, end: len(body)})
	}
	b.body, b.rows = append(body, batchSuffix...), rows
}

func (b *importBatch) sortBad() {
	slices.SortStableFunc(b.bad, func(x, y badRow) int { return x.line - y.line })
}

// decode validates the batch's rows with dec, exactly as POST /v1/usage
// validates a request's events, and refuses corrections (negative values)
// unless corrections allows them, as the API refuses them from a token
// made without --corrections. A row with problems is a bad row, with the
// API's reasons; the others are decoded again without it (the decoder
// reports at most meter.MaxProblems at once), until none is left with a
// problem.
func (b *importBatch) decode(dec meter.Decoder, corrections bool, now time.Time) error {
	for len(b.rows) > 0 {
		events, err := dec.Decode(bytes.NewReader(b.body), now)
		var invalid *meter.InvalidBatchError
		if errors.As(err, &invalid) {
			byRow := map[int][]meter.Problem{}
			for _, p := range invalid.Problems {
				if p.Index == nil || *p.Index < 0 || *p.Index >= len(b.rows) {
					return fmt.Errorf("lines %d to %d: the decoder found a problem of no row (%s)", b.first, b.last, describeProblems([]meter.Problem{p}))
				}
				byRow[*p.Index] = append(byRow[*p.Index], p)
			}
			drop := map[int]bool{}
			for i, ps := range byRow {
				b.bad = append(b.bad, badRow{line: b.rows[i].line, reason: describeProblems(ps)})
				drop[i] = true
			}
			b.without(drop)
			continue
		}
		if err != nil {
			// The batch is built to fit a request: anything else is a bug.
			return fmt.Errorf("lines %d to %d: %w", b.first, b.last, err)
		}
		b.events, b.lines = events[:0:len(events)], make([]int, 0, len(events))
		for i, ev := range events {
			if ev.Value < 0 && !corrections {
				b.bad = append(b.bad, badRow{line: b.rows[i].line,
					reason: "value: a correction (negative value): import corrections with --corrections, as POST /v1/usage takes them only from a token made with --corrections"})
				continue
			}
			b.events = append(b.events, ev)
			b.lines = append(b.lines, b.rows[i].line)
		}
		break
	}
	b.body, b.rows = nil, nil
	return nil
}

// rowSource reads one file's rows.
type rowSource interface {
	// next returns the next row: its line, and the JSON object of its
	// event or, for a row that cannot be one, the reason (a bad row); at
	// the end, io.EOF. obj is valid until the next call.
	next() (line int, obj []byte, reason string, err error)
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// read reads the files, in order, into batches of at most im.batch events
// and of at most a request's bytes, decodes each (importBatch.decode) and
// sends it on out; it closes out when it is done or ctx ends.
func (im *importer) read(ctx context.Context, out chan<- *importBatch) {
	defer close(out)
	send := func(b *importBatch) bool {
		select {
		case out <- b:
			return true
		case <-ctx.Done():
			return false
		}
	}
	var before int64 // the bytes of the files before this one
	for _, f := range im.files {
		if !im.readFile(ctx, f, before, send) {
			return
		}
		before += f.size
	}
}

// readFile reads one file's batches and sends them; false means stop.
func (im *importer) readFile(ctx context.Context, f importFile, before int64, send func(*importBatch) bool) bool {
	fh, err := os.Open(f.path)
	if err != nil {
		send(&importBatch{file: f.path, err: fmt.Errorf("%s: %w", f.path, pathCause(err))})
		return false
	}
	defer fh.Close()
	counter := &countingReader{r: fh}
	offset := func() int64 {
		if f.size > 0 {
			return before + min(counter.n, f.size)
		}
		return before
	}
	var src rowSource
	switch f.format {
	case formatCSV:
		src, err = newCSVSource(counter)
	default:
		src = newJSONLSource(counter)
	}
	if err != nil {
		var he headerError
		if errors.As(err, &he) {
			b := &importBatch{file: f.path, fileEnd: true, offset: before + f.size}
			b.refuse(1, he.Error()+"; the file is skipped")
			return send(b)
		}
		send(&importBatch{file: f.path, err: fmt.Errorf("%s: %w", f.path, err)})
		return false
	}
	bodySize := min(meter.MaxBodyBytes, im.batch*256+len(batchPrefix)+len(batchSuffix))
	b := newImportBatch(f.path, bodySize)
	flush := func(end bool) bool {
		b.seal()
		if err := b.decode(im.decoder, im.corrections, time.Now()); err != nil {
			b.err = fmt.Errorf("%s: %w", f.path, err)
		}
		b.offset, b.fileEnd = offset(), end
		ok := send(b) && b.err == nil
		b = newImportBatch(f.path, bodySize)
		return ok
	}
	for {
		if ctx.Err() != nil {
			return false
		}
		line, obj, reason, err := src.next()
		if errors.Is(err, io.EOF) {
			return flush(true)
		}
		var tooLong recordTooLongError
		if errors.As(err, &tooLong) {
			// Store the rows before it, then stop.
			if !flush(false) {
				return false
			}
			send(&importBatch{file: f.path, err: fmt.Errorf("%s:%d: %w; every row before it is stored, none from it on: "+
				"fix that record, then run the same command again (ids deduplicate: nothing is stored twice)", f.path, tooLong.line, err)})
			return false
		}
		if err != nil {
			send(&importBatch{file: f.path, err: fmt.Errorf("%s, after line %d: %w", f.path, b.last, err)})
			return false
		}
		if reason == "" && len(obj) > maxImportLine {
			reason = fmt.Sprintf("longer than %d bytes: not one usage event", maxImportLine)
		}
		// A batch holds at most im.batch rows, good or bad, and no more
		// bytes than a request.
		if len(b.rows)+len(b.bad) == im.batch || (reason == "" && !b.fits(len(obj))) {
			if !flush(false) {
				return false
			}
		}
		if reason != "" {
			b.refuse(line, reason)
		} else {
			b.add(line, obj)
		}
	}
}

// jsonlSource reads JSON Lines: one event object a line; blank lines are
// skipped.
type jsonlSource struct {
	r    *bufio.Reader
	line int
}

func newJSONLSource(r io.Reader) *jsonlSource {
	return &jsonlSource{r: bufio.NewReaderSize(r, maxImportLine)}
}

func (s *jsonlSource) next() (int, []byte, string, error) {
	for {
		buf, err := s.r.ReadSlice('\n')
		long := false
		for errors.Is(err, bufio.ErrBufferFull) {
			long = true
			_, err = s.r.ReadSlice('\n')
		}
		if err != nil && !errors.Is(err, io.EOF) {
			return 0, nil, "", err
		}
		if len(buf) == 0 && !long {
			return 0, nil, "", io.EOF
		}
		s.line++
		if s.line == 1 {
			buf = bytes.TrimPrefix(buf, utf8BOM)
		}
		text := bytes.TrimSpace(buf)
		switch {
		case long:
			return s.line, nil, fmt.Sprintf("longer than %d bytes: not one usage event", maxImportLine), nil
		case len(text) == 0:
			continue
		case !json.Valid(text):
			return s.line, nil, malformedJSON(text), nil
		}
		return s.line, text, "", nil
	}
}

// malformedJSON says where a line stops being JSON, without quoting it.
func malformedJSON(text []byte) string {
	var v json.RawMessage
	var se *json.SyntaxError
	if err := json.Unmarshal(text, &v); errors.As(err, &se) {
		return fmt.Sprintf("malformed JSON at byte %d: each line must be one JSON object with id, tenant, feature, value and timestamp", se.Offset)
	}
	return "malformed JSON: each line must be one JSON object with id, tenant, feature, value and timestamp"
}

// The columns of a CSV file, as its header names them: the fields of an
// event of POST /v1/usage.
var (
	csvRequired = []string{"id", "tenant", "feature", "value"}
	csvOptional = []string{"timestamp"}
)

// headerError is a CSV header that names no usable columns.
type headerError struct{ msg string }

func (e headerError) Error() string { return "header: " + e.msg }

// csvSource reads CSV with a header row naming its columns (csvRequired
// and csvOptional, in any order). Each record becomes the JSON object of
// an event: every cell a string, but for a value cell written as a JSON
// number, which goes as the number; an empty cell is a field not given
// (a missing value is then "required", a missing timestamp means now, as
// at the API).
type csvSource struct {
	r       *csv.Reader
	bound   *recordBound
	ahead   *bufio.Reader // the csv.Reader's buffer
	columns []string      // by position
	buf     []byte
}

// recordBound stops the reading of a CSV record longer than maxCSVRecord:
// it lets encoding/csv read at most that much, and its read-ahead, past the
// end of the record before. It counts the lines it has read.
type recordBound struct {
	r     io.Reader
	n     int64 // the bytes read
	lines int   // the newlines read
	limit int64
}

// errRecordTooLong is what recordBound reads past its limit.
var errRecordTooLong = fmt.Errorf("a CSV record longer than %d bytes (%d MiB): not one usage event", maxCSVRecord, maxCSVRecord>>20)

func (b *recordBound) Read(p []byte) (int, error) {
	if b.n >= b.limit {
		return 0, errRecordTooLong
	}
	if rest := b.limit - b.n; int64(len(p)) > rest {
		p = p[:rest]
	}
	n, err := b.r.Read(p)
	b.n += int64(n)
	b.lines += bytes.Count(p[:n], []byte{'\n'})
	return n, err
}

// recordTooLongError is a record longer than maxCSVRecord, and its line.
type recordTooLongError struct{ line int }

func (e recordTooLongError) Error() string { return errRecordTooLong.Error() }

// read reads the next record, at most maxCSVRecord bytes of it.
func (s *csvSource) read() ([]string, error) {
	s.bound.limit = s.r.InputOffset() + maxCSVRecord + csvReadAhead
	line := s.nextLine()
	record, err := s.r.Read()
	if errors.Is(err, errRecordTooLong) {
		return nil, recordTooLongError{line: line}
	}
	return record, err
}

// nextLine is the line the next record starts on: the lines before what is
// buffered past the last record, and the blank lines that start it (which
// encoding/csv skips).
func (s *csvSource) nextLine() int {
	ahead, _ := s.ahead.Peek(s.ahead.Buffered())
	line := s.bound.lines - bytes.Count(ahead, []byte{'\n'}) + 1
	for {
		switch {
		case bytes.HasPrefix(ahead, []byte("\n")):
			ahead = ahead[1:]
		case bytes.HasPrefix(ahead, []byte("\r\n")):
			ahead = ahead[2:]
		default:
			return line
		}
		line++
	}
}

func newCSVSource(r io.Reader) (*csvSource, error) {
	bound := &recordBound{r: r}
	// encoding/csv reads through ahead as it is, so what it has read ahead
	// can be seen.
	ahead := bufio.NewReaderSize(bound, csvReadAhead)
	cr := csv.NewReader(ahead)
	cr.ReuseRecord = true
	s := &csvSource{r: cr, bound: bound, ahead: ahead}
	header, err := s.read()
	if errors.Is(err, io.EOF) {
		return nil, headerError{"the file is empty: a CSV file starts with a header row naming its columns: " + csvColumns()}
	}
	var pe *csv.ParseError
	if errors.As(err, &pe) {
		return nil, headerError{fmt.Sprintf("not CSV (%v): a CSV file starts with a header row naming its columns: %s", pe.Err, csvColumns())}
	}
	if err != nil {
		return nil, err
	}
	s.columns = make([]string, len(header))
	seen := map[string]bool{}
	var problems []string
	for i, name := range header {
		if i == 0 {
			name = strings.TrimPrefix(name, string(utf8BOM))
		}
		name = strings.TrimSpace(name)
		switch {
		case !slices.Contains(csvRequired, name) && !slices.Contains(csvOptional, name):
			problems = append(problems, fmt.Sprintf("unknown column %q", truncateName(name)))
		case seen[name]:
			problems = append(problems, fmt.Sprintf("column %q twice", name))
		}
		seen[name] = true
		s.columns[i] = name
	}
	for _, name := range csvRequired {
		if !seen[name] {
			problems = append(problems, fmt.Sprintf("no %q column", name))
		}
	}
	if len(problems) > 0 {
		return nil, headerError{strings.Join(problems, ", ") + "; the columns are " + csvColumns()}
	}
	return s, nil
}

func csvColumns() string {
	return strings.Join(csvRequired, ", ") + " (required) and " + strings.Join(csvOptional, ", ") + " (optional)"
}

// truncateName bounds a column name as an error repeats it.
func truncateName(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

func (s *csvSource) next() (int, []byte, string, error) {
	record, err := s.read()
	if errors.Is(err, io.EOF) {
		return 0, nil, "", io.EOF
	}
	var pe *csv.ParseError
	if errors.As(err, &pe) {
		if errors.Is(pe.Err, csv.ErrFieldCount) {
			return pe.StartLine, nil, fmt.Sprintf("%d fields, but the header names %d columns", len(record), len(s.columns)), nil
		}
		return pe.StartLine, nil, fmt.Sprintf("not CSV: %v", pe.Err), nil
	}
	if err != nil {
		return 0, nil, "", err
	}
	line, _ := s.r.FieldPos(0)
	b := append(s.buf[:0], '{')
	for i, cell := range record {
		if cell == "" {
			continue
		}
		if len(b) > 1 {
			b = append(b, ',')
		}
		b = append(b, '"')
		b = append(b, s.columns[i]...)
		b = append(b, '"', ':')
		if s.columns[i] == "value" && jsonNumber(cell) {
			b = append(b, cell...)
		} else {
			b = appendJSONString(b, cell)
		}
	}
	s.buf = append(b, '}')
	return line, s.buf, "", nil
}

// jsonNumber reports whether s is a JSON number as written.
func jsonNumber(s string) bool {
	return (s[0] == '-' || (s[0] >= '0' && s[0] <= '9')) && json.Valid([]byte(s))
}

// appendJSONString appends s as a JSON string.
func appendJSONString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c == '"' || c == '\\' || c >= 0x80 {
			q, _ := json.Marshal(s)
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}
