package main

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// importLogEvery is how often tally import logs its progress when stderr
// is not a terminal.
const importLogEvery = 5 * time.Second

// importReport shows an import's progress and names its bad rows, on
// stderr. Its methods may be called from several goroutines.
type importReport interface {
	// badRows names the bad rows of a batch of file, in line order.
	badRows(file string, rows []badRow)
	// progress is called after each batch.
	progress(st importStats)
	// note says something out of the ordinary (an interrupt).
	note(msg string)
	// done ends the report; stopped says the import did not finish.
	done(st importStats, stopped bool)
}

// newImportReport is a progress bar on a terminal, and log lines every
// importLogEvery otherwise.
func newImportReport(w io.Writer, total int64) importReport {
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		return newBarReport(w, total)
	}
	return &logReport{w: w, every: importLogEvery, total: total, last: time.Now()}
}

// barReport is a progress bar over the files' bytes (a spinner when their
// size is unknown, as for a pipe), with the events stored and their rate
// before it and the time left after it.
type barReport struct {
	mu    sync.Mutex
	w     io.Writer
	bar   *progressbar.ProgressBar
	total int64
}

func newBarReport(w io.Writer, total int64) *barReport {
	max := total
	if max <= 0 {
		max = -1
	}
	return &barReport{w: w, total: total, bar: progressbar.NewOptions64(max,
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription("importing"),
		progressbar.OptionShowBytes(true),
		progressbar.OptionShowCount(),
		progressbar.OptionSetWidth(24),
		progressbar.OptionSetPredictTime(true),
		progressbar.OptionShowElapsedTimeOnFinish(),
		progressbar.OptionSetRenderBlankState(true),
		progressbar.OptionSpinnerType(14),
	)}
}

func (r *barReport) describe(st importStats) {
	r.bar.Describe(fmt.Sprintf("%9d events, %6.0f events/s", st.Accepted+st.Duplicates, st.rate()))
}

func (r *barReport) badRows(file string, rows []badRow) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, row := range rows {
		// Printed above the bar at its next drawing.
		_, _ = progressbar.Bprintln(r.bar, badRowLine(file, row))
	}
}

func (r *barReport) progress(st importStats) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.describe(st)
	_ = r.bar.Set64(st.Bytes)
}

func (r *barReport) note(msg string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, _ = progressbar.Bprintln(r.bar, msg)
	_ = r.bar.Add(0)
}

func (r *barReport) done(st importStats, stopped bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.describe(st)
	if r.total > 0 && !stopped {
		_ = r.bar.Finish()
	} else {
		_ = r.bar.Exit()
	}
	fmt.Fprintln(r.w)
}

// logReport writes a line of progress every so often, and each bad row.
type logReport struct {
	mu    sync.Mutex
	w     io.Writer
	every time.Duration
	total int64
	last  time.Time
}

func (r *logReport) badRows(file string, rows []badRow) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, row := range rows {
		fmt.Fprintln(r.w, badRowLine(file, row))
	}
}

func (r *logReport) progress(st importStats) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if time.Since(r.last) < r.every {
		return
	}
	r.last = time.Now()
	read := mib(st.Bytes)
	if r.total > 0 {
		read = fmt.Sprintf("%s of %s (%.0f%%)", mib(st.Bytes), mib(r.total), 100*float64(st.Bytes)/float64(r.total))
	}
	left := ""
	if r.total > 0 && st.Bytes > 0 && st.Bytes < r.total {
		rest := time.Duration(float64(st.Elapsed) * float64(r.total-st.Bytes) / float64(st.Bytes))
		left = fmt.Sprintf(", about %s left", rest.Round(time.Second))
	}
	fmt.Fprintf(r.w, "import: %s read, %d rows, %d events stored or found stored, %d bad rows, %.0f events/s%s\n",
		read, st.Rows, st.Accepted+st.Duplicates, st.Bad, st.rate(), left)
}

func (r *logReport) note(msg string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fmt.Fprintln(r.w, msg)
}

func (r *logReport) done(importStats, bool) {}

// mib writes a byte count in MiB.
func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// badRowLine names a bad row as FILE:LINE: reason, printable.
func badRowLine(file string, row badRow) string {
	return printable(fmt.Sprintf("%s:%d: %s", file, row.line, row.reason))
}

// printable escapes what a terminal would act on rather than show — control
// characters (ESC, CR, C1…), other characters strconv.IsPrint refuses, and
// bytes that are not UTF-8 — as Go writes them in a quoted string (\x1b,
// \r, \u202e), so that text from a file reaches the operator as text.
func printable(s string) string {
	if !strings.ContainsFunc(s, func(r rune) bool { return r == utf8.RuneError || !strconv.IsPrint(r) }) {
		return s
	}
	var b strings.Builder
	for i, w := 0, 0; i < len(s); i += w {
		r, n := utf8.DecodeRuneInString(s[i:])
		w = n
		switch {
		case r == utf8.RuneError && n == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case strconv.IsPrint(r):
			b.WriteRune(r)
		default:
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
		}
	}
	return b.String()
}
