package reconcile

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/redact"
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

// ReportResult says what recording one meter error report did.
type ReportResult struct {
	// Recorded is false when the event was recorded before (Stripe delivers
	// an event at least once); then nothing else was done.
	Recorded bool `json:"recorded"`
	// Failed counts the named items that were accepted and moved by fail_accepted,
	// to quarantined or rejected by their error code.
	Failed int `json:"failed"`
	// Noted counts the named items still in flight (pending, leased or
	// uncertain): the report is noted on them, and the accept recorded for
	// each afterwards lands where the report says (outbox.NoteFailures).
	Noted int `json:"noted"`
	// EvidenceOnly counts the named items in any other state (confirmed,
	// quarantined, rejected, …, an accepted item of the other mode, or an
	// in-flight one already noted with an equal or stronger verdict): they
	// keep their state, and the evidence stays for the reconciler and the
	// operator.
	EvidenceOnly int `json:"evidence_only"`
	// Unmatched counts the identifiers named that no item has (another
	// sender's events: Tally must be the only sender for its meters).
	Unmatched int `json:"unmatched"`
}

// RecordReport records a meter error report once and acts on it, in one
// transaction: the event; per failed event it names, the evidence against
// the item it names (traceSamples); store.FailAccepted for every named
// item still accepted, to quarantined or rejected as
// exporter.ClassifyReport says of its code; and a note on every named item
// still in flight (store.NoteFailures) — the report overtook the answer to
// the request it is about, and the accept recorded afterwards lands where
// the report says. An item named with several codes is rejected if any of
// them is not curable by a mapping fix. A named item in another state keeps
// it. An event recorded before changes nothing (Recorded false); one
// recorded only as foreign or unreadable (Events) is recorded now. A
// report's samples are a sample: items it does not name stay accepted, and
// the reconciler finds them. The event is recorded as delivered by the
// event destination, about no account in particular: Events records how
// each event arrived and which account it is about.
func RecordReport(ctx context.Context, db pgdb.DB, store *outbox.Store, rep stripeapi.MeterErrorReport) (ReportResult, error) {
	return recordReport(ctx, db, store, rep, origin{arrival: ArrivalDestination})
}

// origin is how an event reached Tally and the account it is about ("":
// not known).
type origin struct {
	arrival Arrival
	account string
}

// sqlRecordEvent records a readable event, or makes one recorded before
// as foreign or unreadable readable; it returns no row for an event
// recorded readable before (a redelivery). How the event first arrived and
// the account recorded first stay.
const sqlRecordEvent = `
INSERT INTO stripe_events (id, type, livemode, created, meter, error_count, account, context, arrival, status, read_at)
VALUES (@id, @type, @livemode, @created, @meter, @error_count, nullif(@account, ''), nullif(@context, ''), @arrival, 'recorded', clock_timestamp())
ON CONFLICT (id) DO UPDATE SET
    status = 'recorded', read_at = clock_timestamp(), meter = EXCLUDED.meter, error_count = EXCLUDED.error_count,
    account = coalesce(stripe_events.account, EXCLUDED.account), context = coalesce(stripe_events.context, EXCLUDED.context),
    fetch_code = NULL, fetch_status = NULL
WHERE stripe_events.status <> 'recorded'
RETURNING id`

