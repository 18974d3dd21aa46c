package meter

import (
	"cmp"
	"context"
	"crypto/md5"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// Result is what an ingest did.
type Result struct {
	// Accepted counts the events stored.
	Accepted int `json:"accepted"`
	// Duplicates counts events already stored with the same content (or
	// repeated within the batch): counted, not stored twice.
	Duplicates int `json:"duplicates"`
	// Unmapped counts the accepted events whose feature or tenant has no
	// mapping now: stored, and quarantined (feature_unmapped, no_customer)
	// at the next staging pass unless a mapping comes first — a mapping
	// made later re-addresses them on requeue.
	Unmapped int `json:"unmapped"`
}

// Ingester writes batches to the ledger.
type Ingester struct {
	Stager *Stager
	// MaxQuarantined is the most quarantined items the new events of one
	// batch may make (TALLY_INGEST_MAX_QUARANTINED), as the mappings and
	// the destination stand at the ingest: a batch that would make more is
	// refused whole with a *QuarantineCapError. 0 means no cap, the zero
	// Ingester's; serve's default is DefaultMaxQuarantined.
	MaxQuarantined int
	// GroupCommit is how Post shares transactions between small batches
	// posted at the same time; the zero value shares none.
	GroupCommit GroupCommit

	committer groupCommitter // Post's open group: an Ingester is not copied once used

	// shards is the buckets' placement, read on the first ingest (placement).
	shards tenantbucket.Placement
	// pairs writes with sqlIngestKeys and sqlIngestRows on one server too
	// (tests).
	pairs bool
}

// placement is the buckets' placement, read from the database on first
// use and kept for the Ingester's life: a batch is written in one pair of
// statements per shard group of its tenants.
func (in *Ingester) placement(ctx context.Context, q pgdb.Querier) (*tenantbucket.Shards, error) {
	sh, err := in.shards.Get(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("meter: %w", err)
	}
	return sh, nil
}

// DefaultMaxQuarantined is serve's Ingester.MaxQuarantined.
const DefaultMaxQuarantined = 1000

// QuarantineCapError says the new events of a batch would make more
// quarantined items than Ingester.MaxQuarantined; nothing of the batch is
// stored.
type QuarantineCapError struct {
	// Items counts the quarantined items the batch would make; Max is the
	// cap.
	Items, Max int
	// Reasons counts those items by quarantine reason.
	Reasons map[outbox.Reason]int
}

func (e *QuarantineCapError) Error() string {
	return fmt.Sprintf("meter: the batch would make %d quarantined items, more than %d", e.Items, e.Max)
}

// sqlIngest writes a batch in one statement, on one server: each event's key first
// (usage_event_keys, unique per tenant and event id across every month,
// kept when a month is detached), then the ledger rows of the keys it
// wrote, under the ids the keys took. An event whose key exists already,
// or whose month is closed, is not written; the caller reads why
// (sqlExisting). A distributed database writes the pair sqlIngestKeys and
// sqlIngestRows instead, per shard group: an INSERT in a CTE is not one
// shard's statement there.
const sqlIngest = `
WITH u AS (
    SELECT t, b, e, f, v, ts, coalesce(ts, now()) AS at
    FROM unnest(@tenants::text[], @buckets::smallint[], @ids::text[], @features::text[], @values::bigint[], @timestamps::timestamptz[])
        AS u(t, b, e, f, v, ts)
), k AS (
    INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant, bucket)
    SELECT nextval('usage_events_id_seq'), at, md5(e)::uuid, t, b FROM u
    WHERE NOT EXISTS (SELECT FROM usage_closed_months c WHERE c.month = date_trunc('month', at, 'UTC')::date)
    ON CONFLICT ON CONSTRAINT usage_event_keys_pkey DO NOTHING
    RETURNING event_row, tenant, event_key, bucket
)
INSERT INTO usage_events (id, tenant, event_id, feature, value, occurred_at, timestamp_given, bucket) OVERRIDING SYSTEM VALUE
SELECT k.event_row, u.t, u.e, u.f, u.v, u.at, u.ts IS NOT NULL, k.bucket
FROM k JOIN u ON u.t = k.tenant AND md5(u.e)::uuid = k.event_key
RETURNING id, tenant, event_id, occurred_at`

// sqlIngestKeys writes the keys of a run of one shard group, as sqlIngest
// does, and returns those it wrote. On a distributed database the
// coordinator evaluates its rows (the ids from the coordinator's sequence,
// the closed months a table of its own) and sends them to their shard.
const sqlIngestKeys = `
INSERT INTO usage_event_keys (event_row, occurred_at, event_key, tenant, bucket)
SELECT nextval('usage_events_id_seq'), u.at, md5(u.e)::uuid, u.t, u.b
FROM (SELECT t, b, e, coalesce(ts, now()) AS at
      FROM unnest(@tenants::text[], @buckets::smallint[], @ids::text[], @timestamps::timestamptz[]) AS u(t, b, e, ts)) u
WHERE NOT EXISTS (SELECT FROM usage_closed_months c WHERE c.month = date_trunc('month', u.at, 'UTC')::date)
ON CONFLICT ON CONSTRAINT usage_event_keys_pkey DO NOTHING
RETURNING event_row, tenant, event_key, occurred_at`

// sqlIngestRows writes the ledger rows of the keys sqlIngestKeys returned,
// under the ids and times the keys took.
const sqlIngestRows = `
INSERT INTO usage_events (id, tenant, event_id, feature, value, occurred_at, timestamp_given, bucket) OVERRIDING SYSTEM VALUE
SELECT * FROM unnest(@rows::bigint[], @tenants::text[], @ids::text[], @features::text[], @values::bigint[],
    @at::timestamptz[], @given::boolean[], @buckets::smallint[])`

// sqlExisting reads, for events that were not written, their stored
// content through their keys: a key without a ledger row is an event of a
// detached month; no key at all, an event of a closed month. @group is
// the events' buckets, of one shard group.
const sqlExisting = `
SELECT u.t, u.i, e.event_id, e.feature, e.value, e.occurred_at, e.timestamp_given, k.occurred_at, u.at
FROM unnest(@tenants::text[], @buckets::smallint[], @ids::text[], @timestamps::timestamptz[]) AS u(t, b, i, at)
LEFT JOIN usage_event_keys k ON k.bucket = u.b AND k.tenant = u.t AND k.event_key = md5(u.i)::uuid
    AND k.bucket = ANY(@group::smallint[])
LEFT JOIN usage_events e ON e.bucket = k.bucket AND e.id = k.event_row AND e.occurred_at = k.occurred_at
    AND e.bucket = ANY(@group::smallint[])`

// PeriodClosed starts the reason of an event refused because the month it
// occurred in (or, for a re-post, the month of the event stored under its
// id) was archived and detached from the ledger.
const PeriodClosed = "period_closed"

type eventKey struct{ tenant, id string }

// insertedRow is a ledger row the ingest wrote.
type insertedRow struct {
	id         int64
	occurredAt time.Time
}

// Ingest writes events (already decoded and authorised) to the ledger in the
// caller's transaction, in bulk, and stages the events of per-event features
// in the same transaction. An event whose tenant and id are stored already
// with the same content — feature, value, and the timestamp as posted (or
// its absence) — is a duplicate; with different content it is a problem,
// and then the whole batch fails with an *InvalidBatchError so that the
// caller rolls back and nothing is stored.
func (in *Ingester) Ingest(ctx context.Context, tx pgx.Tx, events []Event) (Result, error) {
	var (
		res     Result
		first   = make(map[eventKey]int, len(events))
		unique  []int
		problem []Problem
	)
	for i, ev := range events {
		k := eventKey{ev.Tenant, ev.ID}
		j, seen := first[k]
		if !seen {
			first[k] = i
			unique = append(unique, i)
			continue
		}
		if sameContent(events[j], ev) {
			res.Duplicates++
			continue
		}
		idx := i
		problem = append(problem, Problem{Index: &idx, Field: "id",
			Reason: fmt.Sprintf("repeats the id of event %d with different content", j)})
	}
	if len(problem) > 0 {
		return Result{}, &InvalidBatchError{Problems: problem}
	}

	// Insert in (tenant, id) order: two requests posting overlapping ids in
	// different orders then wait for each other instead of deadlocking.
	sorted := slices.Clone(unique)
	slices.SortFunc(sorted, func(a, b int) int {
		return cmp.Or(cmp.Compare(events[a].Tenant, events[b].Tenant), cmp.Compare(events[a].ID, events[b].ID))
	})
	n := len(sorted)
	ordered := make([]Event, n)
	for j, i := range sorted {
		ordered[j] = events[i]
	}
	inserted, err := in.insertEvents(ctx, tx, ordered)
	if err != nil {
		return Result{}, err
	}
	res.Accepted = len(inserted)

	if len(inserted) < n {
		if err := in.compareExisting(ctx, tx, events, unique, inserted, &res); err != nil {
			return Result{}, err
		}
	}
	if err := in.afterInsert(ctx, tx, events, unique, inserted, &res); err != nil {
		return Result{}, err
	}
	return res, nil
}

// insertEvents inserts events in their order (sqlIngest: an event whose
// tenant and id are stored already is skipped) and returns the rows it
// inserted, by tenant and id. Callers order events by (tenant, id), so that
// two transactions posting overlapping ids wait for each other instead of
// deadlocking; on a distributed database the events are written one shard
// group after the other, in the groups' order, for the same reason.
func (in *Ingester) insertEvents(ctx context.Context, tx pgx.Tx, events []Event) (map[eventKey]insertedRow, error) {
	shards, err := in.placement(ctx, tx)
	if err != nil {
		return nil, err
	}
	batch := newEventArrays(events)
	inserted := make(map[eventKey]insertedRow, len(events))
	if !shards.Distributed() && !in.pairs {
		return inserted, insertOne(ctx, tx, batch, inserted)
	}
	for _, run := range groupRuns(shards, batch) {
		if err := insertPair(ctx, tx, run, inserted); err != nil {
			return nil, err
		}
	}
	return inserted, nil
}

// eventArrays is a run of events as the ingest statements' arrays.
type eventArrays struct {
	tenants, ids, features []string
	buckets                []int16
	values                 []int64
	timestamps             []pgtype.Timestamptz
}

func newEventArrays(events []Event) eventArrays {
	n := len(events)
	a := eventArrays{tenants: make([]string, n), ids: make([]string, n), features: make([]string, n),
		buckets: make([]int16, n), values: make([]int64, n), timestamps: make([]pgtype.Timestamptz, n)}
	for j, ev := range events {
		a.tenants[j], a.ids[j], a.features[j], a.values[j] = ev.Tenant, ev.ID, ev.Feature, ev.Value
		a.buckets[j] = tenantbucket.Of(ev.Tenant)
		if ev.Timestamp != nil {
			a.timestamps[j] = pgtype.Timestamptz{Time: *ev.Timestamp, Valid: true}
		}
	}
	return a
}

func (a *eventArrays) add(b eventArrays, j int) {
	a.tenants, a.ids, a.features = append(a.tenants, b.tenants[j]), append(a.ids, b.ids[j]), append(a.features, b.features[j])
	a.buckets, a.values, a.timestamps = append(a.buckets, b.buckets[j]), append(a.values, b.values[j]), append(a.timestamps, b.timestamps[j])
}

// groupRuns cuts a into runs of one shard group each, in the order of the
// groups, each keeping a's order: a itself on one server.
func groupRuns(shards *tenantbucket.Shards, a eventArrays) []eventArrays {
	idx := make([]int, len(a.tenants))
	for j := range idx {
		idx[j] = j
	}
	runs := tenantbucket.Split(shards, idx, func(j int) int16 { return a.buckets[j] })
	if len(runs) == 1 {
		return []eventArrays{a}
	}
	slices.SortFunc(runs, func(x, y []int) int {
		return cmp.Compare(shards.GroupOf(a.buckets[x[0]]), shards.GroupOf(a.buckets[y[0]]))
	})
	out := make([]eventArrays, len(runs))
	for r, run := range runs {
		for _, j := range run {
			out[r].add(a, j)
		}
	}
	return out
}

// distinctBuckets is the buckets of a run, each once.
func distinctBuckets(buckets []int16) []int16 {
	out := slices.Clone(buckets)
	slices.Sort(out)
	return slices.Compact(out)
}

// insertOne writes a batch with sqlIngest, adding what it wrote to
// inserted.
func insertOne(ctx context.Context, tx pgx.Tx, a eventArrays, inserted map[eventKey]insertedRow) error {
	n := len(a.tenants)
	rows, err := tx.Query(ctx, sqlIngest, pgx.NamedArgs{
		"tenants": a.tenants, "buckets": a.buckets, "ids": a.ids, "features": a.features, "values": a.values, "timestamps": a.timestamps,
	})
	if err != nil {
		return fmt.Errorf("meter: writing %d events: %w", n, err)
	}
	var (
		rowID      int64
		tenant, id string
		at         time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&rowID, &tenant, &id, &at}, func() error {
		inserted[eventKey{tenant, id}] = insertedRow{rowID, at.UTC()}
		return nil
	}); err != nil {
		return fmt.Errorf("meter: writing %d events: %w", n, err)
	}
	return nil
}

