package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/tenantbucket"
)

// NewItem is an item to enqueue.
type NewItem struct {
	Identity
	// Payload is the financial intent; Enqueue sets Payload.Identifier.
	Payload Payload
	// Quarantine, when set, enqueues the item quarantined with this reason
	// (stage_quarantined) instead of pending (stage): ineligible usage is
	// staged and quarantined, never dropped.
	Quarantine Reason
	// Withdrawn, when set, enqueues the item withdrawn (stage_withdrawn): usage
	// cancelled before it was staged, staged so that its ledger rows have
	// an item, never sent. It needs nothing to be sendable.
	Withdrawn bool
}

// Enqueued is the item an Enqueue landed on.
type Enqueued struct {
	// ID is the item's id: the new row's, or the existing row's on conflict.
	ID int64
	// Identifier is the item's identifier.
	Identifier string
	// State is the item's state as read by the enqueue.
	State State
	// Inserted is false when the identity already existed (the enqueue
	// collapsed into the existing row, which is returned).
	Inserted bool
	// SamePayload is false when an existing row holds a different payload
	// from the one given: the existing row wins, and the caller should know.
	SamePayload bool
}

// validate checks it for stage (eligible) or stage_quarantined and sets the
// payload's identifier.
func (it *NewItem) validate() error {
	if err := it.Identity.Validate(); err != nil {
		return err
	}
	want := it.Identity.Identifier()
	if it.Payload.Identifier != "" && it.Payload.Identifier != want {
		return fmt.Errorf("outbox: payload identifier %q is not the identity's %q", it.Payload.Identifier, want)
	}
	it.Payload.Identifier = want
	var errs []error
	if it.Payload.Feature == "" {
		errs = append(errs, errors.New("payload feature is empty"))
	}
	if it.Payload.Period == "" {
		errs = append(errs, errors.New("payload period is empty"))
	}
	switch {
	case it.Withdrawn && it.Quarantine != "":
		errs = append(errs, errors.New("an item is enqueued withdrawn or quarantined, not both"))
	case it.Withdrawn:
		// Never sent: nothing needs to be sendable.
	case it.Quarantine != "":
		if !it.Quarantine.valid() {
			errs = append(errs, fmt.Errorf("unknown quarantine reason %q", it.Quarantine))
		}
	default:
		// An eligible item must be sendable as it stands.
		if it.Payload.Customer == "" {
			errs = append(errs, errors.New("payload customer is empty (quarantine it as no_customer)"))
		}
		if it.Payload.EventName == "" {
			errs = append(errs, errors.New("payload event_name is empty (quarantine it as feature_unmapped)"))
		}
		if it.DestinationAccount == "" {
			errs = append(errs, errors.New("destination_account is empty (quarantine it as no_account)"))
		}
		if it.MappingVersion < 1 {
			errs = append(errs, errors.New("mapping_version must be at least 1 for an eligible item"))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("outbox: invalid item: %w", errors.Join(errs...))
	}
	return nil
}

// sqlEnqueue is stage (state pending), stage_quarantined (state
// quarantined, with a reason) and stage_withdrawn: an insert that collapses
// into an existing row of the same identity. The body and the state row are
// inserted by one statement, the state row only for a body that was
// inserted.
const sqlEnqueue = `
WITH body AS (
    INSERT INTO outbox_item_bodies
        (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, payload, bucket)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, tally_bucket($1))
    ON CONFLICT ON CONSTRAINT outbox_items_identity_key DO NOTHING
    RETURNING id, identifier, exporter, mode, ordering_key, created_at, bucket
),
state AS (
    INSERT INTO outbox_item_states (id, exporter, mode, ordering_key, created_at, state, quarantine_reason, bucket)
    SELECT id, exporter, mode, ordering_key, created_at, $9, nullif($10, ''), bucket FROM body
    RETURNING id, state, bucket
)
SELECT body.id, body.identifier, coalesce(state.state, '') FROM body LEFT JOIN state ON state.id = body.id AND state.bucket = body.bucket`

// sqlTakeXid gives the transaction its id on the coordinator before an
// insert takes an item id: the gauge's watermark waits for every
// transaction that held an id when it was armed, and on a distributed
// database the insert itself writes on a worker and takes none there. On
// one server the insert would take one anyway. It goes in the insert's
// round trip.
const sqlTakeXid = `SELECT pg_current_xact_id()`

// sqlEnqueueBodies is the first of stage's two statements on a
// distributed database, for items of one shard group: the bodies, each
// with its tenant's bucket. A modifying CTE would make a routed statement
// subplans through the coordinator, so the state rows are a second
// statement (sqlEnqueueStates) from the rows this one returned.
const sqlEnqueueBodies = `
INSERT INTO outbox_item_bodies
    (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, payload, bucket)
SELECT * FROM unnest(@tenants::text[], @kinds::text[], @refs::text[], @exporters::text[], @accounts::text[],
                     @modes::text[], @versions::integer[], @payloads::jsonb[], @buckets::smallint[])
ON CONFLICT ON CONSTRAINT outbox_items_identity_key DO NOTHING
RETURNING id, identifier, exporter, mode, ordering_key, created_at, bucket`

// sqlEnqueueStates inserts the state rows of the bodies sqlEnqueueBodies
// inserted, from the columns it returned.
const sqlEnqueueStates = `
INSERT INTO outbox_item_states (id, exporter, mode, ordering_key, created_at, state, quarantine_reason, bucket)
SELECT * FROM unnest(@ids::bigint[], @exporters::text[], @modes::text[], @keys::text[], @created::timestamptz[],
                     @states::text[], @reasons::text[], @buckets::smallint[])`

// errNoStateRow is an enqueue whose body was inserted without its state
// row: impossible while the payload's identifier is the identity's (a CHECK
// of the body), and refused so, the caller rolling back, rather than leave
// an item no claim, gauge or report would see.
var errNoStateRow = errors.New("an item body was inserted without its state row")

// sqlEnqueueExisting reads the row an enqueue collided with. It runs as its
// own statement so that, under READ COMMITTED, it sees a row a concurrent
// transaction committed while the insert waited on it.
const sqlEnqueueExisting = `
SELECT id, identifier, state, payload = $8::jsonb
FROM outbox_items
WHERE tenant_key = $1 AND subject_kind = $2 AND subject_ref = $3 AND exporter = $4
  AND destination_account = $5 AND mode = $6 AND mapping_version = $7 AND bucket = $9`

// Enqueue is stage, stage_quarantined or stage_withdrawn: it inserts item
// inside the caller's transaction, or, when the identity exists already,
// returns the existing row. It never commits; the caller commits once, with
// the cause of the item. An item inserted pending wakes the deliverers
// (NotifyChannel) when that transaction commits.
func (s *Store) Enqueue(ctx context.Context, tx pgx.Tx, item NewItem) (Enqueued, error) {
	if err := item.validate(); err != nil {
		return Enqueued{}, err
	}
	state := StatePending
	switch {
	case item.Quarantine != "":
		state = StateQuarantined
	case item.Withdrawn:
		state = StateWithdrawn
	}
	id := item.Identity
	bucket := tenantbucket.Of(id.TenantKey)
	args := []any{id.TenantKey, id.SubjectKind, id.SubjectRef, id.Exporter, id.DestinationAccount,
		string(id.Mode), id.MappingVersion, item.Payload, string(state), string(item.Quarantine)}

	shards, err := s.Shards(ctx, tx)
	if err != nil {
		return Enqueued{}, err
	}
	res := Enqueued{Inserted: true, SamePayload: true}
	if shards.Distributed() {
		var out []Enqueued
		if out, err = s.enqueueOnShard(ctx, tx, []NewItem{item}, []State{state}, true); err == nil {
			if res = out[0]; !res.Inserted {
				err = pgx.ErrNoRows
			}
		}
	} else {
		// No row is a conflict, not an error: a batch's error would drop
		// its statements from the connection's cache.
		found := false
		b := &pgx.Batch{}
		b.Queue(sqlTakeXid)
		b.Queue(sqlEnqueue, args...).Query(func(rows pgx.Rows) error {
			_, err := pgx.ForEachRow(rows, []any{&res.ID, &res.Identifier, &res.State}, func() error {
				found = true
				return nil
			})
			return err
		})
		if err = tx.SendBatch(ctx, b).Close(); err == nil && !found {
			err = pgx.ErrNoRows
		}
	}
	if errors.Is(err, pgx.ErrNoRows) {
		res = Enqueued{SamePayload: true}
		err = tx.QueryRow(ctx, sqlEnqueueExisting, append(args[:8:8], bucket)...).Scan(&res.ID, &res.Identifier, &res.State, &res.SamePayload)
	}
	if err == nil && res.State == "" {
		err = errNoStateRow
	}
	if err != nil {
		return Enqueued{}, fmt.Errorf("outbox: enqueueing %s %s: %w", id.SubjectKind, id.SubjectRef, err)
	}
	if res.Inserted {
		if state == StatePending {
			if err := notify(ctx, tx, shards, []int16{bucket}); err != nil {
				return Enqueued{}, err
			}
		}
		s.metrics.moved(stageTransitions[state], state)
		s.metrics.enqueued(id.SubjectKind, item.Quarantine, item.Payload.Late)
	}
	return res, nil
}

// stageTransitions names the insert of an item by the state it starts in.
var stageTransitions = map[State]Transition{
	StatePending: TransitionStage, StateQuarantined: TransitionStageQuarantined, StateWithdrawn: TransitionStageWithdrawn,
}

// sqlEnqueueBatch is stage and stage_quarantined for many items in one
// statement.
const sqlEnqueueBatch = `
WITH body AS (
    INSERT INTO outbox_item_bodies
        (tenant_key, subject_kind, subject_ref, exporter, destination_account, mode, mapping_version, payload, bucket)
    SELECT * FROM unnest(@tenants::text[], @kinds::text[], @refs::text[], @exporters::text[], @accounts::text[],
                         @modes::text[], @versions::integer[], @payloads::jsonb[], @buckets::smallint[])
    ON CONFLICT ON CONSTRAINT outbox_items_identity_key DO NOTHING
    RETURNING id, identifier, exporter, mode, ordering_key, created_at, bucket
),
state AS (
    INSERT INTO outbox_item_states (id, exporter, mode, ordering_key, created_at, state, quarantine_reason, bucket)
    SELECT body.id, body.exporter, body.mode, body.ordering_key, body.created_at, u.state, u.reason, body.bucket
    FROM body JOIN unnest(@identifiers::text[], @states::text[], @reasons::text[]) AS u(identifier, state, reason)
        ON u.identifier = body.identifier
    RETURNING id, state, bucket
)
SELECT body.id, body.identifier, coalesce(state.state, '') FROM body LEFT JOIN state ON state.id = body.id AND state.bucket = body.bucket`

// EnqueueBatch is Enqueue for many items in one statement, inside the
// caller's transaction: what a stager uses for per-event items. Its results
// are in the order of items. An item whose identity exists already is
// returned with Inserted false, like Enqueue's. One notification, not one
// per item, wakes the deliverers when some item was inserted pending. On
// a distributed database the items of each shard group are inserted by
// statements of their own, all in the caller's transaction.
func (s *Store) EnqueueBatch(ctx context.Context, tx pgx.Tx, items []NewItem) ([]Enqueued, error) {
	if len(items) == 0 {
		return nil, nil
	}
	n := len(items)
	states := make([]State, n)
	byIdentifier := make(map[string]int, n)
	for i := range items {
		it := &items[i]
		if err := it.validate(); err != nil {
			return nil, fmt.Errorf("item %d: %w", i, err)
		}
		if _, dup := byIdentifier[it.Payload.Identifier]; dup {
			return nil, fmt.Errorf("outbox: item %d repeats an identity of the same batch", i)
		}
		byIdentifier[it.Payload.Identifier] = i
		states[i] = StatePending
		if it.Withdrawn {
			states[i] = StateWithdrawn
		}
		if it.Quarantine != "" {
			states[i] = StateQuarantined
		}
	}
	shards, err := s.Shards(ctx, tx)
	if err != nil {
		return nil, err
	}
	var out []Enqueued
	if shards.Distributed() {
		out, err = s.enqueueSplit(ctx, tx, shards, items, states)
	} else {
		out, err = enqueueOneStatement(ctx, tx, items, states, byIdentifier)
	}
	if err != nil {
		return nil, fmt.Errorf("outbox: enqueueing %d items: %w", n, err)
	}
	var pending []int16 // the buckets of the items inserted pending
	for i := range out {
		if out[i].Inserted {
			if out[i].State == StatePending {
				pending = append(pending, tenantbucket.Of(items[i].Identity.TenantKey))
			}
			s.metrics.moved(stageTransitions[out[i].State], out[i].State)
			s.metrics.enqueued(items[i].Identity.SubjectKind, items[i].Quarantine, items[i].Payload.Late)
		}
	}
	if len(pending) > 0 {
		if err := notify(ctx, tx, shards, pending); err != nil {
			return nil, err
		}
	}
	for i := range out {
		if out[i].Inserted {
			continue
		}
		id := items[i].Identity
		err := tx.QueryRow(ctx, sqlEnqueueExisting, id.TenantKey, id.SubjectKind, id.SubjectRef, id.Exporter,
			id.DestinationAccount, string(id.Mode), id.MappingVersion, items[i].Payload, tenantbucket.Of(id.TenantKey)).
			Scan(&out[i].ID, &out[i].Identifier, &out[i].State, &out[i].SamePayload)
		if err != nil {
			return nil, fmt.Errorf("outbox: reading the existing item of %s %s: %w", id.SubjectKind, id.SubjectRef, err)
		}
	}
	return out, nil
}

// enqueueArgs are items' identities and payloads as sqlEnqueueBatch's and
// sqlEnqueueBodies's arrays, and their states' as theirs.
func enqueueArgs(items []NewItem, states []State) pgx.NamedArgs {
	n := len(items)
	var (
		tenants, kinds, refs, exporters = make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		accounts, modes, identifiers    = make([]string, n), make([]string, n), make([]string, n)
		stateNames                      = make([]string, n)
		reasons                         = make([]*string, n)
		versions                        = make([]int32, n)
		buckets                         = make([]int16, n)
		payloads                        = make([]Payload, n)
	)
	for i := range items {
		it := &items[i]
		id := it.Identity
		identifiers[i] = it.Payload.Identifier
		tenants[i], kinds[i], refs[i], exporters[i] = id.TenantKey, id.SubjectKind, id.SubjectRef, id.Exporter
		accounts[i], modes[i], versions[i], payloads[i] = id.DestinationAccount, string(id.Mode), int32(id.MappingVersion), it.Payload
		buckets[i] = tenantbucket.Of(id.TenantKey)
		stateNames[i] = string(states[i])
		if it.Quarantine != "" {
			r := string(it.Quarantine)
			reasons[i] = &r
		}
	}
	return pgx.NamedArgs{
		"tenants": tenants, "kinds": kinds, "refs": refs, "exporters": exporters, "accounts": accounts,
		"modes": modes, "versions": versions, "payloads": payloads, "buckets": buckets, "identifiers": identifiers,
		"states": stateNames, "reasons": reasons,
	}
}

// enqueueOneStatement inserts the items by sqlEnqueueBatch, in the round
// trip of sqlTakeXid: on one server.
func enqueueOneStatement(ctx context.Context, tx pgx.Tx, items []NewItem, states []State, byIdentifier map[string]int) ([]Enqueued, error) {
	out := make([]Enqueued, len(items))
	b := &pgx.Batch{}
	b.Queue(sqlTakeXid)
	b.Queue(sqlEnqueueBatch, enqueueArgs(items, states)).Query(func(rows pgx.Rows) error {
		var (
			id         int64
			identifier string
			state      State
		)
		_, err := pgx.ForEachRow(rows, []any{&id, &identifier, &state}, func() error {
			i, ok := byIdentifier[identifier]
			if !ok || state == "" {
				return errNoStateRow
			}
			out[i] = Enqueued{ID: id, Identifier: identifier, State: state, Inserted: true, SamePayload: true}
			return nil
		})
		return err
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, err
	}
	return out, nil
}

// enqueueSplit inserts the items of each shard group by enqueueOnShard,
// the first group's with the transaction's id taken first.
func (s *Store) enqueueSplit(ctx context.Context, tx pgx.Tx, shards *tenantbucket.Shards, items []NewItem, states []State) ([]Enqueued, error) {
	index := make([]int, len(items))
	for i := range index {
		index[i] = i
	}
	out := make([]Enqueued, len(items))
	for k, run := range tenantbucket.Split(shards, index, func(i int) int16 { return tenantbucket.Of(items[i].TenantKey) }) {
		its, sts := make([]NewItem, len(run)), make([]State, len(run))
		for j, i := range run {
			its[j], sts[j] = items[i], states[i]
		}
		res, err := s.enqueueOnShard(ctx, tx, its, sts, k == 0)
		if err != nil {
			return nil, err
		}
		for j, i := range run {
			out[i] = res[j]
		}
	}
	return out, nil
}

// enqueueOnShard inserts items of one shard group: the bodies
// (sqlEnqueueBodies, after sqlTakeXid in the same round trip when takeXid),
// then the state rows of the bodies inserted (sqlEnqueueStates). An item
// whose identity existed is returned with Inserted false and nothing else.
func (s *Store) enqueueOnShard(ctx context.Context, tx pgx.Tx, items []NewItem, states []State, takeXid bool) ([]Enqueued, error) {
	byIdentifier := make(map[string]int, len(items))
	for i := range items {
		byIdentifier[items[i].Payload.Identifier] = i
	}
	var (
		ids              []int64
		exporters, modes []string
		keys, stateNames []string
		reasons          []*string
		created          []time.Time
		buckets          []int16
		out              = make([]Enqueued, len(items))
	)
	b := &pgx.Batch{}
	if takeXid {
		b.Queue(sqlTakeXid)
	}
	b.Queue(sqlEnqueueBodies, enqueueArgs(items, states)).Query(func(rows pgx.Rows) error {
		var (
			id                              int64
			identifier, exporter, mode, key string
			at                              time.Time
			bucket                          int16
		)
		_, err := pgx.ForEachRow(rows, []any{&id, &identifier, &exporter, &mode, &key, &at, &bucket}, func() error {
			i, ok := byIdentifier[identifier]
			if !ok {
				return fmt.Errorf("outbox: an inserted body's identifier %q is none of the batch's", identifier)
			}
			out[i] = Enqueued{ID: id, Identifier: identifier, State: states[i], Inserted: true, SamePayload: true}
			ids, exporters, modes, keys, created, buckets = append(ids, id), append(exporters, exporter), append(modes, mode),
				append(keys, key), append(created, at), append(buckets, bucket)
			stateNames = append(stateNames, string(states[i]))
			var reason *string
			if r := items[i].Quarantine; r != "" {
				rs := string(r)
				reason = &rs
			}
			reasons = append(reasons, reason)
			return nil
		})
		return err
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		s.ForgetShards() // refused as spanning shards: read them again
		return nil, err
	}
	if len(ids) == 0 {
		return out, nil
	}
	tag, err := tx.Exec(ctx, sqlEnqueueStates, pgx.NamedArgs{
		"ids": ids, "exporters": exporters, "modes": modes, "keys": keys, "created": created,
		"states": stateNames, "reasons": reasons, "buckets": buckets,
	})
	if err != nil {
		return nil, err
	}
	if int(tag.RowsAffected()) != len(ids) {
		return nil, errNoStateRow
	}
	return out, nil
}
