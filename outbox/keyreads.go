package outbox

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
)

// The reads in this file find items by one of their keys — the ordering
// key, the identifier, the subject ref — for the packages that compare,
// name or number items: reconciliation lists the keys it compares and reads
// each key's items, a provider's error report locks the items it names, and
// staging numbers a window's next item. Each is one statement, run on the
// caller's Querier, so that it joins the caller's transaction.

// KeyFilter selects the ordering keys SettledKeys lists.
type KeyFilter struct {
	// Account and Mode are the destination the items were staged for.
	Account string
	Mode    Mode
	// Accounts, when set, widens Account to several destination accounts
	// (a platform's own and its connected accounts): their keys are listed
	// together, in key order, which groups them by account.
	Accounts []string
	// Settle is how long an accepted item must have been accepted, by the
	// database's clock, to count as settled.
	Settle time.Duration
	// Since is the earliest payload timestamp (Unix seconds) of the items
	// considered.
	Since int64
	// After is the ordering key to list after; "" lists from the first.
	After string
}

// SettledKey is an ordering key with settled items: the customer and the
// event name its items carry, and the earliest and latest payload
// timestamps (Unix seconds) of those items.
type SettledKey struct {
	OrderingKey, Customer, EventName string
	// Account is the destination account of the key's items.
	Account          string
	Earliest, Latest int64
}

// sqlSettledKeys lists the ordering keys of a destination with settled
// accepted or uncertain items from a timestamp on, after a key, in byte
// order (collation "C", whatever the database's: a caller merges them with
// keys of its own and compares them as Go does). It reads every tenant's
// items of the destination, so on a distributed database it reads every
// shard (the partial indexes of accepted and uncertain items), joined on
// the bucket so that each shard joins its own rows.
const sqlSettledKeys = `
SELECT b.ordering_key, b.payload ->> 'customer', b.payload ->> 'event_name', b.destination_account,
       min((b.payload ->> 'timestamp')::bigint), max((b.payload ->> 'timestamp')::bigint)
FROM outbox_item_states s JOIN outbox_item_bodies b ON b.id = s.id AND b.bucket = s.bucket
WHERE b.destination_account = ANY(@accounts::text[]) AND s.mode = @mode
  AND ((s.state = 'accepted' AND s.accepted_at < statement_timestamp() - @settle::interval) OR s.state = 'uncertain')
  AND (b.payload ->> 'timestamp')::bigint >= @since
  AND s.ordering_key COLLATE "C" > @cursor
GROUP BY 1, 2, 3, 4
ORDER BY b.ordering_key COLLATE "C"`

// SettledKeys lists the ordering keys of f's destination that have items
// accepted longer ago than f.Settle or uncertain, with payload timestamps
// from f.Since on, after f.After, in byte order (as Go compares strings):
// the keys reconciliation compares with the provider's numbers because they
// hold items to confirm or to learn about, one at a time, resuming after
// the last key it finished. The timestamps of each are those of these
// items.
func (s *Store) SettledKeys(ctx context.Context, q pgdb.Querier, f KeyFilter) ([]SettledKey, error) {
	accounts := f.Accounts
	if len(accounts) == 0 {
		accounts = []string{f.Account}
	}
	rows, err := q.Query(ctx, sqlSettledKeys, pgx.NamedArgs{"accounts": accounts, "mode": string(f.Mode), "settle": f.Settle,
		"since": f.Since, "cursor": f.After})
	if err != nil {
		return nil, fmt.Errorf("outbox: listing settled keys: %w", err)
	}
	keys, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (SettledKey, error) {
		var k SettledKey
		err := row.Scan(&k.OrderingKey, &k.Customer, &k.EventName, &k.Account, &k.Earliest, &k.Latest)
		return k, err
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: listing settled keys: %w", err)
	}
	return keys, nil
}

// KeyRange selects the items KeyItems reads: those of one ordering key and
// mode with payload timestamps in [From, To) (Unix seconds).
type KeyRange struct {
	OrderingKey string
	Mode        Mode
	// Customer is the key's customer. On a distributed database the read
	// names the buckets of the tenants ever mapped to it, which hold the
	// key's items; "" reads every shard.
	Customer string
	From, To int64
	// Settle is how long an accepted item must have been accepted, by the
	// database's clock, to count as settled (KeyItem.Settled).
	Settle time.Duration
}

