package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// Recovery is what an operator decided about an uncertain item (the
// recover transition).
type Recovery struct {
	// To is StateAccepted (the provider has it), StatePending (send it again
	// with the same identifier) or StateRejected (abandon it).
	To State
	// ExpectLeaseToken is the lease token of the item as the operator
	// reviewed it; the recovery is refused if the item moved since.
	ExpectLeaseToken int64
	// NotReached, with To = pending, records the operator's finding, from
	// evidence such as reconciliation, that no attempt of the item reached
	// the provider. Only then may it be sent past the horizon, or later be
	// re-addressed; without it, recovery to pending is refused past the
	// horizon (ErrPastHorizon). It needs a Reason.
	NotReached bool
	// ProviderRef is the provider's evidence for To = accepted (optional).
	ProviderRef string
	// Reason explains the decision; it is sanitised and kept as the item's
	// last_error message for rejected and for a NotReached recovery.
	Reason string
}

// The recover transition: an operator's decision about an uncertain item,
// one statement per target (Citus refuses the clock inside a CASE). To
// pending it grants a fresh attempt budget (attempts_base := attempts;
// attempts and first_attempt_at do not move), and it is refused past the
// horizon unless no attempt may have reached the provider or the operator
// records that none did (refused_attempts := attempts).
const (
	sqlRecoverAccepted = `
UPDATE outbox_item_states o SET
    state = 'accepted', accepted_at = statement_timestamp(),
    provider_ref = coalesce(nullif(@ref, ''), o.provider_ref), updated_at = statement_timestamp()
WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = @id AND o.state = 'uncertain' AND o.lease_token = @token`

	sqlRecoverPending = `
UPDATE outbox_item_states o SET
    state             = 'pending',
    next_attempt_at   = statement_timestamp(),
    refused_attempts  = CASE WHEN @not_reached THEN o.attempts ELSE o.refused_attempts END,
    attempts_base     = o.attempts,
    last_error_code   = CASE WHEN @not_reached THEN 'operator_not_reached' ELSE o.last_error_code END,
    last_error_status = CASE WHEN @not_reached THEN NULL ELSE o.last_error_status END,
    last_error        = CASE WHEN @not_reached THEN nullif(@reason, '') ELSE o.last_error END,
    updated_at        = statement_timestamp()
WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = @id AND o.state = 'uncertain' AND o.lease_token = @token
  AND (@not_reached OR o.refused_attempts = o.attempts OR o.first_attempt_at > statement_timestamp() - @horizon::interval)`

	sqlRecoverRejected = `
UPDATE outbox_item_states o SET
    state = 'rejected', last_error_code = 'operator_rejected', last_error_status = NULL,
    last_error = nullif(@reason, ''), updated_at = statement_timestamp()
WHERE o.bucket = ANY(@buckets::smallint[]) AND o.id = @id AND o.state = 'uncertain' AND o.lease_token = @token`
)

// sqlRecover is the recover statement of each target.
var sqlRecover = map[State]string{
	StateAccepted: sqlRecoverAccepted, StatePending: sqlRecoverPending, StateRejected: sqlRecoverRejected,
}

// Recover is the recover transition: uncertain to accepted, pending or
// rejected, as the operator decided. Zero rows affected gives a *StateError
// carrying the item's current state and lease token, ErrNotFound, or
// ErrPastHorizon; nothing is retried. A recovery to pending wakes the
// deliverers (NotifyChannel) when q's transaction commits.
func (s *Store) Recover(ctx context.Context, q pgdb.Querier, id int64, r Recovery) error {
	switch r.To {
	case StateAccepted, StatePending, StateRejected:
	default:
		return fmt.Errorf("outbox: recovery to %q: only accepted, pending or rejected", r.To)
	}
	if r.NotReached && r.To != StatePending {
		return errors.New("outbox: recovery: not-reached goes with a recovery to pending only")
	}
	reason := ErrorInfo{Code: "operator", Message: r.Reason}.Sanitized().Message
	if r.NotReached && reason == "" {
		return errors.New("outbox: recovery: a not-reached finding needs a reason")
	}
	args := pgx.NamedArgs{"id": id, "token": r.ExpectLeaseToken, "ref": r.ProviderRef, "reason": reason}
	if r.To == StatePending {
		args["not_reached"], args["horizon"] = r.NotReached, s.cfg.Horizon
	}
	n, err := s.execByID(ctx, q, id, sqlRecover[r.To], args)
	if err != nil {
		return fmt.Errorf("outbox: recover item %d: %w", id, err)
	}
	if n == 1 {
		if r.To == StatePending {
			if err := notify(ctx, q, nil, nil); err != nil {
				return err
			}
		}
		s.metrics.moved(TransitionRecover, r.To)
		return nil
	}
	s.metrics.staleWrites(TransitionRecover, 1)
	err = s.mismatch(ctx, q, id, TransitionRecover, StateUncertain)
	var se *StateError
	if errors.As(err, &se) && se.Current == StateUncertain && se.CurrentLeaseToken == r.ExpectLeaseToken {
		return fmt.Errorf("%w: item %d", ErrPastHorizon, id)
	}
	return err
}

