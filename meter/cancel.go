package meter

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// Cancellations (docs/design.md). A
// cancellation names an earlier event by tenant and id and ends in exactly
// one outcome, decided in the caller's transaction with the event's ledger
// row and the item that carries it locked.
//
// An event whose item Stripe refused (rejected) needs nothing taken back
// (not_billed); usage no attempt of which may have
// reached Stripe leaves its window — an unstaged event is staged straight
// into a withdrawn item (stage_withdrawn); a pending or quarantined per-event item is
// withdrawn (withdraw); a window's item is re-addressed without the event
// (supersede_cancelled), or withdrawn when nothing else is left in it. A count event
// Stripe has gets an adjustment item within its 24 hours, else a
// quarantined cancel_too_late item; a last window's event a quarantined
// cancel_last_value item; a sum window's event an offsetting item of the
// negated value (a supplement carrying no ledger row). A window whose
// feature is unmapped now, or no longer a window, refuses the request with
// a *CancelError of CodeCancelSent and stores nothing. The doors are POST
// /v1/usage/cancellations and tally cancel.

// Cancellation names an earlier event.
type Cancellation struct {
	Tenant string `json:"tenant"`
	ID     string `json:"id"`
}

// The outcomes of a cancellation (usage_cancellations.outcome).
const (
	// CancelWithdrawn: no attempt of the event may have reached Stripe; it
	// left its window.
	CancelWithdrawn = "withdrawn"
	// CancelNotBilled: Stripe refused the item that carries the event
	// (rejected): there is nothing to take back.
	CancelNotBilled = "not_billed"
	// CancelAdjustment: a count event Stripe received less than 24 hours
	// ago; an item of its own cancels it (a meter event adjustment).
	CancelAdjustment = "adjustment"
	// CancelRefused: Stripe cannot take the usage back (too late, or a
	// last value); a quarantined item of its own keeps it for finance
	// (Reason cancel_too_late or cancel_last_value).
	CancelRefused = "refused"
	// CancelSupplement: an event of a sum window Stripe has; a supplement
	// of the window with the negated value offsets it.
	CancelSupplement = "supplement"
)

// DefaultCancelMargin is how long before Stripe's 24 hours, counted from
// an event's first attempt, Tally stops asking Stripe to cancel it: time
// for the adjustment to be claimed, sent and retried.
const DefaultCancelMargin = time.Hour

// cancelWindow is how long after receiving an event Stripe takes a
// cancellation of it (docs/stripe.md).
const cancelWindow = 24 * time.Hour

// CancelResult is what became of one cancellation.
type CancelResult struct {
	Tenant string `json:"tenant"`
	ID     string `json:"id"`
	// Outcome is one of the Cancel… outcomes.
	Outcome string `json:"outcome"`
	// Item is the item that takes the event back: the withdrawn item, the
	// successor its window was re-addressed to (nil when the window held
	// nothing else and was withdrawn), or the adjustment, supplement or
	// refused cancellation item.
	Item *int64 `json:"item"`
	// Reason is why a refused cancellation cannot be applied.
	Reason string `json:"reason,omitempty"`
	// Duplicate says the event was cancelled before (by this request or an
	// earlier one): the first outcome is returned and nothing changes.
	Duplicate bool `json:"duplicate"`
}

// The codes of a *CancelError.
const (
	// CodeCancelInFlight: the carrying item is leased; ask again once its
	// lease ends.
	CodeCancelInFlight = "item_in_flight"
	// CodeCancelUncertain: the carrying item is uncertain; a human decides
	// first whether Stripe has it.
	CodeCancelUncertain = "item_uncertain"
	// CodeCancelSent: Stripe may have the usage of a window whose feature
	// is unmapped now, or no longer a window: nothing tells how to take it
	// back.
	CodeCancelSent = "usage_sent"
	// CodeCancelUnsettled: Stripe may have the usage and its item is still
	// being retried or waits in quarantine: ask again once it settles.
	CodeCancelUnsettled = "item_unsettled"
)

// CancelError refuses a request because of one cancellation's carrying
// item; nothing of the request is stored.
type CancelError struct {
	Index int
	Code  string
	Item  int64
	State outbox.State
}

func (e *CancelError) Error() string {
	return fmt.Sprintf("meter: cancellation %d: %s (item %d is %s)", e.Index, e.Code, e.Item, e.State)
}