// KeyItem is an item of a key as KeyItems reads it.
type KeyItem struct {
	ID    int64
	State State
	// Value and Timestamp are the payload's.
	Value, Timestamp int64
	// Settled is true for an item accepted longer ago than the range's
	// Settle.
	Settled bool
	// Identifier is the item's identifier; Cancels, on a cancellation
	// (SubjectUsageCancellation, which shares its event's key and
	// timestamp), the identifier of the event it cancels.
	Identifier, Cancels string
	// Tenant and Period are the item's tenant key and the start of the
	// billing period its payload names: whose period it counts in.
	Tenant string
	Period time.Time
	// Meter is the provider's meter the item was accepted for (Outcome's
	// Meter); empty when not recorded.
	Meter string
}

// sqlKeyItems reads the accepted, confirmed, uncertain, pending and leased
// items of one key and mode in a range of timestamps, by timestamp and id,
// and its quarantined cancellations an attempt of which may have reached
// the provider (whether Stripe applied one is unknown; one never sent,
// refused as too late say, changes nothing at Stripe). It is one server's
// text, and a distributed database's for a key whose tenants are unknown
// (it then reads every shard, each joining its own rows on the bucket).
const sqlKeyItems = `
SELECT b.id, s.state, (b.payload ->> 'value')::bigint, (b.payload ->> 'timestamp')::bigint,
       s.state = 'accepted' AND s.accepted_at < statement_timestamp() - @settle::interval,
       b.identifier, coalesce(b.payload ->> 'cancels', ''), b.tenant_key, (b.payload ->> 'period')::timestamptz,
       coalesce(s.meter, '')
FROM outbox_item_bodies b JOIN outbox_item_states s ON s.id = b.id AND s.bucket = b.bucket
WHERE b.ordering_key = @key AND b.mode = @mode
  AND (b.payload ->> 'timestamp')::bigint >= @from AND (b.payload ->> 'timestamp')::bigint < @to
  AND (s.state IN ('accepted', 'confirmed', 'uncertain', 'pending', 'leased')
       OR (s.state = 'quarantined' AND b.subject_kind = 'usage_cancellation' AND s.refused_attempts < s.attempts))
ORDER BY 4, 1`

// sqlKeyItemsInBuckets is sqlKeyItems with both tables in the buckets of
// the key's tenants (@buckets): a distributed database's read, one shard's
// when they are one group's.
var sqlKeyItemsInBuckets = strings.Replace(sqlKeyItems, "WHERE b.ordering_key = @key AND b.mode = @mode",
	"WHERE b.ordering_key = @key AND b.mode = @mode\n  AND b.bucket = ANY(@buckets::smallint[]) AND s.bucket = ANY(@buckets::smallint[])", 1)

// sqlCustomerBuckets lists the buckets of the tenants any version of whose
// mapping names a customer: those whose items may carry it (an item
// carries the customer of the mapping it was staged with). The versions
// are a reference table, read where the statement runs.
const sqlCustomerBuckets = `SELECT coalesce(array_agg(DISTINCT tally_bucket(tenant)), '{}')::smallint[]
FROM tenant_mapping_versions WHERE stripe_customer_id = $1`

