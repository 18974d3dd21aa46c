// Package audit owns the audit log: one row per operator action — a
// requeue, a recovery, a mapping change, a token created or revoked, a
// console sign-in — with who did it, when, what it acted on, from which
// state to which, and why.
//
// Record is called inside the transaction of the action, so that an action
// and its entry commit or fail together. It must never update or delete an
// entry (the database refuses both) and never store a secret: reasons are
// sanitised like every error column.
package audit

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/redact"
)

// Actions.
const (
	ActionRequeue        = "requeue"
	ActionReaddress      = "readdress"
	ActionRecover        = "recover"
	ActionFeatureMapping = "mapping.feature"
	ActionTenantMapping  = "mapping.tenant"
	// ActionTokenCreate and ActionTokenRevoke are a token made or ended,
	// by tally tokens or by a configured value at start.
	ActionTokenCreate = "token.create"
	ActionTokenRevoke = "token.revoke"
	// ActionSessionOpen is a console sign-in.
	ActionSessionOpen = "session.open"
	// ActionLedgerDetach is a month of the ledger detached and dropped
	// after its archive was verified.
	ActionLedgerDetach = "ledger.detach"
	// ActionCompletenessRepair is a month's completeness counters
	// rewritten from the ledger (tally report completeness --repair).
	ActionCompletenessRepair = "completeness.repair"
	// ActionInvoiceResolve is finance's resolution of an invoice check
	// that differs.
	ActionInvoiceResolve = "invoice.resolve"
	// ActionInvoiceHold and ActionInvoiceRelease are a draft invoice held
	// by the invoice gate (auto_advance false) and given back to Stripe.
	ActionInvoiceHold    = "invoice.hold"
	ActionInvoiceRelease = "invoice.release"
)

// Entry is one audited action.
type Entry struct {
	ID      int64          `json:"id"`
	At      time.Time      `json:"at"`
	Actor   string         `json:"actor"`
	Action  string         `json:"action"`
	Subject string         `json:"subject"`
	From    string         `json:"from,omitempty"`
	To      string         `json:"to,omitempty"`
	Reason  string         `json:"reason,omitempty"`
	Details map[string]any `json:"details,omitempty"`
}

// Item is the subject of an outbox item.
func Item(id int64) string { return fmt.Sprintf("item:%d", id) }

// Token is the subject of an API token, by its name.
func Token(name string) string { return "token:" + name }

// Record writes e in the caller's transaction. The reason is sanitised (no
// secret, no control characters, at most 200 characters).
func Record(ctx context.Context, q pgdb.Querier, e Entry) error {
	if e.Actor == "" {
		e.Actor = "unknown"
	}
	details := e.Details
	if details == nil {
		details = map[string]any{}
	}
	b, err := json.Marshal(details)
	if err != nil {
		return fmt.Errorf("audit: details: %w", err)
	}
	reason := redact.Message(e.Reason)
	_, err = q.Exec(ctx, `INSERT INTO audit_log (actor, action, subject, from_state, to_state, reason, details)
		VALUES ($1, $2, $3, nullif($4, ''), nullif($5, ''), nullif($6, ''), $7)`,
		e.Actor, e.Action, e.Subject, e.From, e.To, reason, b)
	if err != nil {
		return fmt.Errorf("audit: recording %s of %s: %w", e.Action, e.Subject, err)
	}
	return nil
}

// List reads entries, newest first: of one subject when subject is set.
func List(ctx context.Context, q pgdb.Querier, subject string, limit int) ([]Entry, error) {
	rows, err := q.Query(ctx, `SELECT id, at, actor, action, subject, coalesce(from_state, ''), coalesce(to_state, ''),
			coalesce(reason, ''), details
		FROM audit_log WHERE ($1 = '' OR subject = $1) ORDER BY id DESC LIMIT $2`, subject, limit)
	if err != nil {
		return nil, fmt.Errorf("audit: listing: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Entry, error) {
		var e Entry
		err := row.Scan(&e.ID, &e.At, &e.Actor, &e.Action, &e.Subject, &e.From, &e.To, &e.Reason, &e.Details)
		if len(e.Details) == 0 {
			e.Details = nil
		}
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("audit: listing: %w", err)
	}
	if out == nil {
		out = []Entry{}
	}
	return out, nil
}