// Cancel cancels the events cs names, inside the caller's transaction, as
// by (the audit's actor). Malformed or unknown events are an
// *InvalidBatchError listing every one; an event whose item cannot be
// decided now is a *CancelError. On any error the caller rolls back:
// nothing is half-stored.
func (s *Stager) Cancel(ctx context.Context, tx pgx.Tx, by string, cs []Cancellation) ([]CancelResult, error) {
	var problems []Problem
	for i, c := range cs {
		idx := i
		if !mappings.ValidName(c.Tenant) {
			problems = append(problems, Problem{Index: &idx, Field: "tenant", Reason: "1 to 64 characters: letters, digits and _.:- (starting with a letter or digit)"})
		}
		if !validEventID(c.ID) {
			problems = append(problems, Problem{Index: &idx, Field: "id", Reason: "1 to 128 printable ASCII characters"})
		}
	}
	if len(problems) > 0 {
		return nil, &InvalidBatchError{Problems: problems}
	}
	out := make([]CancelResult, len(cs))
	for i, c := range cs {
		res, found, err := s.cancelOne(ctx, tx, by, i, c)
		if err != nil {
			return nil, err
		}
		if !found {
			idx := i
			reason := "no event with this id for this tenant"
			// A key without its row: the event's month left the ledger.
			var month time.Time
			err := tx.QueryRow(ctx, sqlCancelKey, c.Tenant, c.ID, tenantbucket.Of(c.Tenant)).Scan(&month)
			switch {
			case err == nil:
				reason = fmt.Sprintf("%s: the ledger of %s is archived and detached; its events cannot be cancelled", PeriodClosed, month.UTC().Format("2006-01"))
			case !errors.Is(err, pgx.ErrNoRows):
				return nil, fmt.Errorf("meter: reading the key of %s/%s: %w", c.Tenant, c.ID, err)
			}
			problems = append(problems, Problem{Index: &idx, Field: "id", Reason: reason})
			continue
		}
		out[i] = res
	}
	if len(problems) > 0 {
		return nil, &InvalidBatchError{Problems: problems}
	}
	return out, nil
}

// The statements of a cancellation each name the tenant's bucket: every
// table they read or write holds it, so each is one shard's.
const (
	// sqlCancelKey reads the month of an event's key.
	sqlCancelKey = `SELECT occurred_at FROM usage_event_keys WHERE bucket = $3 AND tenant = $1 AND event_key = md5($2)::uuid`
	// sqlCancelLock locks the event's ledger row, found through its key.
	sqlCancelLock = `SELECT e.id, e.feature, e.value, e.occurred_at, e.item_id FROM usage_event_keys k
	JOIN usage_events e ON e.id = k.event_row AND e.occurred_at = k.occurred_at AND e.bucket = k.bucket
	WHERE k.bucket = $3 AND e.bucket = $3 AND k.tenant = $1 AND k.event_key = md5($2)::uuid AND e.event_id = $2 FOR UPDATE OF e`
	// sqlCancelled reads the event's cancellation, if any.
	sqlCancelled = `SELECT outcome, item_id, reason FROM usage_cancellations WHERE bucket = $2 AND event_row = $1`
	// sqlCancelMark marks the ledger row cancelled.
	sqlCancelMark = `UPDATE usage_events SET cancelled_at = statement_timestamp() WHERE bucket = $3 AND id = $1 AND occurred_at = $2`
	// sqlCancelRecord records the cancellation.
	sqlCancelRecord = `INSERT INTO usage_cancellations (tenant, event_id, event_row, outcome, reason, carried_by, item_id, requested_by, bucket)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`
	// sqlCancelLeft counts the rows not cancelled of the item at the root
	// of item $1's chain of predecessors (the item the ledger rows name):
	// tally_root_item with the bucket, which a successor shares with its
	// predecessor.
	sqlCancelLeft = `WITH RECURSIVE chain (id, depth) AS (
	    SELECT $1::bigint, 0
	    UNION ALL
	    SELECT o.id, c.depth + 1 FROM outbox_item_states o JOIN chain c ON o.superseded_by = c.id
	    WHERE o.bucket = $2 AND c.depth < 1000
	)
	SELECT count(*) FROM usage_events
	WHERE bucket = $2 AND item_id = (SELECT id FROM chain ORDER BY depth DESC LIMIT 1) AND cancelled_at IS NULL`
	// sqlCancelDeadline says whether a per-event item's first attempt is
	// recent enough for an adjustment, and Stripe's deadline.
	sqlCancelDeadline = `SELECT first_attempt_at + @window::interval - @margin::interval > statement_timestamp(),
	floor(extract(epoch FROM first_attempt_at + @window::interval))::bigint
	FROM outbox_item_states WHERE bucket = @bucket AND id = @id`
)

