package invoices

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/errcode"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/redact"
	"github.com/tallymeter/tally/quarantine"
)

// ResolutionReason is why finance closed a check that differs.
type ResolutionReason string

// The reasons a check is resolved with.
const (
	// ResolvedCreditedInStripe: the invoice billed more and the customer
	// was credited the difference (a credit note). Only for invoiced_more.
	ResolvedCreditedInStripe ResolutionReason = "credited_in_stripe"
	// ResolvedInvoicedSeparately: the usage missing from the invoice was
	// billed another way (an invoice item on the next invoice, a one-off
	// invoice). Not for a check that only billed more.
	ResolvedInvoicedSeparately ResolutionReason = "invoiced_separately"
	// ResolvedAcceptStripe: the invoice stands; the difference is written
	// off.
	ResolvedAcceptStripe ResolutionReason = "accept_stripe"
	// ResolvedAcceptTally: the ledger is wrong and was, or will be,
	// corrected (a cancellation, a correction event).
	ResolvedAcceptTally ResolutionReason = "accept_tally"
)

// ResolutionReasons are every reason, in the order forms offer them.
var ResolutionReasons = []ResolutionReason{ResolvedCreditedInStripe, ResolvedInvoicedSeparately, ResolvedAcceptStripe, ResolvedAcceptTally}

// Valid says whether r is one of ResolutionReasons.
func (r ResolutionReason) Valid() bool { return slices.Contains(ResolutionReasons, r) }

// fits says whether r can close a check with kinds.
func (r ResolutionReason) fits(kinds []string) bool {
	switch r {
	case ResolvedCreditedInStripe:
		return slices.Contains(kinds, KindInvoicedMore)
	case ResolvedInvoicedSeparately:
		return slices.Contains(kinds, KindInvoicedLess) || slices.Contains(kinds, KindUsedNotInvoiced)
	}
	return r.Valid()
}

// Which checks List reads.
const (
	// ListOpen: checks that differ and are not resolved.
	ListOpen = "open"
	// ListResolved: checks finance resolved.
	ListResolved = "resolved"
	// ListAll: every check, those that match and those not compared too.
	ListAll = "all"
)

// Filter narrows List; empty fields match everything.
type Filter struct {
	// Period is a month ("YYYY-MM"): checks of periods that start in it.
	Period string
	Tenant string
	// Status is ListOpen (the default), ListResolved or ListAll.
	Status string
}

const sqlCheckColumns = `id, account, invoice, customer, event_name, formula, period_start, period_end, tenants, features,
    lines, prices, invoiced::text, expected::text, unbilled::text, status, kinds, reason, compared_at,
    resolution, resolution_note, resolved_by, resolved_at, currency, invoiced_amount, expected_amount, amount_note`

// sqlChecks lists checks, newest period first. Periods bound it to the
// month's rows (an index range); without one it reads every check, which
// grows with customers × meters × months.
const sqlChecks = `
SELECT ` + sqlCheckColumns + ` FROM invoice_checks
WHERE (@from::timestamptz IS NULL OR (period_start >= @from AND period_start < @to))
  AND (@tenant = '' OR @tenant = ANY(tenants))
  AND CASE @status WHEN 'open' THEN status = 'differs' AND resolved_at IS NULL
                   WHEN 'resolved' THEN resolved_at IS NOT NULL ELSE true END
ORDER BY period_start DESC, account, invoice, event_name
LIMIT 1000`

func scanCheck(row pgx.CollectableRow) (Check, error) {
	var (
		c                    Check
		invoiced, expected   *string
		unbilled             string
		status               string
		resolution, note, by *string
		resolvedAt           *time.Time
	)
	if err := row.Scan(&c.ID, &c.Account, &c.Invoice, &c.Customer, &c.EventName, &c.Formula, &c.PeriodStart, &c.PeriodEnd,
		&c.Tenants, &c.Features, &c.Lines, &c.Prices, &invoiced, &expected, &unbilled, &status, &c.Kinds, &c.Reason,
		&c.ComparedAt, &resolution, &note, &by, &resolvedAt, &c.Currency, &c.InvoicedAmount, &c.ExpectedAmount, &c.AmountNote); err != nil {
		return Check{}, err
	}
	c.Status = Status(status)
	c.PeriodStart, c.PeriodEnd = c.PeriodStart.UTC(), c.PeriodEnd.UTC()
	for _, v := range []struct {
		from *string
		to   **quarantine.Value
	}{{invoiced, &c.Invoiced}, {expected, &c.Expected}} {
		if v.from != nil {
			n, err := parseValue(*v.from)
			if err != nil {
				return Check{}, err
			}
			*v.to = &n
		}
	}
	n, err := parseValue(unbilled)
	if err != nil {
		return Check{}, err
	}
	c.Unbilled = n
	c.Resolution = resolutionOf(resolution, note, by, resolvedAt)
	return c, nil
}

// resolutionOf is a check's resolution from its columns; nil when none.
func resolutionOf(reason, note, by *string, at *time.Time) *Resolution {
	if reason == nil || note == nil || by == nil || at == nil {
		return nil
	}
	return &Resolution{Reason: ResolutionReason(*reason), Note: *note, By: *by, At: *at}
}