// KeyItems reads the items of r's key and mode with payload timestamps in
// r's range that are accepted, confirmed or uncertain — what the provider
// should have counted — or pending or leased — still in flight — in
// timestamp order, then by id: what reconciliation compares with the
// provider's hourly numbers of the key, and the items in flight that hold
// an hour back from the comparison. Each comes with its tenant and billing
// period, which say until when reconciliation reads its hours again. It
// reads the key's items in the range alone (the key-and-time index), so
// its cost is the range's items, never the key's history.
//
// On a distributed database it first reads the buckets of the tenants
// mapped to r's customer, and reads those buckets alone (one shard when
// the customer is fed by one tenant, the rule in practice). On one server
// it reads as it always has, with no list.
//
// Reconciliation runs it once per key, so its planning counts: on a large
// table the plan cache keeps planning it afresh at every call (its custom
// plan, one key's hour, is estimated well below its generic plan, a key's
// share of the table), which costs more than running it. Both plans have the
// same shape — the key-and-time index, then the state row by primary key — so
// when q can pipeline, it runs on its generic plan (queryOnGenericPlan),
// planned once per connection. On a distributed database it runs on its
// custom plan, which is the plan Citus prunes to the buckets' shard.
func (s *Store) KeyItems(ctx context.Context, q pgdb.Querier, r KeyRange) ([]KeyItem, error) {
	shards, err := s.Shards(ctx, q)
	if err != nil {
		return nil, err
	}
	args := pgx.NamedArgs{"key": r.OrderingKey, "mode": string(r.Mode), "settle": r.Settle, "from": r.From, "to": r.To}
	sql := sqlKeyItems
	if shards.Distributed() && r.Customer != "" {
		var buckets []int16
		if err := q.QueryRow(ctx, sqlCustomerBuckets, r.Customer).Scan(&buckets); err != nil {
			return nil, fmt.Errorf("outbox: reading the buckets of a key's tenants: %w", err)
		}
		if len(buckets) > 0 {
			sql, args["buckets"] = sqlKeyItemsInBuckets, buckets
		}
	}
	scan := func(row pgx.CollectableRow) (KeyItem, error) {
		var it KeyItem
		err := row.Scan(&it.ID, &it.State, &it.Value, &it.Timestamp, &it.Settled, &it.Identifier, &it.Cancels, &it.Tenant, &it.Period,
			&it.Meter)
		it.Period = it.Period.UTC()
		return it, err
	}
	var items []KeyItem
	if shards.Distributed() {
		var rows pgx.Rows
		if rows, err = q.Query(ctx, sql, args); err == nil {
			items, err = pgx.CollectRows(rows, scan)
		}
	} else {
		items, err = queryOnGenericPlan(ctx, q, sql, args, scan)
	}
	if err != nil {
		return nil, fmt.Errorf("outbox: reading the items of a key: %w", err)
	}
	return items, nil
}

// queryOnGenericPlan runs sql, a statement its caller repeats with new
// arguments (once per key, say: KeyItems' read, Confirm's), on its
// generic plan, and collects its rows: on one round trip it asks for
// generic plans, runs sql, and puts the session's plan_cache_mode back. A
// Querier that cannot pipeline runs sql as it is.
func queryOnGenericPlan[T any](ctx context.Context, q pgdb.Querier, sql string, args any, scan pgx.RowToFunc[T]) ([]T, error) {
	p, ok := q.(pipeliner)
	if !ok {
		rows, err := q.Query(ctx, sql, args)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, scan)
	}
	b := &pgx.Batch{}
	b.Queue(sqlGenericPlanOn)
	b.Queue(sql, args)
	b.Queue(sqlGenericPlanOff)
	res := p.SendBatch(ctx, b)
	out, err := func() ([]T, error) {
		if _, err := res.Exec(); err != nil {
			return nil, err
		}
		rows, err := res.Query()
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, scan)
	}()
	if cerr := res.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}

// sqlGenericPlanOn asks for generic plans, keeping the session's own
// plan_cache_mode aside; sqlGenericPlanOff puts it back. RESET would put
// back the session's default instead, losing a SET the session made. Both
// are SETs of the transaction the batch runs in (the caller's, or the
// batch's own implicit one), so a statement that fails between them takes
// the first back with its transaction.
const (
	sqlGenericPlanOn = `SELECT set_config('tally.saved_plan_cache_mode', current_setting('plan_cache_mode'), false),
       set_config('plan_cache_mode', 'force_generic_plan', false)`
	sqlGenericPlanOff = `SELECT set_config('plan_cache_mode', current_setting('tally.saved_plan_cache_mode'), false)`
)

// pipeliner is a Querier that can send a batch of statements in one round
// trip: *pgxpool.Pool, *pgx.Conn and pgx.Tx are.
type pipeliner interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// sqlFindIdentified finds the items with any of the identifiers, with
// their buckets, locking nothing: on a distributed database an index probe
// of every shard, as an identifier does not name its tenant.
const sqlFindIdentified = `SELECT identifier, id, bucket FROM outbox_item_bodies WHERE identifier = ANY($1::text[])`