// sqlRequeue is the requeue transition: an operator requeues a quarantined
// item after fixing the cause without changing the mapping it was built from
// (a meter created at Stripe, the node's account corrected). It keeps its
// identity and identifier, and gets a fresh attempt budget. Only an item
// whose payload is sendable as it stands may go back: one staged without a
// customer, a meter or an account must be re-addressed (Supersede) under a
// mapping that supplies it.
const sqlRequeue = `
UPDATE outbox_item_states o SET
    state = 'pending', quarantine_reason = NULL, next_attempt_at = statement_timestamp(),
    attempts_base = o.attempts, updated_at = statement_timestamp(),
    reported_state = NULL, reported_reason = NULL, reported_code = NULL, reported_message = NULL
FROM outbox_item_bodies b
WHERE o.bucket = ANY(@buckets::smallint[]) AND b.bucket = ANY(@buckets::smallint[]) AND o.id = @id AND b.id = o.id AND b.bucket = o.bucket
  AND o.state = 'quarantined' AND b.mapping_version = @version
  AND b.destination_account <> '' AND b.mapping_version > 0
  AND coalesce(b.payload ->> 'customer', '') <> '' AND coalesce(b.payload ->> 'event_name', '') <> ''`

// Requeue is the requeue transition: quarantined to pending. It answers
// ErrMappingChanged when the item was built from another mapping version than
// the one given, ErrNotSendable when its payload lacks what a send needs, a
// *StateError when it is not quarantined, ErrNotFound when there is no such
// item. A requeued item wakes the deliverers (NotifyChannel) when q's
// transaction commits.
func (s *Store) Requeue(ctx context.Context, q pgdb.Querier, id int64, mappingVersion int) error {
	n, err := s.execByID(ctx, q, id, sqlRequeue, pgx.NamedArgs{"id": id, "version": mappingVersion})
	if err != nil {
		return fmt.Errorf("outbox: requeue item %d: %w", id, err)
	}
	if n == 1 {
		if err := notify(ctx, q, nil, nil); err != nil {
			return err
		}
		s.metrics.moved(TransitionRequeue, StatePending)
		return nil
	}
	s.metrics.staleWrites(TransitionRequeue, 1)
	return s.requeueRefusal(ctx, q, id, TransitionRequeue, mappingVersion)
}

func (s *Store) requeueRefusal(ctx context.Context, q pgdb.Querier, id int64, transition Transition, mappingVersion int) error {
	var (
		state             State
		version           int
		token             int64
		refused, attempts int
		sendable          bool
	)
	err := q.QueryRow(ctx, `SELECT state, mapping_version, lease_token, refused_attempts, attempts,
		    destination_account <> '' AND mapping_version > 0
		    AND coalesce(payload ->> 'customer', '') <> '' AND coalesce(payload ->> 'event_name', '') <> ''
		FROM outbox_items WHERE id = $1`, id).Scan(&state, &version, &token, &refused, &attempts, &sendable)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: %d", ErrNotFound, id)
	case err != nil:
		return fmt.Errorf("outbox: %s: re-reading item %d: %w", transition, id, err)
	case state != StateQuarantined:
		return &StateError{ID: id, Transition: transition, Expected: StateQuarantined, Current: state, CurrentLeaseToken: token}
	case version != mappingVersion:
		return fmt.Errorf("%w: item %d was built from mapping version %d, not %d", ErrMappingChanged, id, version, mappingVersion)
	case transition == TransitionRequeue && !sendable:
		return fmt.Errorf("%w: item %d", ErrNotSendable, id)
	case transition == TransitionSupersede && refused != attempts:
		return fmt.Errorf("%w: item %d", ErrMayHaveReached, id)
	}
	return fmt.Errorf("outbox: %s: item %d changed concurrently; read it again", transition, id)
}

