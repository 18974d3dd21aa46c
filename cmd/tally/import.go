package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/meter"
)

// DefaultImportBatch is how many events tally import posts in one
// transaction unless --batch says otherwise: the API's best batch size
// (docs/performance.md), far below its most (TALLY_INGEST_MAX_EVENTS).
const DefaultImportBatch = 1000

// importFlags are the flags of tally import.
type importFlags struct {
	format      string
	batch       int
	corrections bool
	// files are the files named, checked by checkArgs.
	files []importFile
}

// importCommand is tally import FILE…: usage from files, posted as POST
// /v1/usage posts it — the same decoder, the same refusal of corrections
// without permission, meter.Ingester.Post in one transaction a batch — in
// process, on the database the operator commands reach.
func importCommand() command {
	f := &importFlags{}
	return command{name: "import", flags: f.register, args: f.checkArgs, run: f.run}
}

func (f *importFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.format, "format", "", "jsonl or csv; by default from each file's extension (.jsonl, .ndjson, .csv)")
	fs.IntVar(&f.batch, "batch", DefaultImportBatch, "events a transaction, 1 to TALLY_INGEST_MAX_EVENTS")
	fs.BoolVar(&f.corrections, "corrections", false, "post corrections (negative values) too; without it each is a bad row, as at the API for a token made without --corrections")
}

// checkArgs checks the files and the flags that need no configuration,
// before the database is opened.
func (f *importFlags) checkArgs(args []string) error {
	if len(args) == 0 {
		return errors.New("want one or more files of usage (.jsonl, .ndjson or .csv)")
	}
	if f.batch < 1 || f.batch > meter.MaxEvents {
		return fmt.Errorf("--batch must be 1 to %d (TALLY_INGEST_MAX_EVENTS)", meter.MaxEvents)
	}
	files, err := importFilesOf(args, f.format)
	f.files = files
	if err != nil {
		return errors.New(printable(err.Error())) // it names a path as given
	}
	return nil
}

func (f *importFlags) run(ctx context.Context, e *env, _ []string) error {
	most := e.cfg.Quota.Ingest.MaxEvents
	if most <= 0 || most > meter.MaxEvents {
		most = meter.MaxEvents
	}
	if f.batch < 1 || f.batch > most {
		return usageError{fmt.Sprintf("--batch must be 1 to %d (TALLY_INGEST_MAX_EVENTS)", most)}
	}
	files := f.files
	past := exporter.StripeAcceptPast
	if t, ok := e.parts.Stager.Target(ctx); ok && t.AcceptPast > 0 {
		past = t.AcceptPast
	}
	var total int64
	for _, file := range files {
		total += file.size
	}
	im := &importer{
		ingester:    e.parts.Ingester,
		db:          e.db.Pool,
		decoder:     meter.Decoder{MaxEvents: most},
		batch:       f.batch,
		corrections: f.corrections,
		acceptPast:  past,
		files:       files,
		report:      newImportReport(e.stderr, total),
		stdout:      e.stdout,
	}
	// A first interrupt (ctx) stops the import once the batch in flight
	// has committed; a second abandons that batch: its transaction rolls
	// back, and nothing of it is stored.
	work, abandon := context.WithCancel(context.WithoutCancel(ctx))
	defer abandon()
	stop := abandonOnSecondInterrupt(ctx, abandon, im.report)
	defer stop()
	return im.run(ctx, work)
}

// abandonOnSecondInterrupt calls abandon on an interrupt or SIGTERM that
// comes after ctx ended (the first), until stop is called.
func abandonOnSecondInterrupt(ctx context.Context, abandon context.CancelFunc, report importReport) (stop func()) {
	done := make(chan struct{})
	var once sync.Once
	go func() {
		select {
		case <-done:
			return
		case <-ctx.Done():
		}
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
		defer signal.Stop(sig)
		report.note("interrupted: stopping once the batch in flight is stored; interrupt again to abandon it (nothing of it is stored then)")
		select {
		case <-sig:
			abandon()
		case <-done:
		}
	}()
	return func() { once.Do(func() { close(done) }) }
}

