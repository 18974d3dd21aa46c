package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Evidence is one of Stripe's meter error reports naming an item: Stripe
// accepted the event, then failed it.
type Evidence struct {
	EventID    string    `json:"event_id"`
	EventType  string    `json:"event_type"`
	Received   time.Time `json:"received_at"`
	Identifier string    `json:"identifier"`
	ItemID     *int64    `json:"item_id"`
	Code       string    `json:"code"`
	Message    string    `json:"message,omitempty"`
}

// RecordReport records a meter error report once: the event, and per
// failed event it names, the evidence against the item with that
// identifier. It reports false when the event was recorded before (Stripe
// delivers an event at least once).
func RecordReport(ctx context.Context, db DB, rep stripeapi.MeterErrorReport) (bool, error) {
	recorded := false
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var meter *string
		if rep.Meter != "" {
			meter = &rep.Meter
		}
		tag, err := tx.Exec(ctx, `INSERT INTO stripe_events (id, type, livemode, created, meter, error_count)
			VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (id) DO NOTHING`,
			rep.ID, rep.Type, rep.Livemode, rep.Created, meter, rep.ErrorCount)
		if err != nil {
			return fmt.Errorf("reconcile: recording event %s: %w", rep.ID, err)
		}
		if tag.RowsAffected() == 0 {
			return nil // delivered again
		}
		recorded = true
		for _, s := range rep.Samples {
			msg := outbox.ErrorInfo{Code: "x", Message: s.Message}.Sanitized().Message
			if _, err := tx.Exec(ctx, `INSERT INTO meter_error_evidence (event_id, identifier, item_id, code, message)
				VALUES ($1, $2, (SELECT id FROM outbox_items WHERE identifier = $2), $3, nullif($4, ''))
				ON CONFLICT DO NOTHING`, rep.ID, s.Identifier, s.Code, msg); err != nil {
				return fmt.Errorf("reconcile: recording evidence of event %s: %w", rep.ID, err)
			}
		}
		return nil
	})
	return recorded, err
}

// EvidenceOf lists the error reports that name any of the items.
func EvidenceOf(ctx context.Context, q outbox.Querier, items []int64) ([]Evidence, error) {
	rows, err := q.Query(ctx, `SELECT e.event_id, s.type, s.received_at, e.identifier, e.item_id, e.code, coalesce(e.message, '')
		FROM meter_error_evidence e JOIN stripe_events s ON s.id = e.event_id
		WHERE e.item_id = ANY($1) ORDER BY s.received_at, e.event_id, e.identifier`, items)
	if err != nil {
		return nil, fmt.Errorf("reconcile: reading evidence: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Evidence, error) {
		var e Evidence
		err := row.Scan(&e.EventID, &e.EventType, &e.Received, &e.Identifier, &e.ItemID, &e.Code, &e.Message)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: reading evidence: %w", err)
	}
	if out == nil {
		out = []Evidence{}
	}
	return out, nil
}