// ledgerRow is the locked ledger row of a cancelled event.
type ledgerRow struct {
	id      int64
	feature string
	value   int64
	at      time.Time
	item    *int64
}

// cancelOne decides one cancellation; found is false for an unknown event.
func (s *Stager) cancelOne(ctx context.Context, tx pgx.Tx, by string, index int, c Cancellation) (CancelResult, bool, error) {
	res := CancelResult{Tenant: c.Tenant, ID: c.ID}
	bucket := tenantbucket.Of(c.Tenant)
	// The row first: a concurrent cancellation of the same event waits
	// here, and then (a statement of its own, under READ COMMITTED) finds
	// the first one's record below and answers it.
	var row ledgerRow
	err := tx.QueryRow(ctx, sqlCancelLock, c.Tenant, c.ID, bucket).Scan(&row.id, &row.feature, &row.value, &row.at, &row.item)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return res, false, nil
	case err != nil:
		return res, false, fmt.Errorf("meter: locking the event %s/%s: %w", c.Tenant, c.ID, err)
	}
	var reason *string
	err = tx.QueryRow(ctx, sqlCancelled, row.id, bucket).
		Scan(&res.Outcome, &res.Item, &reason)
	if reason != nil {
		res.Reason = *reason
	}
	switch {
	case err == nil:
		res.Duplicate = true
		return res, true, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return res, false, fmt.Errorf("meter: reading the cancellation of %s/%s: %w", c.Tenant, c.ID, err)
	}
	if _, err := tx.Exec(ctx, sqlCancelMark, row.id, row.at, bucket); err != nil {
		return res, false, fmt.Errorf("meter: marking the event %s/%s cancelled: %w", c.Tenant, c.ID, err)
	}
	var carried *int64
	if row.item == nil {
		item, err := s.withdrawUnstaged(ctx, tx, c.Tenant, row)
		if err != nil {
			return res, false, err
		}
		res.Outcome, res.Item = CancelWithdrawn, &item
	} else {
		live, err := s.Outbox.LockLive(ctx, tx, *row.item, bucket)
		if err != nil {
			return res, false, err
		}
		carried = &live.ID
		switch {
		case live.State == outbox.StateLeased:
			return res, false, &CancelError{Index: index, Code: CodeCancelInFlight, Item: live.ID, State: live.State}
		case live.State == outbox.StateUncertain:
			return res, false, &CancelError{Index: index, Code: CodeCancelUncertain, Item: live.ID, State: live.State}
		case live.State == outbox.StateRejected:
			// Stripe refused the item (terminal): nothing of it was billed.
			res.Outcome = CancelNotBilled
		case (live.State == outbox.StatePending || live.State == outbox.StateQuarantined) && live.RefusedAttempts == live.Attempts:
			item, err := s.leaveWindow(ctx, tx, live)
			if err != nil {
				return res, false, err
			}
			res.Outcome, res.Item = CancelWithdrawn, item
		case live.State == outbox.StatePending || live.State == outbox.StateQuarantined:
			return res, false, &CancelError{Index: index, Code: CodeCancelUnsettled, Item: live.ID, State: live.State}
		case live.State == outbox.StateAccepted || live.State == outbox.StateConfirmed: // Stripe has it
			outcome, reason, item, err := s.takeBack(ctx, tx, index, row, live)
			if err != nil {
				return res, false, err
			}
			res.Outcome, res.Reason, res.Item = outcome, string(reason), &item
		default:
			// Withdrawn or superseded items carry no live usage of an event
			// not cancelled yet: the ledger and the outbox disagree.
			return res, false, fmt.Errorf("meter: the event %s/%s is carried by item %d, which is %s", c.Tenant, c.ID, live.ID, live.State)
		}
	}
	var reasonArg any
	if res.Reason != "" {
		reasonArg = res.Reason
	}
	if _, err := tx.Exec(ctx, sqlCancelRecord, c.Tenant, c.ID, row.id, res.Outcome, reasonArg, carried, res.Item, by, bucket); err != nil {
		return res, false, fmt.Errorf("meter: recording the cancellation of %s/%s: %w", c.Tenant, c.ID, err)
	}
	return res, true, nil
}