// sqlSupersede closes a quarantined item that an operator re-addressed:
// only an item no attempt of which may have reached the provider, in the same
// transaction as its successor's insert.
const sqlSupersede = `
UPDATE outbox_item_states o SET state = 'superseded', superseded_by = @successor, updated_at = statement_timestamp()
FROM outbox_item_bodies b
WHERE o.bucket = ANY(@buckets::smallint[]) AND b.bucket = ANY(@buckets::smallint[]) AND o.id = @id AND b.id = o.id AND b.bucket = o.bucket
  AND o.state = 'quarantined' AND b.mapping_version = @version AND o.refused_attempts = o.attempts`

// Supersede is the supersede transition, the requeue that re-addresses:
// inside the caller's transaction it enqueues successor (stage or
// stage_quarantined) under its new identity and
// closes the quarantined item id (built from mappingVersion) as superseded,
// pointing to the successor, so its usage is counted once. The successor must
// name the same tenant and subject under a different identity (a new mapping
// version, account, mode or exporter, or — when nothing else changed — the
// next re-address generation of its subject ref, ReaddressRef; BaseRef of
// both must agree). Only an item proven not to have reached
// the provider may be re-addressed: otherwise ErrMayHaveReached, and the item
// keeps its identifier for good. On any error the caller must roll back.
func (s *Store) Supersede(ctx context.Context, tx pgx.Tx, id int64, mappingVersion int, successor NewItem) (Enqueued, error) {
	old, enq, err := s.enqueueSuccessor(ctx, tx, TransitionSupersede, id, successor)
	if err != nil {
		return Enqueued{}, err
	}
	tag, err := tx.Exec(ctx, sqlSupersede, pgx.NamedArgs{"id": id, "version": mappingVersion, "successor": enq.ID,
		"buckets": []int16{tenantbucket.Of(old.TenantKey)}})
	if err != nil {
		return Enqueued{}, fmt.Errorf("outbox: supersede item %d: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		s.metrics.staleWrites(TransitionSupersede, 1)
		return Enqueued{}, s.requeueRefusal(ctx, tx, id, TransitionSupersede, mappingVersion)
	}
	s.metrics.moved(TransitionSupersede, StateSuperseded)
	return enq, nil
}

// enqueueSuccessor is the first step of supersede and supersede_cancelled,
// inside the caller's transaction: the successor of item id must carry its
// tenant and subject under another identity, and is enqueued (stage or
// stage_quarantined) as a new row. It
// returns the item as read and the successor's row.
func (s *Store) enqueueSuccessor(ctx context.Context, tx pgx.Tx, transition Transition, id int64, successor NewItem) (Item, Enqueued, error) {
	old, err := s.Get(ctx, tx, id)
	if err != nil {
		return Item{}, Enqueued{}, err
	}
	if successor.TenantKey != old.TenantKey || successor.SubjectKind != old.SubjectKind || BaseRef(successor.SubjectRef) != BaseRef(old.SubjectRef) {
		return Item{}, Enqueued{}, fmt.Errorf("outbox: %s: the successor of item %d must carry the same tenant and subject", transition, id)
	}
	if successor.Identity == old.Identity {
		return Item{}, Enqueued{}, fmt.Errorf("outbox: %s: the successor of item %d has the same identity", transition, id)
	}
	enq, err := s.Enqueue(ctx, tx, successor)
	if err != nil {
		return Item{}, Enqueued{}, err
	}
	if !enq.Inserted {
		return Item{}, Enqueued{}, fmt.Errorf("%w: item %d", ErrSuccessorExists, enq.ID)
	}
	return old, enq, nil
}

// execByID runs sql, a statement of one item id taking its bucket as
// @buckets, and returns the rows it affected: none when there is no such
// item (groupIDs reads the bucket on Citus).
func (s *Store) execByID(ctx context.Context, q pgdb.Querier, id int64, sql string, args pgx.NamedArgs) (int64, error) {
	groups, sql, err := s.groupIDs(ctx, q, []int64{id}, sql)
	if err != nil || len(groups) == 0 {
		return 0, err
	}
	args["buckets"] = groups[0].buckets
	tag, err := q.Exec(ctx, sql, args)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}