// sqlLockIdentified locks the items with any of the identifiers in the
// buckets given (one shard group's), for an update that keeps their keys,
// in ascending id order.
const sqlLockIdentified = `SELECT b.identifier, s.id FROM outbox_item_bodies b JOIN outbox_item_states s ON s.id = b.id AND s.bucket = b.bucket
	WHERE b.bucket = ANY($2::smallint[]) AND s.bucket = ANY($2::smallint[]) AND b.identifier = ANY($1::text[])
	ORDER BY s.id FOR NO KEY UPDATE OF s`

// LockIdentified locks the items with the given identifiers, FOR NO KEY
// UPDATE in ascending id order — the order every waiting writer of the
// outbox uses — until q's transaction ends, and returns the id of each by
// its identifier; an identifier no item has is absent. A provider's error
// report locks the items it names so before it records evidence against
// them and fails them: two share locks each waiting to become an update
// lock would deadlock.
//
// It finds the items and their buckets first, then locks them one shard
// group at a time (one group on one server), each statement naming its
// items' buckets, and the groups in the order of their lowest ids, as a
// batch split by group (tenantbucket.Split) takes them. The lock checks
// the identifiers again.
func (s *Store) LockIdentified(ctx context.Context, q pgdb.Querier, identifiers []string) (map[string]int64, error) {
	ids := map[string]int64{}
	if len(identifiers) == 0 {
		return ids, nil
	}
	shards, err := s.Shards(ctx, q)
	if err != nil {
		return nil, err
	}
	type found struct {
		identifier string
		id         int64
		bucket     int16
	}
	rows, err := q.Query(ctx, sqlFindIdentified, identifiers)
	if err != nil {
		return nil, fmt.Errorf("outbox: finding the identified items: %w", err)
	}
	items, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (found, error) {
		var f found
		err := row.Scan(&f.identifier, &f.id, &f.bucket)
		return f, err
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: finding the identified items: %w", err)
	}
	slices.SortFunc(items, func(a, b found) int { return cmp.Compare(a.id, b.id) })
	for _, run := range tenantbucket.Split(shards, items, func(f found) int16 { return f.bucket }) {
		if len(run) == 0 {
			continue
		}
		var names []string
		var buckets []int16
		for _, f := range run {
			names = append(names, f.identifier)
			if !slices.Contains(buckets, f.bucket) {
				buckets = append(buckets, f.bucket)
			}
		}
		rows, err := q.Query(ctx, sqlLockIdentified, names, buckets)
		if err != nil {
			return nil, fmt.Errorf("outbox: locking the identified items: %w", err)
		}
		var (
			identifier string
			id         int64
		)
		if _, err := pgx.ForEachRow(rows, []any{&identifier, &id}, func() error {
			ids[identifier] = id
			return nil
		}); err != nil {
			return nil, fmt.Errorf("outbox: locking the identified items: %w", err)
		}
	}
	return ids, nil
}

// sqlWindowItemCount counts the refs of a window's items: the base, then
// its supplements "<base>#1", "<base>#2", … as long as each exists, one
// probe of the identity key each. Staging numbers a window's items
// contiguously (the next is numbered with this count), so the probes stop
// at the first number not yet used. Matching the base and every ref
// starting with "<base>#" instead, which the identity key cannot serve as a
// range, would read every window item of the tenant, its whole history,
// for each window staged. Each probe names the tenant's bucket ($4): one
// shard's read on a distributed database.
const sqlWindowItemCount = `
WITH RECURSIVE n(k) AS (
    SELECT 0 WHERE EXISTS (SELECT FROM outbox_item_bodies
        WHERE bucket = $4 AND tenant_key = $1 AND subject_kind = $2 AND subject_ref = $3)
    UNION ALL
    SELECT n.k + 1 FROM n WHERE EXISTS (SELECT FROM outbox_item_bodies
        WHERE bucket = $4 AND tenant_key = $1 AND subject_kind = $2 AND subject_ref = $3 || '#' || (n.k + 1))
)
SELECT count(*) FROM n`