// insertPair writes a run of one shard group with sqlIngestKeys, then the
// ledger rows of the keys it wrote with sqlIngestRows, adding them to
// inserted.
func insertPair(ctx context.Context, tx pgx.Tx, a eventArrays, inserted map[eventKey]insertedRow) error {
	n := len(a.tenants)
	type digest struct {
		tenant string
		key    [16]byte
	}
	byKey := make(map[digest]int, n)
	for j := range a.ids {
		byKey[digest{a.tenants[j], md5.Sum([]byte(a.ids[j]))}] = j
	}
	rows, err := tx.Query(ctx, sqlIngestKeys, pgx.NamedArgs{
		"tenants": a.tenants, "buckets": a.buckets, "ids": a.ids, "timestamps": a.timestamps,
	})
	if err != nil {
		return fmt.Errorf("meter: writing the keys of %d events: %w", n, err)
	}
	var (
		w      eventArrays
		ids    []int64
		at     []time.Time
		given  []bool
		rowID  int64
		tenant string
		key    [16]byte
		when   time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&rowID, &tenant, &key, &when}, func() error {
		j, ok := byKey[digest{tenant, key}]
		if !ok {
			return fmt.Errorf("a key of tenant %s that the batch does not hold", tenant)
		}
		w.add(a, j)
		ids, at, given = append(ids, rowID), append(at, when), append(given, a.timestamps[j].Valid)
		return nil
	}); err != nil {
		return fmt.Errorf("meter: writing the keys of %d events: %w", n, err)
	}
	if len(ids) == 0 {
		return nil
	}
	tag, err := tx.Exec(ctx, sqlIngestRows, pgx.NamedArgs{
		"rows": ids, "tenants": w.tenants, "ids": w.ids, "features": w.features, "values": w.values,
		"at": at, "given": given, "buckets": w.buckets,
	})
	if err != nil {
		return fmt.Errorf("meter: writing %d events: %w", len(ids), err)
	}
	if tag.RowsAffected() != int64(len(ids)) {
		return fmt.Errorf("meter: wrote %d ledger rows for %d keys", tag.RowsAffected(), len(ids))
	}
	for j, id := range ids {
		inserted[eventKey{w.tenants[j], w.ids[j]}] = insertedRow{id, at[j].UTC()}
	}
	return nil
}