func recordReport(ctx context.Context, db pgdb.DB, store *outbox.Store, rep stripeapi.MeterErrorReport, from origin) (ReportResult, error) {
	if store == nil {
		return ReportResult{}, errors.New("reconcile: recording a report needs the outbox")
	}
	var res ReportResult
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		res = ReportResult{}
		var meter *string
		if rep.Meter != "" {
			meter = &rep.Meter
		}
		rows, err := tx.Query(ctx, sqlRecordEvent, pgx.NamedArgs{"id": rep.ID, "type": rep.Type, "livemode": rep.Livemode,
			"created": rep.Created, "meter": meter, "error_count": rep.ErrorCount, "account": from.account,
			"context": rep.Context, "arrival": string(from.arrival)})
		if err != nil {
			return fmt.Errorf("reconcile: recording event %s: %w", rep.ID, err)
		}
		recorded, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return fmt.Errorf("reconcile: recording event %s: %w", rep.ID, err)
		}
		if len(recorded) == 0 {
			return nil // delivered again
		}
		res.Recorded = true
		names, err := traceSamples(ctx, tx, rep.Samples)
		if err != nil {
			return fmt.Errorf("reconcile: tracing the samples of event %s: %w", rep.ID, err)
		}
		// fail_accepted locks the named items for update: lock them first,
		// in ascending id order, the order every waiting writer of the
		// outbox uses, so that a report and a batch of outcomes or
		// confirmations over the same items — or two reports naming one
		// item — never deadlock. The evidence names only an item found and
		// locked here: that is its check, as it has no foreign key to the
		// items (a table on the coordinator may not reference a
		// distributed one).
		var candidates []string
		for _, n := range names {
			candidates = append(candidates, n.candidates...)
		}
		itemOf, err := store.LockIdentified(ctx, tx, candidates)
		if err != nil {
			return fmt.Errorf("reconcile: locking the items event %s names: %w", rep.ID, err)
		}
		for i, s := range rep.Samples {
			// The item the sample names; none (NULL) when Tally has none,
			// and the evidence keeps what the sample named.
			var item *int64
			identifier := names[i].named
			for _, c := range names[i].candidates {
				if id, ok := itemOf[c]; ok {
					item, identifier = &id, c
					break
				}
			}
			msg := redact.Message(s.Message)
			if _, err := tx.Exec(ctx, `INSERT INTO meter_error_evidence (event_id, identifier, item_id, code, message)
				VALUES ($1, $2, $3, $4, nullif($5, ''))
				ON CONFLICT DO NOTHING`, rep.ID, identifier, item, s.Code, msg); err != nil {
				return fmt.Errorf("reconcile: recording evidence of event %s: %w", rep.ID, err)
			}
		}
		return failNamed(ctx, tx, store, rep, &res)
	})
	if err != nil {
		return ReportResult{}, err
	}
	return res, nil
}

// sampleNames is what one sample of a report names: the identifiers of
// the items it may be about, in the order they are tried, and what the
// evidence records when none is Tally's.
type sampleNames struct {
	candidates []string
	named      string
}

// sqlItemOfRequest finds the accepted v1 item whose accepted answer had
// each Request-Id (provider_ref): a v1 call carries one event, so its id
// names one item. A stream request carries up to 100 events and names none
// of them alone: its items are left out (and a Request-Id that more than
// one item has names nothing). Only accepted items are read, through their
// partial index: an item in another state is not moved by a report, and
// the evidence of a sample that names it by id alone is not kept on it.
const sqlItemOfRequest = `
SELECT s.provider_ref, min(b.identifier)
FROM outbox_item_states s JOIN outbox_item_bodies b ON b.id = s.id
WHERE s.state = 'accepted' AND s.provider_ref = ANY(@refs::text[])
GROUP BY s.provider_ref
HAVING count(*) = 1 AND bool_and(s.exporter = @v1)`

// traceSamples says what each sample names: the item identifier its
// request.identifier or request.idempotency_key is — a v1 request's key is
// the identifier and the attempt (exporter.IdentifierOf), and Stripe has
// shown both fields — and, failing those, the one accepted v1 item whose
// answer had its request.id.
func traceSamples(ctx context.Context, tx pgx.Tx, samples []stripeapi.MeterErrorSample) ([]sampleNames, error) {
	var refs []string
	for _, s := range samples {
		if s.RequestID != "" {
			refs = append(refs, s.RequestID)
		}
	}
	byRequest := map[string]string{}
	if len(refs) > 0 {
		rows, err := tx.Query(ctx, sqlItemOfRequest, pgx.NamedArgs{"refs": refs, "v1": exporter.StripeMeterEvents})
		if err != nil {
			return nil, err
		}
		var ref, identifier string
		if _, err := pgx.ForEachRow(rows, []any{&ref, &identifier}, func() error {
			byRequest[ref] = identifier
			return nil
		}); err != nil {
			return nil, err
		}
	}
	out := make([]sampleNames, len(samples))
	for i, s := range samples {
		n := &out[i]
		for _, name := range []string{s.Identifier, s.IdempotencyKey} {
			if name != "" && !slices.Contains(n.candidates, exporter.IdentifierOf(name)) {
				n.candidates = append(n.candidates, exporter.IdentifierOf(name))
			}
		}
		if id, ok := byRequest[s.RequestID]; ok && !slices.Contains(n.candidates, id) {
			n.candidates = append(n.candidates, id)
		}
		n.named = cmp.Or(exporter.IdentifierOf(s.Identifier), exporter.IdentifierOf(s.IdempotencyKey), s.RequestID)
	}
	return out, nil
}

