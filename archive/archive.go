package archive

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/quarantine"
)

// Config is what Archive and Verify run with.
type Config struct {
	// Store is where the files go (TALLY_ARCHIVE_URL). Required.
	Store Store
	// InvoiceGrace is the node's invoice grace (TALLY_INVOICE_GRACE), for
	// tenants whose mapping sets none. Defaults to zero, which is never
	// more permissive than the node's: pass the node's setting.
	InvoiceGrace time.Duration
	// By names who runs the command, for the archives table and the audit
	// log. Required.
	By string
	// NewGeneration lets Archive write another generation of a period that
	// has a verified one (it never replaces it). Defaults to false: refused.
	NewGeneration bool
}

// ErrRefused is what every refusal of Archive wraps: the period is not
// ready to leave the database (or an archive of it is in the way).
var ErrRefused = errors.New("archive refused")

// Refusal is Archive's refusal: each reason names what is missing.
type Refusal struct {
	Period  string
	Reasons []string
}

func (r *Refusal) Error() string {
	return fmt.Sprintf("archive %s refused: %s", r.Period, strings.Join(r.Reasons, "; "))
}

// Is makes errors.Is(err, ErrRefused) true for a Refusal.
func (r *Refusal) Is(target error) bool { return target == ErrRefused }

// Result is what Archive wrote.
type Result struct {
	Manifest Manifest
	// ManifestSHA256 is the sha256 of manifest.json as stored.
	ManifestSHA256 string
}

// Archive writes period's archive (a new generation) to cfg.Store and
// records it as written. It refuses (a *Refusal) a period that is not
// closed, whose items are not all terminal, with open discrepancies, whose
// report does not hold, or that has a verified or detached archive (unless
// cfg.NewGeneration; docs/archive.md says why). It reads one REPEATABLE
// READ snapshot, so the files, the id ranges and the completeness totals
// describe the same instant, and it changes nothing but the archives table
// and the audit log.
func Archive(ctx context.Context, pool *pgxpool.Pool, period string, cfg Config) (Result, error) {
	from, to, err := cfg.check(period)
	if err != nil {
		return Result{}, err
	}
	conn, release, err := holdPeriods(ctx, pool, period)
	if err != nil {
		return Result{}, err
	}
	defer release()

	latest, err := latestArchive(ctx, conn, period)
	if err != nil {
		return Result{}, err
	}
	switch {
	case latest != nil && latest.State == StateDetached:
		return Result{}, &Refusal{Period: period, Reasons: []string{fmt.Sprintf(
			"generation %d is detached: the period's rows left the database with it", latest.Generation)}}
	case latest != nil && latest.State == StateVerified && !cfg.NewGeneration:
		return Result{}, &Refusal{Period: period, Reasons: []string{fmt.Sprintf(
			"generation %d is verified already (archive verify checks it again; --new-generation writes another beside it)",
			latest.Generation)}}
	}
	if reasons, err := openTenants(ctx, conn, from, to, cfg.InvoiceGrace); err != nil {
		return Result{}, err
	} else if len(reasons) > 0 {
		return Result{}, &Refusal{Period: period, Reasons: reasons}
	}

	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		return Result{}, fmt.Errorf("archive: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	args := pgx.NamedArgs{"from": from, "to": to}
	for _, s := range sqlItems {
		if _, err := tx.Exec(ctx, s, args); err != nil {
			return Result{}, fmt.Errorf("archive: selecting the period's items: %w", err)
		}
	}
	c, err := quarantine.LedgerCompletenessOf(ctx, tx, period, "")
	if err != nil {
		return Result{}, err
	}
	reasons, err := notTerminal(ctx, tx, c)
	if err != nil {
		return Result{}, err
	}
	if len(reasons) > 0 {
		return Result{}, &Refusal{Period: period, Reasons: reasons}
	}

	gen := 1
	if latest != nil {
		gen = latest.Generation + 1
	}
	// A generation whose files a crash left behind (no row in archives) is
	// skipped, never written over.
	for ; ; gen++ {
		ok, err := cfg.Store.Exists(ctx, prefix(period, gen)+"/"+files[0].name)
		if err != nil {
			return Result{}, err
		}
		if !ok {
			break
		}
	}
	var at time.Time
	if err := tx.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&at); err != nil {
		return Result{}, fmt.Errorf("archive: %w", err)
	}
	m := Manifest{Format: ManifestFormat, Period: period, Generation: gen,
		Location: cfg.Store.String() + "/" + prefix(period, gen), WrittenAt: at.UTC(), WrittenBy: cfg.By, Completeness: c}
	if m.LedgerMonths, err = ledgerMonths(ctx, tx, args); err != nil {
		return Result{}, err
	}
	if m.Files, err = writeFiles(ctx, tx, cfg.Store, prefix(period, gen), args); err != nil {
		return Result{}, err
	}
	body, sum, err := m.encode()
	if err != nil {
		return Result{}, err
	}
	p, err := cfg.Store.Create(ctx, prefix(period, gen)+"/"+manifestName)
	if err != nil {
		return Result{}, err
	}
	if _, err := p.Write(body); err != nil {
		p.Abort()
		return Result{}, fmt.Errorf("archive: writing the manifest: %w", err)
	}
	if err := p.Commit(); err != nil {
		return Result{}, err
	}
	if err := tx.Rollback(ctx); err != nil {
		return Result{}, fmt.Errorf("archive: %w", err)
	}

	wtx, err := conn.Begin(ctx)
	if err != nil {
		return Result{}, fmt.Errorf("archive: %w", err)
	}
	defer func() { _ = wtx.Rollback(ctx) }()
	if _, err := wtx.Exec(ctx, sqlInsertArchive, pgx.NamedArgs{"period": period, "generation": gen,
		"location": m.Location, "manifest": string(body), "sha": sum, "by": cfg.By}); err != nil {
		return Result{}, fmt.Errorf("archive: recording generation %d: %w", gen, err)
	}
	if err := audit.Record(ctx, wtx, audit.Entry{Actor: cfg.By, Action: ActionWrite, Subject: Subject(period),
		To: string(StateWritten), Details: map[string]any{"generation": gen, "manifest_sha256": sum, "location": m.Location,
			"files": len(m.Files)}}); err != nil {
		return Result{}, err
	}
	if err := wtx.Commit(ctx); err != nil {
		return Result{}, fmt.Errorf("archive: %w", err)
	}
	return Result{Manifest: m, ManifestSHA256: sum}, nil
}

