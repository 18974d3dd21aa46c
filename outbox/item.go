package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// itemColumns is every column of outbox_items that Item holds, in scanItem's
// order.
var itemColumns = []string{
	"id", "tenant_key", "subject_kind", "subject_ref", "exporter", "destination_account", "mode",
	"mapping_version", "identifier", "payload", "ordering_key", "state", "attempts", "refused_attempts",
	"attempts_base", "next_attempt_at", "first_attempt_at", "lease_owner", "leased_at", "lease_expires_at",
	"lease_token", "provider_ref", "accepted_at", "confirmed_at", "last_error_code", "last_error_status",
	"last_error", "quarantine_reason", "superseded_by", "created_at", "updated_at",
}

// bodyColumns are the columns of itemColumns that outbox_item_bodies holds
// (the identity, the payload and what is derived from them, never updated);
// outbox_item_states holds the others.
var bodyColumns = map[string]bool{
	"id": true, "tenant_key": true, "subject_kind": true, "subject_ref": true, "exporter": true,
	"destination_account": true, "mode": true, "mapping_version": true, "identifier": true, "payload": true,
	"ordering_key": true, "created_at": true,
}

// columns returns itemColumns, unqualified: for the outbox_items view.
func columns() string { return strings.Join(itemColumns, ", ") }

// splitColumns returns itemColumns, each qualified with the alias of the
// table that holds it: body for outbox_item_bodies, state for
// outbox_item_states ("b.id, b.tenant_key, …, o.state, …").
func splitColumns(body, state string) string {
	out := make([]string, len(itemColumns))
	for i, c := range itemColumns {
		alias := state
		if bodyColumns[c] {
			alias = body
		}
		out[i] = alias + "." + c
	}
	return strings.Join(out, ", ")
}

func scanItem(row pgx.Row) (Item, error) {
	var (
		it                       Item
		leaseOwner, ref          *string
		errCode, errMsg, qReason *string
		errStatus                *int
	)
	err := row.Scan(
		&it.ID, &it.TenantKey, &it.SubjectKind, &it.SubjectRef, &it.Exporter, &it.DestinationAccount, &it.Mode,
		&it.MappingVersion, &it.Identifier, &it.Payload, &it.OrderingKey, &it.State, &it.Attempts, &it.RefusedAttempts,
		&it.AttemptsBase, &it.NextAttemptAt, &it.FirstAttemptAt, &leaseOwner, &it.LeasedAt, &it.LeaseExpiresAt,
		&it.LeaseToken, &ref, &it.AcceptedAt, &it.ConfirmedAt, &errCode, &errStatus,
		&errMsg, &qReason, &it.SupersededBy, &it.CreatedAt, &it.UpdatedAt,
	)
	if err != nil {
		return Item{}, err
	}
	it.LeaseOwner = deref(leaseOwner)
	it.ProviderRef = deref(ref)
	it.QuarantineReason = Reason(deref(qReason))
	if errCode != nil {
		it.LastError = &ErrorInfo{Code: *errCode, Message: deref(errMsg)}
		if errStatus != nil {
			it.LastError.Status = *errStatus
		}
	}
	return it, nil
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// Get reads one item.
func (s *Store) Get(ctx context.Context, q pgdb.Querier, id int64) (Item, error) {
	it, err := scanItem(q.QueryRow(ctx, "SELECT "+columns()+" FROM outbox_items WHERE id = $1", id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Item{}, fmt.Errorf("%w: %d", ErrNotFound, id)
	}
	if err != nil {
		return Item{}, fmt.Errorf("outbox: reading item %d: %w", id, err)
	}
	return it, nil
}

// Attempt is one recorded attempt outcome of an item.
type Attempt struct {
	LeaseToken  int64      `json:"lease_token"`
	LeaseOwner  string     `json:"lease_owner"`
	LeasedAt    time.Time  `json:"leased_at"`
	Outcome     string     `json:"outcome"`
	StateAfter  State      `json:"state_after"`
	Refused     bool       `json:"refused"`
	ProviderRef string     `json:"provider_ref,omitempty"`
	Error       *ErrorInfo `json:"error,omitempty"`
	RecordedAt  time.Time  `json:"recorded_at"`
}

// Attempts reads the recorded attempts of an item, oldest first. A claim
// still in flight has no record yet.
func (s *Store) Attempts(ctx context.Context, q pgdb.Querier, id int64) ([]Attempt, error) {
	rows, err := q.Query(ctx, `
		SELECT lease_token, lease_owner, leased_at, outcome, state_after, refused, provider_ref,
		       error_code, error_status, error_message, recorded_at
		FROM outbox_attempts WHERE item_id = $1 ORDER BY lease_token`, id)
	if err != nil {
		return nil, fmt.Errorf("outbox: reading attempts of item %d: %w", id, err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Attempt, error) {
		var (
			a              Attempt
			ref, code, msg *string
			status         *int
		)
		if err := row.Scan(&a.LeaseToken, &a.LeaseOwner, &a.LeasedAt, &a.Outcome, &a.StateAfter, &a.Refused,
			&ref, &code, &status, &msg, &a.RecordedAt); err != nil {
			return a, err
		}
		a.ProviderRef = deref(ref)
		if code != nil {
			a.Error = &ErrorInfo{Code: *code, Status: deref(status), Message: deref(msg)}
		}
		return a, nil
	})
}

// ListFilter narrows List; empty fields match everything.
type ListFilter struct {
	State   State
	Tenant  string
	Feature string
	// After returns items with a greater id (the previous page's last).
	After int64
	// Limit is the page size, 1 to 1000. Defaults to 100.
	Limit int
}

// List reads items in id order, a page at a time.
func (s *Store) List(ctx context.Context, q pgdb.Querier, f ListFilter) ([]Item, error) {
	if f.Limit == 0 {
		f.Limit = 100
	}
	if f.Limit < 1 || f.Limit > 1000 {
		return nil, fmt.Errorf("outbox: list limit %d is outside 1..1000", f.Limit)
	}
	rows, err := q.Query(ctx, "SELECT "+columns()+` FROM outbox_items
		WHERE id > @after AND (@state = '' OR state = @state) AND (@tenant = '' OR tenant_key = @tenant)
		  AND (@feature = '' OR payload ->> 'feature' = @feature)
		ORDER BY id LIMIT @limit`,
		pgx.NamedArgs{"after": f.After, "state": string(f.State), "tenant": f.Tenant, "feature": f.Feature, "limit": f.Limit})
	if err != nil {
		return nil, fmt.Errorf("outbox: listing items: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Item, error) { return scanItem(r) })
}