// failNamed applies fail_accepted to the accepted items the event's evidence names,
// and notes its failures on the named items still in flight.
func failNamed(ctx context.Context, tx pgx.Tx, store *outbox.Store, rep stripeapi.MeterErrorReport, res *ReportResult) error {
	n, err := readNamed(ctx, tx, rep)
	if err != nil {
		return err
	}
	res.Unmatched = n.unmatched
	var fs, notes []outbox.ProviderFailure
	for _, id := range n.order {
		if f, ok := n.failures[id]; ok {
			if n.flying[id] {
				notes = append(notes, f)
			} else {
				fs = append(fs, f)
			}
		}
	}
	noted, err := store.NoteFailures(ctx, tx, notes)
	if err != nil {
		return fmt.Errorf("reconcile: noting the failures event %s names: %w", rep.ID, err)
	}
	res.Noted = len(noted)
	failed, refused, err := store.FailAccepted(ctx, tx, fs)
	if err != nil {
		return fmt.Errorf("reconcile: failing the items event %s names: %w", rep.ID, err)
	}
	for id, e := range refused {
		// An item that left accepted since it was read keeps its new state;
		// anything else is a failure, and the whole report rolls back.
		if !errors.Is(e, outbox.ErrStateMismatch) {
			return fmt.Errorf("reconcile: failing item %d of event %s: %w", id, rep.ID, e)
		}
	}
	res.Failed = len(failed)
	res.EvidenceOnly = len(n.order) - res.Failed - res.Noted
	return nil
}

// named is what an event's recorded evidence names: its items, in the
// order first named; how many identifiers name no item; the failure each
// accepted or in-flight item comes to; and which of those are in flight
// (noted, not failed).
type named struct {
	order     []int64
	unmatched int
	flying    map[int64]bool
	failures  map[int64]outbox.ProviderFailure
}

// readNamed reads the evidence of event rep with the state of each item it
// names (when the item is of the report's mode), and classifies each
// accepted or in-flight item's failure by its error codes.
func readNamed(ctx context.Context, tx pgx.Tx, rep stripeapi.MeterErrorReport) (named, error) {
	mode := outbox.ModeTest
	if rep.Livemode {
		mode = outbox.ModeLive
	}
	// The item's state, when it is of the report's mode (else empty).
	rows, err := tx.Query(ctx, `SELECT e.identifier, e.item_id, e.code, coalesce(e.message, ''),
		    coalesce(CASE WHEN o.mode = $2 THEN o.state END, '')
		FROM meter_error_evidence e LEFT JOIN outbox_items o ON o.id = e.item_id
		WHERE e.event_id = $1 ORDER BY e.identifier, e.code`, rep.ID, string(mode))
	if err != nil {
		return named{}, fmt.Errorf("reconcile: reading the evidence of event %s: %w", rep.ID, err)
	}
	var (
		identifier, code, msg string
		item                  *int64
		state                 outbox.State
		seenItem              = map[int64]bool{}
		unmatched             = map[string]bool{}
		n                     = named{flying: map[int64]bool{}, failures: map[int64]outbox.ProviderFailure{}}
	)
	if _, err := pgx.ForEachRow(rows, []any{&identifier, &item, &code, &msg, &state}, func() error {
		if item == nil {
			unmatched[identifier] = true
			return nil
		}
		id := *item
		if !seenItem[id] {
			seenItem[id] = true
			n.order = append(n.order, id)
		}
		switch state {
		case outbox.StateAccepted:
		case outbox.StatePending, outbox.StateLeased, outbox.StateUncertain:
			n.flying[id] = true
		default:
			return nil // evidence only
		}
		to, reason := exporter.ClassifyReport(code)
		if to == "" {
			return nil // no failure (Stripe has the event): evidence only
		}
		f, seen := n.failures[id]
		// The first code decides, unless a later one is not curable: a
		// mapping fix would not cure the item then.
		if !seen || (f.To == outbox.StateQuarantined && to == outbox.StateRejected) {
			n.failures[id] = outbox.ProviderFailure{ID: id, To: to, Reason: reason, Error: outbox.ErrorInfo{Code: code, Message: msg}}
		}
		return nil
	}); err != nil {
		return named{}, fmt.Errorf("reconcile: reading the evidence of event %s: %w", rep.ID, err)
	}
	n.unmatched = len(unmatched)
	return n, nil
}

// EvidenceOf lists the error reports that name any of the items.
func EvidenceOf(ctx context.Context, q pgdb.Querier, items []int64) ([]Evidence, error) {
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