// importFormat is how a file's rows are written.
type importFormat string

const (
	formatJSONL importFormat = "jsonl"
	formatCSV   importFormat = "csv"
)

// importFile is one file to import.
type importFile struct {
	path   string
	format importFormat
	size   int64
}

// importFilesOf checks the files named on the command line, before
// anything is stored: each must be a readable regular file, or a named
// pipe, whose format --format or its extension gives.
func importFilesOf(paths []string, format string) ([]importFile, error) {
	switch importFormat(format) {
	case "", formatJSONL, formatCSV:
	default:
		return nil, fmt.Errorf("--format must be jsonl or csv, got %q", format)
	}
	files := make([]importFile, 0, len(paths))
	for _, p := range paths {
		f := importFile{path: p, format: importFormat(format)}
		if f.format == "" {
			switch strings.ToLower(filepath.Ext(p)) {
			case ".jsonl", ".ndjson":
				f.format = formatJSONL
			case ".csv":
				f.format = formatCSV
			default:
				return nil, fmt.Errorf("%s: cannot tell its format from its extension (.jsonl, .ndjson or .csv): say --format jsonl or --format csv", p)
			}
		}
		st, err := os.Stat(p)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", p, pathCause(err))
		}
		switch {
		case st.Mode().IsRegular():
			fh, err := os.Open(p)
			if err != nil {
				return nil, fmt.Errorf("%s: %v", p, pathCause(err))
			}
			_ = fh.Close()
			f.size = st.Size()
		case st.Mode()&os.ModeNamedPipe != 0:
			// A pipe (a stream from another program) is read as it comes;
			// its size is unknown.
		default:
			return nil, fmt.Errorf("%s: not a file", p)
		}
		files = append(files, f)
	}
	return files, nil
}

