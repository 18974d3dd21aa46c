package meter

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

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
	// Coalesce is how Post shares transactions between small batches
	// posted at the same time; the zero value shares none.
	Coalesce Coalescing

	batch batcher // Post's open group: an Ingester is not copied once used
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

// sqlIngest writes a batch in one statement. An event whose (tenant, id)
// exists already is not written; the caller compares its content.
const sqlIngest = `
INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given)
SELECT t, e, f, v, coalesce(ts, now()), ts IS NOT NULL
FROM unnest(@tenants::text[], @ids::text[], @features::text[], @values::bigint[], @timestamps::timestamptz[])
    AS u(t, e, f, v, ts)
ON CONFLICT ON CONSTRAINT usage_events_tenant_event_key DO NOTHING
RETURNING id, tenant, event_id, occurred_at`

// sqlExisting reads the stored content of events that collided.
const sqlExisting = `
SELECT e.tenant, e.event_id, e.feature, e.value, e.occurred_at, e.timestamp_given
FROM usage_events e
JOIN unnest(@tenants::text[], @ids::text[]) AS u(t, i) ON e.tenant = u.t AND e.event_id = u.i`

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
	inserted, err := insertEvents(ctx, tx, ordered)
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
// deadlocking.
func insertEvents(ctx context.Context, tx pgx.Tx, events []Event) (map[eventKey]insertedRow, error) {
	n := len(events)
	tenants, ids, features := make([]string, n), make([]string, n), make([]string, n)
	values, timestamps := make([]int64, n), make([]pgtype.Timestamptz, n)
	for j, ev := range events {
		tenants[j], ids[j], features[j], values[j] = ev.Tenant, ev.ID, ev.Feature, ev.Value
		if ev.Timestamp != nil {
			timestamps[j] = pgtype.Timestamptz{Time: *ev.Timestamp, Valid: true}
		}
	}
	rows, err := tx.Query(ctx, sqlIngest, pgx.NamedArgs{
		"tenants": tenants, "ids": ids, "features": features, "values": values, "timestamps": timestamps,
	})
	if err != nil {
		return nil, fmt.Errorf("meter: writing %d events: %w", n, err)
	}
	inserted := make(map[eventKey]insertedRow, n)
	var (
		rowID      int64
		tenant, id string
		at         time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&rowID, &tenant, &id, &at}, func() error {
		inserted[eventKey{tenant, id}] = insertedRow{rowID, at.UTC()}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("meter: writing %d events: %w", n, err)
	}
	return inserted, nil
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
	var tenants, ids []string
	for _, i := range unique {
		k := eventKey{events[i].Tenant, events[i].ID}
		if _, ok := inserted[k]; !ok {
			tenants, ids = append(tenants, k.tenant), append(ids, k.id)
		}
	}
	rows, err := tx.Query(ctx, sqlExisting, pgx.NamedArgs{"tenants": tenants, "ids": ids})
	if err != nil {
		return fmt.Errorf("meter: reading stored events: %w", err)
	}
	stored := make(map[eventKey]Event, len(ids))
	var (
		ev    Event
		at    time.Time
		given bool
	)
	if _, err := pgx.ForEachRow(rows, []any{&ev.Tenant, &ev.ID, &ev.Feature, &ev.Value, &at, &given}, func() error {
		e := ev
		if given {
			t := at.UTC()
			e.Timestamp = &t
		}
		stored[eventKey{e.Tenant, e.ID}] = e
		return nil
	}); err != nil {
		return fmt.Errorf("meter: reading stored events: %w", err)
	}
	var problems []Problem
	for _, i := range unique {
		k := eventKey{events[i].Tenant, events[i].ID}
		if _, ok := inserted[k]; ok {
			continue
		}
		old, ok := stored[k]
		switch {
		case !ok:
			return fmt.Errorf("meter: event %s/%s collided but cannot be read", k.tenant, k.id)
		case sameContent(old, events[i]):
			res.Duplicates++
		default:
			idx := i
			problems = append(problems, Problem{Index: &idx, Field: "id",
				Reason: "an event with this id was stored before with different content"})
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