// withdrawUnstaged stages an unstaged event straight into a withdrawn
// per-event item (stage_withdrawn), so that no ledger row is left without an item and
// the stager never sees it.
func (s *Stager) withdrawUnstaged(ctx context.Context, tx pgx.Tx, tenant string, row ledgerRow) (int64, error) {
	target, ok := s.Target(ctx)
	if !ok {
		return 0, ErrStalled
	}
	var st mappings.Store
	pair, err := st.Lookup(ctx, tx, tenant, row.feature)
	if err != nil {
		return 0, err
	}
	period := PeriodStart(row.at, anchorOf(pair))
	it := s.item(pair, target, tenant, row.feature, outbox.SubjectUsageEvent, cancelledRef(row), row.value, row.at, period)
	it.Quarantine, it.Withdrawn = "", true
	enq, err := s.Outbox.Enqueue(ctx, tx, it)
	if err != nil {
		return 0, err
	}
	if !enq.Inserted || enq.State != outbox.StateWithdrawn {
		return 0, fmt.Errorf("meter: the withdrawn item of ledger row %d exists already as item %d (%s)", row.id, enq.ID, enq.State)
	}
	return enq.ID, markRows(ctx, tx, []int64{row.id}, []int64{enq.ID})
}

// cancelledRef is the subject ref of the withdrawn item of a ledger row
// cancelled before it was staged: unique to the row, and never a ref the
// stager makes.
func cancelledRef(row ledgerRow) string {
	return fmt.Sprintf("cancelled:%d", row.id)
}

// leaveWindow takes the cancelled usage out of live, a pending or
// quarantined item no attempt of which may have reached the provider: a
// per-event item, or a window's with nothing else left, is withdrawn (withdraw);
// a window's with other events is re-addressed without it (supersede_cancelled), and the
// successor returned.
func (s *Stager) leaveWindow(ctx context.Context, tx pgx.Tx, live outbox.Item) (*int64, error) {
	var left int
	bucket := tenantbucket.Of(live.TenantKey)
	if err := tx.QueryRow(ctx, sqlCancelLeft, live.ID, bucket).Scan(&left); err != nil {
		return nil, fmt.Errorf("meter: counting the rows left in item %d: %w", live.ID, err)
	}
	if live.SubjectKind == outbox.SubjectUsageEvent || left == 0 {
		return nil, s.Outbox.Withdraw(ctx, tx, live.ID, bucket)
	}
	var st mappings.Store
	pair, err := st.Lookup(ctx, tx, live.TenantKey, live.Payload.Feature)
	if err != nil {
		return nil, err
	}
	successor, err := s.Rebuild(ctx, tx, live, pair)
	if err != nil {
		return nil, err
	}
	if successor.Identity == live.Identity {
		// The same mappings: the next re-address generation carries the
		// smaller value under an identifier of its own.
		successor.SubjectRef = outbox.ReaddressRef(live.SubjectRef)
	}
	enq, err := s.Outbox.SupersedeCancelled(ctx, tx, live.ID, successor)
	if err != nil {
		return nil, err
	}
	return &enq.ID, nil
}

// takeBack asks Stripe to take back the usage of live, an accepted or
// confirmed item: a count event received less than 24 hours ago (by its
// first attempt, less the margin, by the database clock) gets a meter event
// adjustment item; one received earlier, or an event of a last window,
// gets a quarantined cancellation item of its own for finance; a sum
// window's event an offsetting supplement (offset).
func (s *Stager) takeBack(ctx context.Context, tx pgx.Tx, index int, row ledgerRow, live outbox.Item) (string, outbox.Reason, int64, error) {
	var (
		reason   outbox.Reason
		inTime   bool
		cancelBy int64 // Stripe's own deadline, which the claim checks again
	)
	switch live.SubjectKind {
	case outbox.SubjectUsageEvent:
		margin := s.CancelMargin
		if margin <= 0 {
			margin = DefaultCancelMargin
		}
		if err := tx.QueryRow(ctx, sqlCancelDeadline, pgx.NamedArgs{"window": cancelWindow, "margin": margin, "id": live.ID,
			"bucket": tenantbucket.Of(live.TenantKey)}).
			Scan(&inTime, &cancelBy); err != nil {
			return "", "", 0, fmt.Errorf("meter: the cancellation deadline of item %d: %w", live.ID, err)
		}
		if !inTime {
			reason = outbox.ReasonCancelTooLate
		}
	default:
		var st mappings.Store
		pair, err := st.Lookup(ctx, tx, live.TenantKey, live.Payload.Feature)
		if err != nil {
			return "", "", 0, err
		}
		switch {
		case pair.Feature != nil && pair.Feature.Aggregation == mappings.Sum:
			id, reason, err := s.offset(ctx, tx, row, live, pair)
			if err != nil {
				return "", "", 0, err
			}
			if reason != "" {
				return CancelRefused, reason, id, nil
			}
			return CancelSupplement, "", id, nil
		case pair.Feature == nil || pair.Feature.Aggregation != mappings.Last:
			// Unmapped since, or no longer a window: nothing tells how.
			return "", "", 0, &CancelError{Index: index, Code: CodeCancelSent, Item: live.ID, State: live.State}
		}
		reason = outbox.ReasonCancelLastValue
	}
	p := live.Payload
	it := cancellationItem(row, live, exporterOfAdjustments, outbox.Payload{Customer: p.Customer, EventName: p.EventName,
		Timestamp: p.Timestamp, Feature: p.Feature, Period: p.Period, Cancels: live.Identifier, CancelBy: cancelBy})
	it.Quarantine = reason
	enq, err := s.Outbox.Enqueue(ctx, tx, it)
	if err != nil {
		return "", "", 0, err
	}
	if !enq.Inserted {
		return "", "", 0, fmt.Errorf("meter: the cancellation item of ledger row %d exists already as item %d", row.id, enq.ID)
	}
	if reason != "" {
		return CancelRefused, reason, enq.ID, nil
	}
	return CancelAdjustment, "", enq.ID, nil
}