// afterInsert does what follows the insert of a batch's new events, in its
// transaction: it counts those unmapped in res, applies the quarantine cap
// and stages what is staged at ingest.
func (in *Ingester) afterInsert(ctx context.Context, tx pgx.Tx, events []Event, unique []int, inserted map[eventKey]insertedRow, res *Result) error {
	if len(inserted) == 0 {
		return nil
	}
	// The new events' mappings, read once for the count of unmapped usage,
	// the quarantine cap and staging.
	maps, err := newEventMappings(ctx, tx, events, unique, inserted)
	if err != nil {
		return err
	}
	for _, i := range unique {
		if _, ok := inserted[eventKey{events[i].Tenant, events[i].ID}]; ok {
			if p := maps[[2]string{events[i].Tenant, events[i].Feature}]; p.Feature == nil || p.Tenant == nil {
				res.Unmapped++
			}
		}
	}
	// A batch makes at most one item per new event: one no larger than the
	// cap needs no count.
	if in.MaxQuarantined > 0 && len(inserted) > in.MaxQuarantined {
		if err := in.capQuarantine(ctx, tx, events, unique, inserted, maps); err != nil {
			return err
		}
	}
	if in.Stager != nil {
		return in.Stager.stageNewEvents(ctx, tx, events, unique, inserted, maps)
	}
	return nil
}