// pathCause is what went wrong with a file, without its path (which the
// message gives first).
func pathCause(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// importStats are an import's counts so far.
type importStats struct {
	// Files counts the files read to their end (or, for a bad header,
	// skipped).
	Files int
	// Rows counts the rows read: events and bad rows, not blank lines or
	// a CSV header.
	Rows int
	// Accepted, Duplicates and Unmapped are meter.Result's, summed.
	Accepted, Duplicates, Unmapped int
	// Bad counts the bad rows.
	Bad int
	// Old counts the events stored or found stored that are older than
	// the provider takes: each is quarantined (timestamp_window) when it
	// is staged, as at the API.
	Old int
	// Bytes counts the bytes of the files read so far.
	Bytes int64
	// Elapsed is the time since the import started.
	Elapsed time.Duration
	// File and Line are those of the last row stored or refused.
	File string
	Line int
}

// rate is the events stored or found stored a second.
func (s importStats) rate() float64 {
	if s.Elapsed <= 0 {
		return 0
	}
	return float64(s.Accepted+s.Duplicates) / s.Elapsed.Seconds()
}

// importer runs one import: a reader goroutine reads and decodes the files
// into batches (read), and the caller's goroutine stores them, one
// transaction a batch, in file order (run).
type importer struct {
	ingester *meter.Ingester
	db       pgdb.DB
	// decoder validates each batch, as POST /v1/usage's.
	decoder meter.Decoder
	// batch is the most events of one batch.
	batch int
	// corrections lets negative values through.
	corrections bool
	// acceptPast is how old an event the provider takes, for the count of
	// events that will be quarantined as too old.
	acceptPast time.Duration
	files      []importFile
	// report shows progress and names the bad rows (on stderr).
	report importReport
	// stdout takes the summary.
	stdout io.Writer
}

// errImportInterrupted says the import stopped on an interrupt.
var errImportInterrupted = errors.New("interrupted")

// run imports every file and prints the summary. It stops when ctx ends,
// once the batch being stored has committed; work is the context of the
// transactions, which ends only when the batch in flight is to be
// abandoned. Its error says why it did not store every row: bad rows, an
// interrupt, or a failure.
func (im *importer) run(ctx, work context.Context) error {
	start := time.Now()
	st := importStats{}
	readCtx, stopReading := context.WithCancel(ctx)
	defer stopReading()
	// batches: read sends, in file order, and closes it when done or
	// stopped; run receives. read is not waited for: it returns once its
	// read returns (a pipe may hold it) and sees the stop.
	batches := make(chan *importBatch, 2)
	go im.read(readCtx, batches)

	var failure error
loop:
	for {
		var b *importBatch
		select {
		case <-ctx.Done():
			break loop
		case next, ok := <-batches:
			if !ok || ctx.Err() != nil {
				break loop
			}
			b = next
		}
		if b.err != nil {
			failure = b.err
			break
		}
		if err := im.store(work, b, &st); err != nil {
			failure = fmt.Errorf("storing %s from line %d: %w; every batch before it is stored, and of this one what the summary "+
				"counts as accepted: run the same command again to resume (ids deduplicate: nothing is stored twice)", b.file, b.first, err)
			break
		}
		st.Elapsed = time.Since(start)
		im.report.progress(st)
	}
	st.Elapsed = time.Since(start)
	// Stopped by an interrupt, unless it came after the last file was
	// read to its end.
	interrupted := failure == nil && st.Files < len(im.files)
	im.report.done(st, interrupted || failure != nil)
	im.summary(st)
	switch {
	case failure != nil:
		// It may name a file's content (a record's reason, a path).
		return errors.New(printable(failure.Error()))
	case interrupted:
		where := "before the first batch"
		if st.File != "" {
			where = printable(fmt.Sprintf("after %s line %d", st.File, st.Line))
		}
		return fmt.Errorf("%w %s: run the same command again to resume (ids deduplicate: nothing is stored twice)", errImportInterrupted, where)
	case st.Bad > 0:
		return fmt.Errorf("%d bad rows, named above by file and line; every other row is stored", st.Bad)
	}
	return nil
}

// store stores one batch (storeEvents), names its bad rows and adds its
// counts to st.
func (im *importer) store(ctx context.Context, b *importBatch, st *importStats) error {
	res, refused, err := im.storeEvents(ctx, b.events, b.lines)
	if err != nil {
		// A batch stored in parts (the quarantine cap) may have committed
		// some before one failed: count what was stored.
		st.Accepted += res.Accepted
		st.Duplicates += res.Duplicates
		st.Unmapped += res.Unmapped
		return err
	}
	cutoff := time.Now().Add(-im.acceptPast)
	for i, ev := range b.events {
		if _, bad := refused[i]; !bad && ev.Timestamp != nil && ev.Timestamp.Before(cutoff) {
			st.Old++
		}
	}
	for i, reason := range refused {
		b.bad = append(b.bad, badRow{line: b.lines[i], reason: reason})
	}
	b.sortBad()
	im.report.badRows(b.file, b.bad)
	st.Rows += b.read
	st.Bad += len(b.bad)
	st.Accepted += res.Accepted
	st.Duplicates += res.Duplicates
	st.Unmapped += res.Unmapped
	st.Bytes = b.offset
	if b.last > 0 {
		st.File, st.Line = b.file, b.last
	}
	if b.fileEnd {
		st.Files++
	}
	return nil
}

// storeEvents posts events (their lines beside them) with the API's
// Ingester.Post, one transaction at a time: a batch the database refuses
// — an id stored before, or repeated in the batch, with other content — is
// rolled back whole and posted again without the events refused, which it
// returns by index with the reason; a batch whose new events would make
// more quarantined items than the API lets one request make
// (TALLY_INGEST_MAX_QUARANTINED) is posted again in parts of at most that
// many events, each its own transaction. Nothing is ever half-stored.
func (im *importer) storeEvents(ctx context.Context, events []meter.Event, lines []int) (meter.Result, map[int]string, error) {
	refused := map[int]string{}
	index := make([]int, len(events)) // into events, of each event posted
	for i := range index {
		index[i] = i
	}
	var total meter.Result
	var post func(idx []int) error
	post = func(idx []int) error {
		for len(idx) > 0 {
			evs := make([]meter.Event, len(idx))
			for j, i := range idx {
				evs[j] = events[i]
			}
			res, err := im.ingester.Post(ctx, im.db, evs)
			var (
				invalid *meter.InvalidBatchError
				capped  *meter.QuarantineCapError
			)
			switch {
			case err == nil:
				total.Accepted += res.Accepted
				total.Duplicates += res.Duplicates
				total.Unmapped += res.Unmapped
				return nil
			case errors.As(err, &invalid):
				byIndex := map[int][]meter.Problem{}
				for _, p := range invalid.Problems {
					if p.Index == nil || *p.Index < 0 || *p.Index >= len(idx) {
						return fmt.Errorf("a refusal names no event of the batch (%s)", describeProblems([]meter.Problem{p}))
					}
					byIndex[*p.Index] = append(byIndex[*p.Index], repeatedAt(p, evs, idx, lines))
				}
				kept := idx[:0:0]
				for j, i := range idx {
					if ps, ok := byIndex[j]; ok {
						refused[i] = describeProblems(ps)
						continue
					}
					kept = append(kept, i)
				}
				idx = kept
			case errors.As(err, &capped) && capped.Max > 0 && len(idx) > capped.Max:
				// A batch of at most the cap's events never meets it.
				for chunk := range slices.Chunk(idx, capped.Max) {
					if err := post(chunk); err != nil {
						return err
					}
				}
				return nil
			default:
				return err
			}
		}
		return nil
	}
	err := post(index)
	return total, refused, err
}

// repeatedAt names by line, rather than by its index in the batch, the
// earlier event whose id the problem's event repeats with other content.
func repeatedAt(p meter.Problem, evs []meter.Event, idx, lines []int) meter.Problem {
	i := *p.Index
	for j := 0; j < i; j++ {
		if evs[j].Tenant == evs[i].Tenant && evs[j].ID == evs[i].ID {
			p.Reason = fmt.Sprintf("repeats the id of line %d with different content", lines[idx[j]])
			return p
		}
	}
	return p
}

// describeProblems is a row's problems as one text: "field: reason; …".
func describeProblems(ps []meter.Problem) string {
	parts := make([]string, len(ps))
	for i, p := range ps {
		if p.Field == "" {
			parts[i] = p.Reason
		} else {
			parts[i] = p.Field + ": " + p.Reason
		}
	}
	return strings.Join(parts, "; ")
}

// summary prints the import's counts.
func (im *importer) summary(st importStats) {
	tw := tabwriter.NewWriter(im.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "files\t%d of %d\n", st.Files, len(im.files))
	fmt.Fprintf(tw, "rows read\t%d\n", st.Rows)
	fmt.Fprintf(tw, "accepted\t%d\n", st.Accepted)
	fmt.Fprintf(tw, "duplicates\t%d\n", st.Duplicates)
	fmt.Fprintf(tw, "unmapped\t%d\n", st.Unmapped)
	fmt.Fprintf(tw, "bad rows\t%d\n", st.Bad)
	if st.Old > 0 {
		fmt.Fprintf(tw, "too old for Stripe\t%d\t(older than %s: stored, and quarantined as timestamp_window when staged)\n",
			st.Old, formatDays(im.acceptPast))
	}
	fmt.Fprintf(tw, "elapsed\t%s\n", st.Elapsed.Round(time.Millisecond))
	fmt.Fprintf(tw, "events/s\t%.0f\n", st.rate())
	_ = tw.Flush()
}

// formatDays writes a duration of whole days as days.
func formatDays(d time.Duration) string {
	if d%(24*time.Hour) == 0 {
		return fmt.Sprintf("%d days", d/(24*time.Hour))
	}
	return d.String()
}