// List reads the checks f selects, at most 1000.
func List(ctx context.Context, q pgdb.Querier, f Filter) ([]Check, error) {
	args := pgx.NamedArgs{"from": nil, "to": nil, "tenant": f.Tenant, "status": f.Status}
	if f.Status == "" {
		args["status"] = ListOpen
	}
	if !slices.Contains([]string{ListOpen, ListResolved, ListAll}, args["status"].(string)) {
		return nil, ErrInvalidStatus
	}
	if f.Period != "" {
		from, to, err := quarantine.ParsePeriod(f.Period)
		if err != nil {
			return nil, err
		}
		args["from"], args["to"] = from, to
	}
	rows, err := q.Query(ctx, sqlChecks, args)
	if err != nil {
		return nil, fmt.Errorf("invoices: listing checks: %w", err)
	}
	checks, err := pgx.CollectRows(rows, scanCheck)
	if err != nil {
		return nil, fmt.Errorf("invoices: listing checks: %w", err)
	}
	return checks, nil
}

// ErrCheckNotFound is a check id no row has.
var ErrCheckNotFound = errcode.New(errcode.NotFound, "", "invoices: no such invoice check")

// ErrInvalidStatus is a List status that is none of open, resolved, all.
var ErrInvalidStatus = errcode.New(errcode.Invalid, "invalid_status", "invoices: status must be open, resolved or all")

// Refusals of Resolve.
var (
	ErrInvalidResolution = errcode.New(errcode.Invalid, "invalid_resolution", "invoices: a reason from the fixed set and a note are required")
	ErrNotADiscrepancy   = errcode.New(errcode.Conflict, "not_a_discrepancy", "invoices: only a check that differs is resolved")
	ErrResolved          = errcode.New(errcode.Conflict, "resolved", "invoices: the check was resolved already")
	ErrReasonDoesNotFit  = errcode.New(errcode.Invalid, "reason_does_not_fit", "invoices: the reason does not answer what the check found")
)

// Get reads one check.
func Get(ctx context.Context, q pgdb.Querier, id int64) (Check, error) {
	rows, err := q.Query(ctx, `SELECT `+sqlCheckColumns+` FROM invoice_checks WHERE id = $1`, id)
	if err != nil {
		return Check{}, err
	}
	c, err := pgx.CollectExactlyOneRow(rows, scanCheck)
	if errors.Is(err, pgx.ErrNoRows) {
		return Check{}, ErrCheckNotFound
	}
	return c, err
}

// Decision is finance's resolution of a check.
type Decision struct {
	Reason ResolutionReason
	Note   string
	By     string
}

// Resolve records finance's decision on a check that differs and is not
// resolved yet, audited in the same transaction. The numbers it was shown
// are the ones the check keeps: a later comparison that finds others
// opens it again.
func Resolve(ctx context.Context, db pgdb.Beginner, id int64, d Decision) (Check, error) {
	d.Note = redact.Message(d.Note)
	if d.Note == "" || !d.Reason.Valid() {
		return Check{}, ErrInvalidResolution
	}
	var out Check
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, `SELECT `+sqlCheckColumns+` FROM invoice_checks WHERE id = $1 FOR UPDATE`, id)
		if err != nil {
			return err
		}
		c, err := pgx.CollectExactlyOneRow(rows, scanCheck)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return ErrCheckNotFound
		case err != nil:
			return err
		case c.Status != Differs:
			return ErrNotADiscrepancy
		case c.Resolution != nil:
			return ErrResolved
		case !d.Reason.fits(c.Kinds):
			return ErrReasonDoesNotFit
		}
		if _, err := tx.Exec(ctx, `UPDATE invoice_checks SET resolution = $2, resolution_note = $3, resolved_by = $4,
			resolved_at = clock_timestamp() WHERE id = $1`, id, string(d.Reason), d.Note, d.By); err != nil {
			return err
		}
		if err := audit.Record(ctx, tx, audit.Entry{Actor: d.By, Action: audit.ActionInvoiceResolve,
			Subject: fmt.Sprintf("invoice_check:%d", id), From: string(Differs), To: string(d.Reason), Reason: d.Note,
			Details: map[string]any{"invoice": c.Invoice, "event_name": c.EventName, "kinds": c.Kinds}}); err != nil {
			return err
		}
		rows, err = tx.Query(ctx, `SELECT `+sqlCheckColumns+` FROM invoice_checks WHERE id = $1`, id)
		if err != nil {
			return err
		}
		out, err = pgx.CollectExactlyOneRow(rows, scanCheck)
		return err
	})
	if err != nil && errcode.Of(err) == errcode.Internal {
		return Check{}, fmt.Errorf("invoices: resolving check %d: %w", id, err)
	}
	return out, err
}

func parseValue(s string) (quarantine.Value, error) {
	var v quarantine.Value
	err := v.ScanText(pgtype.Text{String: s, Valid: true})
	return v, err
}
