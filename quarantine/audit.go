package quarantine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/pgdb"
)

// Drift is one key where the completeness counters and the full computation
// from the ledger disagree: a line (tenant, feature, period) and one of its
// buckets (ingested, confirmed, accepted, pending, unstaged, quarantined,
// uncertain, rejected, cancelled, period_closed, inconsistent_items — its
// count in Events — or destination_accounts, with both lists).
type Drift struct {
	Tenant   string `json:"tenant"`
	Feature  string `json:"feature"`
	Period   string `json:"period"`
	Bucket   string `json:"bucket"`
	Counters Bucket `json:"counters"`
	Ledger   Bucket `json:"ledger"`
	// CountersAccounts and LedgerAccounts are the two lists of a
	// destination_accounts drift.
	CountersAccounts []string `json:"counters_accounts,omitempty"`
	LedgerAccounts   []string `json:"ledger_accounts,omitempty"`
}

// String names the key and both values, for a log line or a terminal.
func (d Drift) String() string {
	if d.Bucket == "destination_accounts" {
		return fmt.Sprintf("tenant=%s feature=%s period=%s bucket=%s counters=[%s] ledger=[%s]", d.Tenant, d.Feature, d.Period,
			d.Bucket, strings.Join(d.CountersAccounts, " "), strings.Join(d.LedgerAccounts, " "))
	}
	return fmt.Sprintf("tenant=%s feature=%s period=%s bucket=%s counters=%d/%s ledger=%d/%s", d.Tenant, d.Feature, d.Period,
		d.Bucket, d.Counters.Events, d.Counters.Value, d.Ledger.Events, d.Ledger.Value)
}

// Audit is one comparison of a month's completeness counters with the full
// computation from the ledger, both read in one snapshot.
type Audit struct {
	ID          int64     `json:"id,omitempty"`
	Period      string    `json:"period"`
	Kind        string    `json:"kind"`
	StartedAt   time.Time `json:"started_at"`
	FinishedAt  time.Time `json:"finished_at"`
	Lines       int       `json:"lines"`
	DriftKeys   int       `json:"drift_keys"`
	Drift       []Drift   `json:"drift"`
	RequestedBy string    `json:"requested_by"`
}

// The kinds of audit, as completeness_audits.kind records them.
const (
	AuditVerify  = "verify"  // tally report completeness --verify
	AuditNightly = "nightly" // the periodic job
	AuditRepair  = "repair"  // tally report completeness --repair
)

// maxRecordedDrift bounds the keys an audit row keeps; DriftKeys counts
// them all, and the log and --verify name every one.
const maxRecordedDrift = 1000

// ErrPeriodArchived is wrapped by AuditCompleteness and
// RepairCompleteness for a period whose ledger rows have begun to leave
// the database: only its archive can audit it now.
var ErrPeriodArchived = errors.New("quarantine: the period's ledger is archived")