// ledgerMonths counts the period's ledger rows by the month they occurred
// in, in the archive's snapshot.
func ledgerMonths(ctx context.Context, tx pgx.Tx, args pgx.NamedArgs) (map[string]int64, error) {
	rows, err := tx.Query(ctx, `SELECT to_char(e.occurred_at AT TIME ZONE 'UTC', 'YYYY-MM'), count(*) `+sqlPeriodEvents+` GROUP BY 1`, args)
	if err != nil {
		return nil, fmt.Errorf("archive: counting the ledger's months: %w", err)
	}
	months := map[string]int64{}
	var month string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&month, &n}, func() error { months[month] = n; return nil }); err != nil {
		return nil, fmt.Errorf("archive: counting the ledger's months: %w", err)
	}
	return months, nil
}

// The audit log's actions of the archive.
const (
	ActionWrite  = "archive.write"
	ActionVerify = "archive.verify"
	// ActionDetach is the detach's, recorded by MarkDetached.
	ActionDetach = "archive.detach"
)

// Subject is the audit log's subject of a period's archive.
func Subject(period string) string { return "archive:" + period }

const sqlInsertArchive = `
INSERT INTO archives (period, generation, state, location, manifest, manifest_sha256, written_by)
VALUES (@period, @generation, 'written', @location, @manifest::jsonb, @sha, @by)`

// check parses period and checks cfg names a store and who runs it.
func (cfg Config) check(period string) (from, to time.Time, err error) {
	if from, to, err = quarantine.ParsePeriod(period); err != nil {
		return from, to, err
	}
	if cfg.Store == nil || cfg.By == "" {
		return from, to, errors.New("archive: a store and who runs it are required")
	}
	return from, to, nil
}

// holdPeriods acquires a connection and takes the archive locks of
// periods on it, in the order given (callers give them oldest first);
// release unlocks them and gives the connection back.
func holdPeriods(ctx context.Context, pool *pgxpool.Pool, periods ...string) (*pgxpool.Conn, func(), error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("archive: %w", err)
	}
	var unlocks []func()
	release := func() {
		for i := len(unlocks) - 1; i >= 0; i-- {
			unlocks[i]()
		}
		conn.Release()
	}
	for _, p := range periods {
		unlock, err := lockPeriod(ctx, conn.Conn(), p)
		if err != nil {
			release()
			return nil, nil, err
		}
		unlocks = append(unlocks, unlock)
	}
	return conn, release, nil
}

