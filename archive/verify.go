package archive

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/quarantine"
)

// ErrVerifyFailed is what a failed verification wraps.
var ErrVerifyFailed = errors.New("archive verification failed")

// VerifyError lists every problem one verification found; each names the
// file (or the comparison) it concerns.
type VerifyError struct {
	Period     string
	Generation int
	Problems   []string
}

func (e *VerifyError) Error() string {
	return fmt.Sprintf("archive %s generation %d failed verification: %s", e.Period, e.Generation, strings.Join(e.Problems, "; "))
}

// Is makes errors.Is(err, ErrVerifyFailed) true for a VerifyError.
func (e *VerifyError) Is(target error) bool { return target == ErrVerifyFailed }

// Verification is what Verify checked.
type Verification struct {
	Period     string
	Generation int
	// State is the generation's state after the verification.
	State State
	// Rows are the rows re-read, every file together.
	Rows int64
	// Bytes are the bytes re-read and hashed, every file together.
	Bytes int64
	// ComparedWithDatabase is false once the period is detached: the
	// database's rows are gone, the files are compared with the manifest.
	ComparedWithDatabase bool
}

// Verify re-reads every file of period's archive (generation gen, or the
// latest when 0) from cfg.Store, streaming: it checks each file's sha256,
// size and row count against the manifest, and the manifest's own sha256
// against the archives table; recomputes the completeness totals from the
// archived rows and compares them with the manifest's; and, while the
// period's rows are in the database, compares the manifest with the
// database's completeness report and row counts. Only when everything
// matches does it mark the generation verified. Every verification, passed
// or failed, is audited. A failure is a *VerifyError naming each problem.
func Verify(ctx context.Context, pool *pgxpool.Pool, period string, gen int, cfg Config) (Verification, error) {
	from, to, err := cfg.check(period)
	if err != nil {
		return Verification{}, err
	}
	conn, release, err := holdPeriods(ctx, pool, period)
	if err != nil {
		return Verification{}, err
	}
	defer release()
	rec, err := archiveOf(ctx, conn, period, gen)
	if err != nil {
		return Verification{}, err
	}
	if rec == nil {
		return Verification{}, fmt.Errorf("archive: no archive of %s (generation %d): run tally archive %s first", period, gen, period)
	}
	left, err := monthsLeft(ctx, conn, period)
	if err != nil {
		return Verification{}, err
	}
	v := Verification{Period: period, Generation: rec.Generation, State: rec.State,
		ComparedWithDatabase: rec.State != StateDetached && left == 0}
	problems, m := checkFiles(ctx, cfg.Store, rec, &v)
	if len(problems) == 0 {
		problems = append(problems, checkLedgerMonths(ctx, cfg.Store, rec, m)...)
	}
	if len(problems) == 0 {
		lines, err := recomputeFromStore(ctx, cfg.Store, rec, from, to)
		if err != nil {
			problems = append(problems, "recomputing the totals from the files: "+err.Error())
		} else {
			for _, d := range Differences(lines, m.Completeness.Lines, "files", "manifest") {
				problems = append(problems, "completeness "+d)
			}
		}
	}
	if v.ComparedWithDatabase {
		p, err := compareDatabase(ctx, conn, m, from, to)
		if err != nil {
			return Verification{}, err
		}
		problems = append(problems, p...)
	}

	tx, err := conn.Begin(ctx)
	if err != nil {
		return Verification{}, fmt.Errorf("archive: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	entry := audit.Entry{Actor: cfg.By, Action: ActionVerify, Subject: Subject(period), From: string(rec.State),
		Details: map[string]any{"generation": rec.Generation, "manifest_sha256": rec.ManifestSHA256, "rows": v.Rows,
			"bytes": v.Bytes, "compared_with_database": v.ComparedWithDatabase}}
	if len(problems) > 0 {
		entry.To, entry.Reason = "failed", strings.Join(problems, "; ")
		entry.Details["problems"] = len(problems)
	} else {
		entry.To = string(StateVerified)
		if rec.State == StateWritten {
			if _, err := tx.Exec(ctx, `UPDATE archives SET state = 'verified', verified_at = clock_timestamp(), verified_by = $3
				WHERE period = $1 AND generation = $2 AND state = 'written'`, period, rec.Generation, cfg.By); err != nil {
				return Verification{}, fmt.Errorf("archive: marking %s generation %d verified: %w", period, rec.Generation, err)
			}
			v.State = StateVerified
		} else {
			entry.To = string(rec.State)
		}
	}
	if err := audit.Record(ctx, tx, entry); err != nil {
		return Verification{}, err
	}
	if err := tx.Commit(ctx); err != nil {
		return Verification{}, fmt.Errorf("archive: %w", err)
	}
	if len(problems) > 0 {
		return v, &VerifyError{Period: period, Generation: rec.Generation, Problems: problems}
	}
	return v, nil
}

// checkFiles checks the manifest and every file it lists; it returns the
// problems and the manifest (the stored one when it matches the database's
// fingerprint, else the database's copy).
func checkFiles(ctx context.Context, store Store, rec *Record, v *Verification) ([]string, Manifest) {
	var problems []string
	var m Manifest
	if err := json.Unmarshal(rec.Manifest, &m); err != nil {
		return []string{"the archives table's manifest: " + err.Error()}, m
	}
	base := prefix(rec.Period, rec.Generation) + "/"
	if sum, _, err := hashObject(ctx, store, base+manifestName); err != nil {
		problems = append(problems, manifestName+": "+err.Error())
	} else if sum != rec.ManifestSHA256 {
		problems = append(problems, fmt.Sprintf("%s: sha256 %s, the archives table says %s (the manifest was changed)",
			manifestName, sum, rec.ManifestSHA256))
	}
	listed := map[string]bool{}
	for _, f := range m.Files {
		listed[f.Name] = true
		spec, ok := fileNamed(f.Name)
		if !ok {
			problems = append(problems, f.Name+": not a file of an archive")
			continue
		}
		sum, size, err := hashObject(ctx, store, base+f.Name)
		if err != nil {
			problems = append(problems, f.Name+": "+err.Error())
			continue
		}
		v.Bytes += size
		if size != f.Bytes {
			problems = append(problems, fmt.Sprintf("%s: %d bytes, the manifest says %d", f.Name, size, f.Bytes))
		}
		if sum != f.SHA256 {
			problems = append(problems, fmt.Sprintf("%s: sha256 %s, the manifest says %s", f.Name, sum, f.SHA256))
			continue
		}
		n, err := countRows(ctx, store, base+f.Name, spec)
		if err != nil {
			problems = append(problems, f.Name+": "+err.Error())
			continue
		}
		v.Rows += n
		if n != f.Rows {
			problems = append(problems, fmt.Sprintf("%s: %d rows, the manifest says %d", f.Name, n, f.Rows))
		}
	}
	for _, f := range files {
		if !listed[f.name] {
			problems = append(problems, f.name+": not in the manifest")
		}
	}
	return problems, m
}

// hashObject streams an object through sha256.
func hashObject(ctx context.Context, store Store, name string) (string, int64, error) {
	obj, err := store.Open(ctx, name)
	if err != nil {
		if errors.Is(err, ErrNotExist) {
			return "", 0, errors.New("missing")
		}
		return "", 0, err
	}
	defer func() { _ = obj.Close() }()
	h := sha256.New()
	n, err := io.Copy(h, obj)
	if err != nil {
		return "", 0, fmt.Errorf("reading: %w", err)
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// countRows reads every row of a file (streaming) and checks the count
// against its footer's.
func countRows(ctx context.Context, store Store, name string, f file) (int64, error) {
	obj, err := store.Open(ctx, name)
	if err != nil {
		return 0, err
	}
	defer func() { _ = obj.Close() }()
	r, err := openRows(obj, f)
	if err != nil {
		return 0, err
	}
	defer r.close()
	var n int64
	for {
		_, ok, err := r.next()
		if err != nil {
			return n, fmt.Errorf("reading row %d: %w", n, err)
		}
		if !ok {
			break
		}
		n++
	}
	if n != r.footerRows() {
		return n, fmt.Errorf("%d rows read, its footer says %d", n, r.footerRows())
	}
	return n, nil
}

// objectRows opens one file of rec's generation as a row source; the
// closers are run by the caller.
func objectRows(ctx context.Context, store Store, rec *Record, f file, closers *[]func()) (rowSource, error) {
	obj, err := store.Open(ctx, prefix(rec.Period, rec.Generation)+"/"+f.name)
	if err != nil {
		return nil, err
	}
	r, err := openRows(obj, f)
	if err != nil {
		_ = obj.Close()
		return nil, err
	}
	*closers = append(*closers, func() { r.close(); _ = obj.Close() })
	return r, nil
}

// checkLedgerMonths counts the ledger file's rows by the month they
// occurred in and compares the counts with the manifest's.
func checkLedgerMonths(ctx context.Context, store Store, rec *Record, m Manifest) []string {
	var closers []func()
	defer func() {
		for _, c := range closers {
			c()
		}
	}()
	spec, _ := fileNamed(fileEvents)
	src, err := objectRows(ctx, store, rec, spec, &closers)
	if err != nil {
		return []string{fileEvents + ": " + err.Error()}
	}
	months := map[string]int64{}
	if err := each(src, func(r record) { months[time.UnixMicro(r.int("occurred_at")).UTC().Format("2006-01")]++ }); err != nil {
		return []string{fileEvents + ": " + err.Error()}
	}
	var problems []string
	for _, month := range slices.Sorted(maps.Keys(months)) {
		if months[month] != m.LedgerMonths[month] {
			problems = append(problems, fmt.Sprintf("%s: %d rows occurred in %s, the manifest says %d", fileEvents, months[month], month, m.LedgerMonths[month]))
		}
	}
	for _, month := range slices.Sorted(maps.Keys(m.LedgerMonths)) {
		if _, ok := months[month]; !ok && m.LedgerMonths[month] != 0 {
			problems = append(problems, fmt.Sprintf("%s: no row occurred in %s, the manifest says %d", fileEvents, month, m.LedgerMonths[month]))
		}
	}
	return problems
}

// recomputeFromStore recomputes the completeness lines from rec's files.
func recomputeFromStore(ctx context.Context, store Store, rec *Record, from, to time.Time) ([]quarantine.Line, error) {
	var closers []func()
	defer func() {
		for _, c := range closers {
			c()
		}
	}()
	open := func(name string) func() (rowSource, error) {
		spec, _ := fileNamed(name)
		return func() (rowSource, error) { return objectRows(ctx, store, rec, spec, &closers) }
	}
	cancels := map[int64]string{}
	src, err := open(fileCancellations)()
	if err != nil {
		return nil, err
	}
	if err := each(src, func(r record) { cancels[r.int("event_row")] = r.str("outcome") }); err != nil {
		return nil, err
	}
	aggs := aggregations{}
	if src, err = open(fileFeatureMaps)(); err != nil {
		return nil, err
	}
	if err := each(src, func(r record) {
		f := r.str("feature")
		aggs[f] = append(aggs[f], struct {
			version int64
			agg     string
		}{r.int("version"), r.str("aggregation")})
	}); err != nil {
		return nil, err
	}
	events, err := open(fileEvents)()
	if err != nil {
		return nil, err
	}
	return recompute(from, to, events, open(fileBodies), open(fileStates), cancels, aggs)
}

// each calls fn with every record of src.
func each(src rowSource, fn func(record)) error {
	for {
		r, ok, err := src.next()
		if err != nil || !ok {
			return err
		}
		fn(r)
	}
}

// compareDatabase compares the manifest with the database, in one
// snapshot: the completeness report of the period and each file's row
// count (for mapping history, the rows up to the archived range's end).
func compareDatabase(ctx context.Context, conn *pgxpool.Conn, m Manifest, from, to time.Time) ([]string, error) {
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	args := pgx.NamedArgs{"from": from, "to": to}
	for _, s := range sqlItems {
		if _, err := tx.Exec(ctx, s, args); err != nil {
			return nil, fmt.Errorf("archive: selecting the period's items: %w", err)
		}
	}
	var problems []string
	c, err := quarantine.LedgerCompletenessOf(ctx, tx, m.Period, "")
	if err != nil {
		return nil, err
	}
	for _, d := range Differences(m.Completeness.Lines, c.Lines, "manifest", "database") {
		problems = append(problems, "completeness "+d)
	}
	for _, f := range m.Files {
		spec, ok := fileNamed(f.Name)
		if !ok {
			continue
		}
		q := `SELECT count(*) FROM (` + spec.query + `) q`
		a := pgx.NamedArgs{"from": from, "to": to}
		if spec.reference {
			q += ` WHERE q.` + spec.idColumn + ` <= @max`
			a["max"] = int64(0)
			if f.MaxID != nil {
				a["max"] = *f.MaxID
			}
		}
		var n int64
		if err := tx.QueryRow(ctx, q, a).Scan(&n); err != nil {
			return nil, fmt.Errorf("archive: counting %s: %w", spec.table, err)
		}
		if n != f.Rows {
			problems = append(problems, fmt.Sprintf("%s: the manifest says %d rows, the database holds %d", f.Name, f.Rows, n))
		}
	}
	return problems, nil
}