// AuditCompleteness compares the completeness counters of the month period
// ("YYYY-MM"), every tenant, with the full computation from the ledger,
// bucket by bucket, in one REPEATABLE READ snapshot (so that usage moving
// meanwhile is no drift). It reads the whole month: its cost is the full
// computation's (docs/performance.md). timeout bounds its statements (zero
// keeps the connection's statement_timeout). It records nothing
// (RecordAudit does).
func AuditCompleteness(ctx context.Context, db pgdb.DB, period, kind string, timeout time.Duration) (Audit, error) {
	from, _, err := ParsePeriod(period)
	if err != nil {
		return Audit{}, err
	}
	a := Audit{Period: period, Kind: kind, StartedAt: time.Now().UTC(), Drift: []Drift{}}
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return Audit{}, fmt.Errorf("quarantine: auditing the completeness of %s: %w", period, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if timeout > 0 {
		if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL statement_timeout = %d", timeout.Milliseconds())); err != nil {
			return Audit{}, err
		}
	}
	var left bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM usage_closed_months
		WHERE month IN ($1::date, ($1::date + interval '1 month')::date))`, from).Scan(&left); err != nil {
		return Audit{}, fmt.Errorf("quarantine: auditing the completeness of %s: %w", period, err)
	}
	if left {
		return Audit{}, fmt.Errorf("%w: a month of %s's ledger has left the database; its archive is the auditor (tally archive verify %s)",
			ErrPeriodArchived, period, period)
	}
	counters, err := CompletenessOf(ctx, tx, period, "")
	if err != nil {
		return Audit{}, err
	}
	ledger, err := LedgerCompletenessOf(ctx, tx, period, "")
	if err != nil {
		return Audit{}, err
	}
	a.Drift, a.Lines = compareCompleteness(counters, ledger)
	a.DriftKeys = len(a.Drift)
	a.FinishedAt = time.Now().UTC()
	return a, nil
}

// compareCompleteness lists every key where counters and ledger differ, in
// the order of the lines, and counts the lines of either.
func compareCompleteness(counters, ledger Completeness) ([]Drift, int) {
	type pair struct{ c, l *Line }
	byKey := map[[3]string]*pair{}
	var keys [][3]string
	for _, side := range []struct {
		lines   []Line
		counter bool
	}{{counters.Lines, true}, {ledger.Lines, false}} {
		for i := range side.lines {
			l := &side.lines[i]
			k := [3]string{l.Tenant, l.Feature, l.Period}
			p, ok := byKey[k]
			if !ok {
				p = &pair{}
				byKey[k] = p
				keys = append(keys, k)
			}
			if side.counter {
				p.c = l
			} else {
				p.l = l
			}
		}
	}
	slices.SortFunc(keys, func(a, b [3]string) int { return slices.Compare(a[:], b[:]) })
	drift := []Drift{}
	for _, k := range keys {
		p := byKey[k]
		c, l := p.c, p.l
		if c == nil {
			c = &Line{}
		}
		if l == nil {
			l = &Line{}
		}
		for _, b := range []struct {
			name string
			c, l Bucket
		}{
			{"ingested", c.Ingested, l.Ingested}, {"confirmed", c.Confirmed, l.Confirmed},
			{"accepted", c.Accepted, l.Accepted}, {"pending", c.Pending, l.Pending},
			{"unstaged", c.Unstaged, l.Unstaged}, {"quarantined", c.Quarantined, l.Quarantined},
			{"uncertain", c.Uncertain, l.Uncertain}, {"rejected", c.Rejected, l.Rejected},
			{"cancelled", c.Cancelled, l.Cancelled}, {"period_closed", c.PeriodClosed, l.PeriodClosed},
			{"inconsistent_items", Bucket{Events: c.InconsistentItems}, Bucket{Events: l.InconsistentItems}},
		} {
			if b.c.Events != b.l.Events || b.c.Value.Cmp(b.l.Value) != 0 {
				drift = append(drift, Drift{Tenant: k[0], Feature: k[1], Period: k[2], Bucket: b.name, Counters: b.c, Ledger: b.l})
			}
		}
		if !slices.Equal(c.Accounts, l.Accounts) {
			drift = append(drift, Drift{Tenant: k[0], Feature: k[1], Period: k[2], Bucket: "destination_accounts",
				CountersAccounts: orEmpty(c.Accounts), LedgerAccounts: orEmpty(l.Accounts)})
		}
	}
	return drift, len(keys)
}

func orEmpty(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// sqlRecordAudit appends an audit to completeness_audits.
const sqlRecordAudit = `
INSERT INTO completeness_audits (period, kind, started_at, lines, drift_keys, drift, requested_by)
VALUES (@period, @kind, @started, @lines, @keys, @drift, @by)
RETURNING id, finished_at`

// RecordAudit appends a to completeness_audits (at most 1000 of its keys;
// DriftKeys counts them all) and sets its ID and FinishedAt.
func RecordAudit(ctx context.Context, q pgdb.Querier, a *Audit, by string) error {
	kept := a.Drift
	if len(kept) > maxRecordedDrift {
		kept = kept[:maxRecordedDrift]
	}
	body, err := json.Marshal(kept)
	if err != nil {
		return err
	}
	a.RequestedBy = by
	if err := q.QueryRow(ctx, sqlRecordAudit, pgx.NamedArgs{"period": a.Period, "kind": a.Kind, "started": a.StartedAt,
		"lines": a.Lines, "keys": a.DriftKeys, "drift": body, "by": by}).Scan(&a.ID, &a.FinishedAt); err != nil {
		return fmt.Errorf("quarantine: recording the audit of %s: %w", a.Period, err)
	}
	return nil
}

// sqlLatestAudit reads the latest audit of a month.
const sqlLatestAudit = `
SELECT id, period, kind, started_at, finished_at, lines, drift_keys, drift, requested_by
FROM completeness_audits WHERE period = $1 ORDER BY id DESC LIMIT 1`

// LatestAudit is the latest recorded audit of the month period; ok is false
// before the first.
func LatestAudit(ctx context.Context, q pgdb.Querier, period string) (Audit, bool, error) {
	var (
		a    Audit
		body []byte
	)
	err := q.QueryRow(ctx, sqlLatestAudit, period).Scan(&a.ID, &a.Period, &a.Kind, &a.StartedAt, &a.FinishedAt,
		&a.Lines, &a.DriftKeys, &body, &a.RequestedBy)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Audit{}, false, nil
	case err != nil:
		return Audit{}, false, fmt.Errorf("quarantine: reading the latest audit of %s: %w", period, err)
	}
	if err := json.Unmarshal(body, &a.Drift); err != nil {
		return Audit{}, false, err
	}
	a.StartedAt, a.FinishedAt = a.StartedAt.UTC(), a.FinishedAt.UTC()
	return a, true, nil
}

// sqlLockCounters holds every writer of the counters (the triggers of every
// write that moves usage) until the repair commits: they wait, they do not
// fail, and what they add after it lands on the rewritten counters.
const sqlLockCounters = `LOCK TABLE completeness_counters, completeness_items IN SHARE ROW EXCLUSIVE MODE`

// RepairCompleteness rewrites the completeness counters of the month
// period from the ledger and the outbox (completeness_recount), for an
// operator who read the drift (tally report completeness --repair): it
// audits the month first, then, in one transaction that holds the
// counters' writers, rewrites it, records the audit as a repair and the
// action in the audit log. Writes that move usage wait for it (the month's
// full computation: docs/reports.md). It returns the audit of what it
// repaired.
func RepairCompleteness(ctx context.Context, db pgdb.DB, period, by string, timeout time.Duration) (Audit, error) {
	from, to, err := ParsePeriod(period)
	if err != nil {
		return Audit{}, err
	}
	a, err := AuditCompleteness(ctx, db, period, AuditRepair, timeout)
	if err != nil {
		return Audit{}, err
	}
	tx, err := db.BeginTx(ctx, pgx.TxOptions{})
	if err != nil {
		return Audit{}, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if timeout > 0 {
		if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL statement_timeout = %d", timeout.Milliseconds())); err != nil {
			return Audit{}, err
		}
	}
	if _, err := tx.Exec(ctx, sqlLockCounters); err != nil {
		return Audit{}, fmt.Errorf("quarantine: locking the completeness counters: %w", err)
	}
	if _, err := tx.Exec(ctx, `SELECT completeness_recount($1, $2)`, from, to); err != nil {
		return Audit{}, fmt.Errorf("quarantine: recounting %s: %w", period, err)
	}
	if err := RecordAudit(ctx, tx, &a, by); err != nil {
		return Audit{}, err
	}
	if err := audit.Record(ctx, tx, audit.Entry{Actor: by, Action: audit.ActionCompletenessRepair, Subject: "completeness:" + period,
		Details: map[string]any{"audit": a.ID, "drift_keys": a.DriftKeys}}); err != nil {
		return Audit{}, err
	}
	if err := tx.Commit(ctx); err != nil {
		return Audit{}, fmt.Errorf("quarantine: repairing %s: %w", period, err)
	}
	return a, nil
}

// Table writes the audit for a terminal: what was compared, then every key
// that differs, one a line.
func (a Audit) Table(w io.Writer) error {
	verb := "differ"
	if a.Kind == AuditRepair {
		verb = "differed and were rewritten from the ledger"
	}
	if _, err := fmt.Fprintf(w, "audit %d (%s) of %s: %d lines, %d keys %s\n", a.ID, a.Kind, a.Period, a.Lines, a.DriftKeys, verb); err != nil {
		return err
	}
	if len(a.Drift) == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "TENANT\tFEATURE\tPERIOD\tBUCKET\tCOUNTERS\tLEDGER\t")
	for _, d := range a.Drift {
		c, l := fmt.Sprintf("%d events, %s", d.Counters.Events, d.Counters.Value), fmt.Sprintf("%d events, %s", d.Ledger.Events, d.Ledger.Value)
		if d.Bucket == "destination_accounts" {
			c, l = strings.Join(d.CountersAccounts, " "), strings.Join(d.LedgerAccounts, " ")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t\n", d.Tenant, d.Feature, d.Period, d.Bucket, c, l)
	}
	return tw.Flush()
}