// cancellationItem is the item of its own (subject kind
// usage_cancellation, ref cancel:<ledger row>) that takes row's usage back
// from live: addressed as live was, sent by exporter, carrying p.
func cancellationItem(row ledgerRow, live outbox.Item, exporter string, p outbox.Payload) outbox.NewItem {
	return outbox.NewItem{
		Identity: outbox.Identity{TenantKey: live.TenantKey, SubjectKind: outbox.SubjectUsageCancellation,
			SubjectRef: fmt.Sprintf("cancel:%d", row.id), Exporter: exporter,
			DestinationAccount: live.DestinationAccount, Mode: live.Mode, MappingVersion: live.MappingVersion},
		Payload: p,
	}
}

// exporterOfAdjustments sends every cancellation
// (exporter.StripeMeterEventAdjustments; package meter does not import
// package exporter): meter event adjustments have a deliverer and a rate
// of their own, on every node with a key. Cancellations staged before it
// carry the v1 exporter's name, and the v1 deliverer still sends them.
const exporterOfAdjustments = "stripe_meter_event_adjustments"

// offset enqueues the supplement that offsets a cancelled event of live, a
// sum window's item Stripe has: the negated value, addressed exactly as
// live was (customer, meter, account, exporter, the window's timestamp and
// period), a cancellation item (no payload.cancels: it is sent as a meter
// event, by live's exporter) carrying no ledger row. Usage after
// its invoice closed is judged as staging judges it: under
// TALLY_LATE_USAGE=quarantine the supplement is quarantined period_closed
// (outcome refused with that reason) — a finalized invoice is never
// corrected.
func (s *Stager) offset(ctx context.Context, tx pgx.Tx, row ledgerRow, live outbox.Item, pair mappings.Pair) (int64, outbox.Reason, error) {
	target, ok := s.Target(ctx)
	if !ok {
		return 0, "", ErrStalled
	}
	if err := target.validate(); err != nil {
		return 0, "", err
	}
	p := live.Payload
	period, err := time.Parse(time.RFC3339, p.Period)
	if err != nil {
		return 0, "", fmt.Errorf("meter: item %d has no period: %w", live.ID, err)
	}
	it := cancellationItem(row, live, live.Exporter, outbox.Payload{Customer: p.Customer, EventName: p.EventName,
		Value: -row.value, Timestamp: p.Timestamp, Feature: p.Feature, Period: p.Period, CustomerKey: p.CustomerKey, ValueKey: p.ValueKey})
	verdicts, err := checkStamps(ctx, tx, target, []stampCheck{target.stampCheckOf(pair, time.Unix(p.Timestamp, 0), period)})
	if err != nil {
		return 0, "", err
	}
	verdicts[0].apply(target, &it)
	enq, err := s.Outbox.Enqueue(ctx, tx, it)
	if err != nil {
		return 0, "", err
	}
	if !enq.Inserted {
		return 0, "", fmt.Errorf("meter: the offsetting supplement of ledger row %d exists already as item %d", row.id, enq.ID)
	}
	return enq.ID, it.Quarantine, nil
}