// newEventMappings reads, in one query, the current mappings of every
// (tenant, feature) pair of the batch's newly stored events.
func newEventMappings(ctx context.Context, tx pgx.Tx, events []Event, unique []int, inserted map[eventKey]insertedRow) (map[[2]string]mappings.Pair, error) {
	pairs := map[[2]string]bool{}
	for _, i := range unique {
		if _, ok := inserted[eventKey{events[i].Tenant, events[i].ID}]; ok {
			pairs[[2]string{events[i].Tenant, events[i].Feature}] = true
		}
	}
	var st mappings.Store
	return st.LookupMany(ctx, tx, pairs)
}

// compareExisting decides, for events that collided with stored ones,
// whether each is a duplicate or a changed event (a problem).
func (in *Ingester) compareExisting(ctx context.Context, tx pgx.Tx, events []Event, unique []int, inserted map[eventKey]insertedRow, res *Result) error {
	var missed []Event
	for _, i := range unique {
		if _, ok := inserted[eventKey{events[i].Tenant, events[i].ID}]; !ok {
			missed = append(missed, events[i])
		}
	}
	shards, err := in.placement(ctx, tx)
	if err != nil {
		return err
	}
	type existing struct {
		ev     Event
		stored bool       // a ledger row holds the event
		closed *time.Time // the event's month, when it is not stored
	}
	found := make(map[eventKey]existing, len(missed))
	var (
		tenant, id      string
		storedID, feat  *string
		value           *int64
		at, keyAt, mine *time.Time
		given           *bool
	)
	read := func() error {
		x := existing{ev: Event{Tenant: tenant, ID: id}}
		switch {
		case storedID != nil && *storedID == id:
			x.stored = true
			x.ev.Feature, x.ev.Value = *feat, *value
			if *given {
				t := at.UTC()
				x.ev.Timestamp = &t
			}
		case storedID != nil:
			x.stored = true // another id under the same md5: never the same content
		case keyAt != nil:
			t := keyAt.UTC()
			x.closed = &t
		default:
			x.closed = mine // nil for an event without a timestamp: its month is the current one
		}
		found[eventKey{tenant, id}] = x
		return nil
	}
	for _, run := range groupRuns(shards, newEventArrays(missed)) {
		rows, err := tx.Query(ctx, sqlExisting, pgx.NamedArgs{"tenants": run.tenants, "buckets": run.buckets, "ids": run.ids,
			"timestamps": run.timestamps, "group": distinctBuckets(run.buckets)})
		if err != nil {
			return fmt.Errorf("meter: reading stored events: %w", err)
		}
		if _, err := pgx.ForEachRow(rows, []any{&tenant, &id, &storedID, &feat, &value, &at, &given, &keyAt, &mine}, read); err != nil {
			return fmt.Errorf("meter: reading stored events: %w", err)
		}
	}
	var problems []Problem
	for _, i := range unique {
		k := eventKey{events[i].Tenant, events[i].ID}
		if _, ok := inserted[k]; ok {
			continue
		}
		old := found[k]
		idx := i
		switch {
		case old.stored && sameContent(old.ev, events[i]):
			res.Duplicates++
		case old.stored:
			problems = append(problems, Problem{Index: &idx, Field: "id",
				Reason: "an event with this id was stored before with different content"})
		case old.closed != nil:
			problems = append(problems, Problem{Index: &idx, Field: "timestamp",
				Reason: fmt.Sprintf("%s: the ledger of %s is archived and detached; nothing of that month is stored any more",
					PeriodClosed, old.closed.Format("2006-01"))})
		default:
			return fmt.Errorf("meter: event %s/%s collided but cannot be read", k.tenant, k.id)
		}
	}
	if len(problems) > 0 {
		return &InvalidBatchError{Problems: problems}
	}
	return nil
}