// lockPeriod takes the session advisory lock of period's archive on conn,
// so that no two archives, verifies or detaches of one period run at
// once; it refuses when another holds it.
func lockPeriod(ctx context.Context, conn *pgx.Conn, period string) (func(), error) {
	h := fnv.New64a()
	h.Write([]byte("tally archive " + period))
	key := int64(h.Sum64())
	var ok bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, key).Scan(&ok); err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	if !ok {
		return nil, &Refusal{Period: period, Reasons: []string{"another archive, verify or detach of this period is running"}}
	}
	return func() { _, _ = conn.Exec(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock($1)`, key) }, nil
}

// sqlOpenTenants lists who keeps the month's billing periods open by the
// database's clock: each tenant mapping whose period starting in the month
// (the one holding its last instant) ends, plus the tenant's invoice grace
// (else @grace), later than now, and the calendar month itself for tenants
// without a mapping (anchor 1970-01-01, the node's grace). Its cost is the
// tenant mappings'.
const sqlOpenTenants = `
SELECT tenant, closes FROM (
    SELECT t.tenant, tally_period_end(@to::timestamptz - interval '1 microsecond', coalesce(t.period_anchor, '1970-01-01T00:00:00Z'))
           + coalesce(t.invoice_grace, @grace::interval) AS closes
    FROM tenant_mappings t
    UNION ALL
    SELECT '', @to::timestamptz + @grace::interval
) o
WHERE closes > statement_timestamp()
ORDER BY closes DESC, tenant`

// openTenants is the refusal's reasons for a period not yet closed.
func openTenants(ctx context.Context, q pgdb.Querier, from, to time.Time, grace time.Duration) ([]string, error) {
	rows, err := q.Query(ctx, sqlOpenTenants, pgx.NamedArgs{"from": from, "to": to, "grace": grace})
	if err != nil {
		return nil, fmt.Errorf("archive: reading the periods' ends: %w", err)
	}
	var (
		tenant string
		closes time.Time
		named  []string
		last   time.Time
		n      int
	)
	if _, err := pgx.ForEachRow(rows, []any{&tenant, &closes}, func() error {
		n++
		if n == 1 {
			last = closes
		}
		if len(named) < 5 {
			if tenant == "" {
				named = append(named, "tenants without a mapping")
			} else {
				named = append(named, tenant)
			}
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("archive: reading the periods' ends: %w", err)
	}
	if n == 0 {
		return nil, nil
	}
	return []string{fmt.Sprintf("the period is still open (its end plus the invoice grace is ahead) for %d tenant(s): %s; the last closes at %s",
		n, strings.Join(named, ", "), last.UTC().Format(time.RFC3339))}, nil
}

// sqlNotTerminal counts the period's items that are not terminal: every
// state but confirmed, withdrawn, superseded (its successor is among the
// items and answers for itself) and rejected with a reason (an error code
// of an attempt, an operator's or an error report's).
const sqlNotTerminal = `
SELECT CASE WHEN s.state = 'rejected' THEN 'rejected without a reason' ELSE s.state END, count(*), min(s.id)
FROM outbox_item_states s JOIN archive_items a ON a.id = s.id
WHERE s.state NOT IN ('confirmed', 'withdrawn', 'superseded', 'rejected')
   OR (s.state = 'rejected' AND coalesce(s.last_error_code, s.reported_code) IS NULL)
GROUP BY 1 ORDER BY 1`

// notTerminal is the refusal's reasons for a period whose items or report
// are not final: items not terminal, events not staged, open discrepancies,
// or a report that does not hold.
func notTerminal(ctx context.Context, tx pgx.Tx, c quarantine.Completeness) ([]string, error) {
	var reasons []string
	rows, err := tx.Query(ctx, sqlNotTerminal)
	if err != nil {
		return nil, fmt.Errorf("archive: reading the items' states: %w", err)
	}
	var (
		state   string
		n, item int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&state, &n, &item}, func() error {
		reasons = append(reasons, fmt.Sprintf("%d item(s) %s (first: item %d)", n, state, item))
		return nil
	}); err != nil {
		return nil, fmt.Errorf("archive: reading the items' states: %w", err)
	}
	var unstaged, discrepancies, broken int64
	for _, l := range c.Lines {
		unstaged += l.Unstaged.Events
		discrepancies += l.Discrepancies
		if !l.Holds {
			broken++
		}
	}
	if unstaged > 0 {
		reasons = append(reasons, fmt.Sprintf("%d event(s) not staged yet", unstaged))
	}
	if discrepancies > 0 {
		reasons = append(reasons, fmt.Sprintf("%d open discrepancy hour(s) (tally reconcile discrepancies; resolve them first)", discrepancies))
	}
	if broken > 0 {
		reasons = append(reasons, fmt.Sprintf("the completeness report does not hold on %d line(s)", broken))
	}
	return reasons, nil
}

// writeFiles writes every file of an archive under dir from the snapshot
// tx, in which sqlItems ran.
func writeFiles(ctx context.Context, tx pgx.Tx, store Store, dir string, args pgx.NamedArgs) ([]File, error) {
	var out []File
	for _, f := range files {
		w, err := writeFile(ctx, tx, store, dir+"/"+f.name, f, args)
		if err != nil {
			return nil, err
		}
		out = append(out, File{Name: f.name, Table: f.table, Rows: w.rows, Bytes: w.bytes, SHA256: w.sha256,
			IDColumn: f.idColumn, MinID: w.minID, MaxID: w.maxID})
	}
	return out, nil
}