// WindowItemCount counts a tenant's window items (SubjectUsageWindow) of
// the window whose subject ref is base: the item with that ref and its
// supplements ("<base>#n", numbered from 1 without gaps), one per ref. A
// re-addressed item's successor (ReaddressRef) carries its predecessor's
// usage and is not counted again. Staging numbers the window's next item
// with the count.
func (s *Store) WindowItemCount(ctx context.Context, q pgdb.Querier, tenant, base string) (int, error) {
	var n int
	if err := q.QueryRow(ctx, sqlWindowItemCount, tenant, SubjectUsageWindow, base, tenantbucket.Of(tenant)).Scan(&n); err != nil {
		return 0, fmt.Errorf("outbox: counting the window's items: %w", err)
	}
	return n, nil
}

// sqlWindowItemCounts is sqlWindowItemCount for many windows at once
// (tenants[i], bases[i], buckets[i]), in the order given: the same probes
// of the identity key, one recursion per window. Every probe also names
// the batch's distinct buckets ($5), which a distributed database prunes
// by: one shard's read when they are one group's, as a stager's batch is.
const sqlWindowItemCounts = `
WITH RECURSIVE w AS (
    SELECT * FROM unnest($1::text[], $3::text[], $4::smallint[]) WITH ORDINALITY AS w(tenant, base, bucket, n)
),
c(n, k) AS (
    SELECT w.n, 0 FROM w WHERE EXISTS (SELECT FROM outbox_item_bodies
        WHERE bucket = ANY($5::smallint[]) AND bucket = w.bucket AND tenant_key = w.tenant AND subject_kind = $2
          AND subject_ref = w.base)
    UNION ALL
    SELECT c.n, c.k + 1 FROM c JOIN w ON w.n = c.n WHERE EXISTS (SELECT FROM outbox_item_bodies
        WHERE bucket = ANY($5::smallint[]) AND bucket = w.bucket AND tenant_key = w.tenant AND subject_kind = $2
          AND subject_ref = w.base || '#' || (c.k + 1))
)
SELECT count(c.k) FROM w LEFT JOIN c ON c.n = w.n GROUP BY w.n ORDER BY w.n`

// WindowItemCounts is WindowItemCount for many windows in one statement:
// the count of the window whose subject ref is bases[i] in tenants[i]'s
// items, in the order given. A batched staging pass numbers its windows'
// items with it.
func (s *Store) WindowItemCounts(ctx context.Context, q pgdb.Querier, tenants, bases []string) ([]int, error) {
	if len(tenants) != len(bases) {
		return nil, fmt.Errorf("outbox: counting window items: %d tenants for %d windows", len(tenants), len(bases))
	}
	if len(bases) == 0 {
		return nil, nil
	}
	buckets, distinct := windowBuckets(tenants)
	rows, err := q.Query(ctx, sqlWindowItemCounts, tenants, SubjectUsageWindow, bases, buckets, distinct)
	if err != nil {
		return nil, fmt.Errorf("outbox: counting the windows' items: %w", err)
	}
	counts, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("outbox: counting the windows' items: %w", err)
	}
	return counts, nil
}

// windowBuckets is each tenant's bucket, in order, and the distinct ones.
func windowBuckets(tenants []string) (buckets, distinct []int16) {
	buckets = make([]int16, len(tenants))
	for i, t := range tenants {
		buckets[i] = tenantbucket.Of(t)
		if !slices.Contains(distinct, buckets[i]) {
			distinct = append(distinct, buckets[i])
		}
	}
	return buckets, distinct
}

// StatesOf reads the current state of each item of ids that exists, for a
// caller that decides from them before asking for a transition (which
// checks its own predicate again). It runs on q, so that it can be part of
// the caller's transaction.
func (s *Store) StatesOf(ctx context.Context, q pgdb.Querier, ids []int64) (map[int64]State, error) {
	rows, err := q.Query(ctx, `SELECT id, state FROM outbox_item_states WHERE id = ANY($1)`, ids)
	if err != nil {
		return nil, fmt.Errorf("outbox: reading states: %w", err)
	}
	out := make(map[int64]State, len(ids))
	var (
		id    int64
		state State
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &state}, func() error {
		out[id] = state
		return nil
	}); err != nil {
		return nil, fmt.Errorf("outbox: reading states: %w", err)
	}
	return out, nil
}