// capQuarantine refuses, with a *QuarantineCapError, a batch whose new
// events would make more than MaxQuarantined quarantined items, as the
// mappings and the destination stand now. It counts one item per new event
// of an unmapped feature (the stager quarantines each on its own at its
// next pass: a batch of 10,000 makes 10,000) or of a per-event feature, and one per window of a windowed feature, when
// the item would be quarantined, by the stager's own rule (ineligibility:
// a missing feature or tenant mapping, no account, a count value other
// than 1, a value past the provider's digits), a timestamp outside what
// the provider takes or, under LateQuarantine, a billing period whose
// invoice has closed (checkStamps, by the database clock). Items a mapping made within the
// wait would spare count too. Without a destination (export stalled) only
// the missing mappings count: the rest depends on the destination.
func (in *Ingester) capQuarantine(ctx context.Context, tx pgx.Tx, events []Event, unique []int, inserted map[eventKey]insertedRow, maps map[[2]string]mappings.Pair) error {
	var (
		target Target
		known  bool
	)
	if in.Stager != nil && in.Stager.Target != nil {
		target, known = in.Stager.Target(ctx)
	}
	// The new events, each with the reason its item would be quarantined
	// with; those with none yet have their timestamps checked together, by
	// the database clock, as the stager checks them.
	type candidate struct {
		ev     Event
		at     time.Time
		pair   mappings.Pair
		reason outbox.Reason
	}
	var (
		cands  []candidate
		stamps []stampCheck
		check  []int // indexes into cands of the stamps
	)
	for _, i := range unique {
		row, ok := inserted[eventKey{events[i].Tenant, events[i].ID}]
		if !ok {
			continue
		}
		c := candidate{ev: events[i], at: row.occurredAt, pair: maps[[2]string{events[i].Tenant, events[i].Feature}]}
		switch {
		case known:
			c.reason = ineligibility(c.pair, target, true, c.ev.Value)
		case c.pair.Feature == nil:
			c.reason = outbox.ReasonFeatureUnmapped
		case c.pair.Tenant == nil:
			c.reason = outbox.ReasonNoCustomer
		}
		if c.reason == "" && known {
			sc := target.stampCheckOf(c.pair, c.at, c.at)
			stamps, check = append(stamps, sc), append(check, len(cands))
		}
		cands = append(cands, c)
	}
	if len(stamps) > 0 {
		verdicts, err := checkStamps(ctx, tx, target, stamps)
		if err != nil {
			return fmt.Errorf("meter: %w", err)
		}
		for k, ci := range check {
			cands[ci].reason = verdicts[k].reason(target)
		}
	}
	type windowKey struct {
		tenant, feature string
		from            time.Time
	}
	var (
		capErr  = &QuarantineCapError{Max: in.MaxQuarantined, Reasons: map[outbox.Reason]int{}}
		windows = map[windowKey]bool{}
	)
	for _, c := range cands {
		if c.reason == "" {
			continue
		}
		if f := c.pair.Feature; f != nil && !f.Aggregation.PerEvent() {
			k := windowKey{c.ev.Tenant, c.ev.Feature, WindowOf(c.at, time.Duration(f.Window), anchorOf(c.pair)).From}
			if windows[k] {
				continue // one item for the window
			}
			windows[k] = true
		}
		capErr.Items++
		capErr.Reasons[c.reason]++
	}
	if capErr.Items > capErr.Max {
		return capErr
	}
	return nil
}

func sameContent(a, b Event) bool {
	if a.Feature != b.Feature || a.Value != b.Value || (a.Timestamp == nil) != (b.Timestamp == nil) {
		return false
	}
	return a.Timestamp == nil || a.Timestamp.Equal(*b.Timestamp)
}

// anchorOf is a tenant's period anchor (calendar months when unmapped or
// unset).
func anchorOf(p mappings.Pair) time.Time {
	if p.Tenant != nil && p.Tenant.PeriodAnchor != nil {
		return *p.Tenant.PeriodAnchor
	}
	return CalendarAnchor
}
