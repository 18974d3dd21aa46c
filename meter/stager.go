package meter

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/big"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// Target is where staged items are addressed: the exporter and this node's
// destination, and the timestamps the provider accepts.
type Target struct {
	// Exporter names the node's exporter (TALLY_EXPORTER), part of every
	// item's identity; a feature mapping that names another exporter
	// overrides it for that feature's items.
	Exporter string
	// Account is the destination account; empty stages items quarantined
	// as no_account.
	Account string
	// Mode is the destination's mode.
	Mode outbox.Mode
	// AcceptPast and AcceptFuture bound the event timestamps the provider
	// accepts, relative to the database clock at staging (Stripe v1: 35
	// days back, 5 minutes ahead). Outside them an item is quarantined as
	// timestamp_window.
	AcceptPast, AcceptFuture time.Duration
	// MaxValue is the largest magnitude of a value the provider takes
	// (Stripe: 15 digits, stripeapi.MaxValue); 0 means a signed 64-bit
	// value's own range. A sum window is split into supplements whose values
	// fit; an item whose value still does not fit (one event alone, or a
	// last value) is quarantined as value_digits, never truncated.
	MaxValue int64
}

// maxValue is the largest magnitude a value may have.
func (t Target) maxValue() int64 {
	if t.MaxValue <= 0 {
		return math.MaxInt64
	}
	return t.MaxValue
}

// valueFits reports whether v is within ±maxValue.
func (t Target) valueFits(v int64) bool {
	m := t.maxValue()
	return v >= -m && v <= m
}

func (t Target) validate() error {
	if t.Exporter == "" || (t.Mode != outbox.ModeLive && t.Mode != outbox.ModeTest) || t.AcceptPast <= 0 || t.AcceptFuture < 0 {
		return fmt.Errorf("meter: incomplete staging target (exporter %q, mode %q, accepted past %s, future %s)",
			t.Exporter, t.Mode, t.AcceptPast, t.AcceptFuture)
	}
	return nil
}

// Stager stages the ledger's usage into outbox items.
type Stager struct {
	// Outbox is where items go.
	Outbox *outbox.Store
	// Grace is how long after a window's end it waits for late usage
	// (TALLY_WINDOW_GRACE). Defaults to 2 minutes.
	Grace time.Duration
	// Target returns where to address items now; ok false means export is
	// stalled (no Stripe key): nothing is staged, usage stays in the ledger
	// as pending.
	Target func(ctx context.Context) (t Target, ok bool)
}

// DefaultGrace is the default window grace.
const DefaultGrace = 2 * time.Minute

// perEventBatch is how many per-event items one staging transaction makes.
const perEventBatch = 1000

// stageLockSpace is the first key of the two-key advisory lock a staging
// transaction takes on its tenant and feature ("STAG"), so that concurrent
// stagers on several nodes never stage one feature of one tenant at once.
const stageLockSpace int32 = 0x53544147

func (s *Stager) grace() time.Duration {
	if s.Grace > 0 {
		return s.Grace
	}
	return DefaultGrace
}

// PassResult is what one staging pass did.
type PassResult struct {
	// Stalled is true when nothing was staged because export is stalled.
	Stalled bool `json:"stalled"`
	// Items counts the items made, Quarantined those of them made
	// quarantined, Events the ledger rows marked.
	Items       int `json:"items"`
	Quarantined int `json:"quarantined"`
	Events      int `json:"events"`
}

func (r *PassResult) add(o PassResult) {
	r.Items += o.Items
	r.Quarantined += o.Quarantined
	r.Events += o.Events
}

// TxBeginner opens transactions: a pool or a connection.
type TxBeginner interface {
	mappings.Querier
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// Pass stages everything that is due: every closed window of windowed
// features, every event of per-event features, and, once their default
// window has closed, the events of unmapped features (quarantined as
// feature_unmapped, one item each, so that any later mapping can re-address
// them one to one). Each window is its own transaction. Errors of one
// tenant and feature do not stop the others; they are joined in the result.
func (s *Stager) Pass(ctx context.Context, db TxBeginner) (PassResult, error) {
	target, ok := s.Target(ctx)
	if !ok {
		return PassResult{Stalled: true}, nil
	}
	if err := target.validate(); err != nil {
		return PassResult{}, err
	}
	rows, err := db.Query(ctx, `SELECT DISTINCT tenant, feature FROM usage_events WHERE item_id IS NULL ORDER BY 1, 2`)
	if err != nil {
		return PassResult{}, fmt.Errorf("meter: listing unstaged usage: %w", err)
	}
	var groups [][2]string
	var tenant, feature string
	if _, err := pgx.ForEachRow(rows, []any{&tenant, &feature}, func() error {
		groups = append(groups, [2]string{tenant, feature})
		return nil
	}); err != nil {
		return PassResult{}, fmt.Errorf("meter: listing unstaged usage: %w", err)
	}
	var (
		total PassResult
		errs  []error
	)
	for _, g := range groups {
		res, err := s.stageGroup(ctx, db, target, g[0], g[1])
		total.add(res)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s/%s: %w", g[0], g[1], err))
		}
		if ctx.Err() != nil {
			break
		}
	}
	return total, errors.Join(errs...)
}

func (s *Stager) stageGroup(ctx context.Context, db TxBeginner, target Target, tenant, feature string) (PassResult, error) {
	var st mappings.Store
	pair, err := st.Lookup(ctx, db, tenant, feature)
	if err != nil {
		return PassResult{}, err
	}
	if pair.Feature == nil || pair.Feature.Aggregation.PerEvent() {
		var total PassResult
		for {
			res, more, err := s.stageEvents(ctx, db, target, tenant, feature)
			total.add(res)
			if err != nil || !more {
				return total, err
			}
		}
	}
	width := time.Duration(pair.Feature.Window)
	rows, err := db.Query(ctx, `
		SELECT DISTINCT date_bin(@width::interval, occurred_at, @origin::timestamptz)
		FROM usage_events WHERE tenant = @tenant AND feature = @feature AND item_id IS NULL ORDER BY 1`,
		pgx.NamedArgs{"width": width, "origin": gridOrigin, "tenant": tenant, "feature": feature})
	if err != nil {
		return PassResult{}, err
	}
	buckets, err := pgx.CollectRows(rows, pgx.RowTo[time.Time])
	if err != nil {
		return PassResult{}, err
	}
	var (
		total PassResult
		errs  []error
	)
	for _, b := range buckets {
		for _, w := range windowsOfBucket(b, width, anchorOf(pair)) {
			res, err := s.stageWindow(ctx, db, target, tenant, feature, w, pair.Version())
			total.add(res)
			if err != nil {
				errs = append(errs, err) // one window's failure does not hold back the others
			}
		}
	}
	return total, errors.Join(errs...)
}

// tryLock takes this transaction's advisory lock on tenant and feature;
// false means another stager holds it.
func tryLock(ctx context.Context, tx pgx.Tx, tenant, feature string) (ok bool, err error) {
	err = tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1::int4, hashtext($2 || '|' || $3))`,
		stageLockSpace, tenant, feature).Scan(&ok)
	return ok, err
}

// lockGroup takes the lock and, holding it, reads the tenant's and the
// feature's current mappings; ok false means another stager holds the lock.
func lockGroup(ctx context.Context, tx pgx.Tx, tenant, feature string) (pair mappings.Pair, ok bool, err error) {
	if ok, err = tryLock(ctx, tx, tenant, feature); err != nil || !ok {
		return mappings.Pair{}, false, err
	}
	var st mappings.Store
	pair, err = st.Lookup(ctx, tx, tenant, feature)
	return pair, err == nil, err
}

// sqlWindowRows locks the unstaged rows of one closed window and reduces them
// in one statement: the window counts as closed when its end plus the grace
// has passed on the database clock.
const sqlWindowRows = `
WITH locked AS (
    SELECT id, value, occurred_at FROM usage_events
    WHERE tenant = @tenant AND feature = @feature AND item_id IS NULL
      AND occurred_at >= @from AND occurred_at < @to
      AND @to::timestamptz + @grace::interval <= clock_timestamp()
    FOR UPDATE SKIP LOCKED
)
SELECT coalesce(array_agg(id ORDER BY occurred_at, id), '{}'), coalesce(sum(value), 0)::numeric,
       (array_agg(value ORDER BY occurred_at DESC, id DESC))[1], max(occurred_at)
FROM locked`

// stageWindow stages one window's unstaged rows as one item (a supplement
// when the window has items already), in one transaction.
func (s *Stager) stageWindow(ctx context.Context, db TxBeginner, target Target, tenant, feature string, w Window, version int) (res PassResult, err error) {
	err = pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		pair, ok, err := lockGroup(ctx, tx, tenant, feature)
		if err != nil || !ok {
			return err
		}
		if pair.Feature == nil || pair.Feature.Aggregation.PerEvent() || pair.Version() != version {
			return nil // the mapping moved since the pass began; the next pass stages it
		}
		var (
			ids  []int64
			sum  pgtype.Numeric
			last *int64
			ts   *time.Time
		)
		if err := tx.QueryRow(ctx, sqlWindowRows, pgx.NamedArgs{
			"tenant": tenant, "feature": feature, "from": w.From, "to": w.To, "grace": s.grace(),
		}).Scan(&ids, &sum, &last, &ts); err != nil {
			return fmt.Errorf("locking the window's rows: %w", err)
		}
		if len(ids) == 0 {
			return nil
		}
		if pair.Feature.Aggregation == mappings.Last {
			// Late rows of a last window that are all older than its latest
			// staged row change nothing Stripe should see: they join the item
			// that carries that row. A supplement would re-send an older
			// value as the window's last.
			absorbed, err := absorbLate(ctx, tx, tenant, feature, w, w.SubjectRef(feature, 0), ids)
			if err != nil || absorbed {
				if err == nil {
					res.Events = len(ids)
				}
				return err
			}
		}
		// One item carries the window, unless its sum does not fit what
		// the provider accepts (Target.MaxValue; a signed 64-bit value at
		// most): then its rows are split, in time order, into as few items
		// (supplements) as keep every partial sum in range.
		chunks := []chunk{{ids: ids, value: *last, at: *ts}}
		if pair.Feature.Aggregation == mappings.Sum {
			if v, ok := numericToInt64(sum); ok && target.valueFits(v) {
				chunks[0].value = v
			} else if chunks, err = splitWindow(ctx, tx, ids, target.maxValue()); err != nil {
				return err
			}
		}
		base := w.SubjectRef(feature, 0)
		var n int
		// One number per ref: a re-addressed item's successor keeps its ref.
		// A re-addressed item's successor ("%r<n>") carries its
		// predecessor's number.
		if err := tx.QueryRow(ctx, `SELECT count(DISTINCT subject_ref) FROM outbox_items WHERE tenant_key = $1 AND subject_kind = $2
			AND (subject_ref = $3 OR starts_with(subject_ref, $3 || '#')) AND strpos(subject_ref, '%r') = 0`,
			tenant, outbox.SubjectUsageWindow, base).Scan(&n); err != nil {
			return fmt.Errorf("counting the window's items: %w", err)
		}
		for k, c := range chunks {
			item := s.item(pair, target, tenant, feature, outbox.SubjectUsageWindow, w.SubjectRef(feature, n+k), c.value, c.at, w.PeriodStart)
			if item.Quarantine == "" {
				if item.Quarantine, err = timestampReason(ctx, tx, target, c.at); err != nil {
					return err
				}
			}
			enq, err := s.Outbox.Enqueue(ctx, tx, item)
			if err != nil {
				return err
			}
			if !enq.Inserted {
				return fmt.Errorf("window %s: the item exists already (item %d); not marking rows with it", item.SubjectRef, enq.ID)
			}
			if err := markRows(ctx, tx, c.ids, []int64{enq.ID}); err != nil {
				return err
			}
			res.Items++
			res.Events += len(c.ids)
			if item.Quarantine != "" {
				res.Quarantined++
			}
		}
		return nil
	})
	if err != nil {
		return PassResult{}, fmt.Errorf("staging window %s: %w", w.SubjectRef(feature, 0), err)
	}
	return res, nil
}

// sqlEventRows locks up to a batch of unstaged rows of a per-event or an
// unmapped feature. Rows that would be quarantined for a missing mapping or
// destination wait for their default window (one hour) plus the grace to
// close, which gives a human the time to supply it before they are
// quarantined one by one. Rows timestamped further ahead than the provider
// accepts wait until they are not.
const sqlEventRows = `
SELECT id, event_id, value, occurred_at FROM usage_events
WHERE tenant = @tenant AND feature = @feature AND item_id IS NULL
  AND (NOT @wait OR date_bin(interval '1 hour', occurred_at, @origin::timestamptz) + interval '1 hour' + @grace::interval
                    <= clock_timestamp())
  AND occurred_at <= clock_timestamp() + @future::interval
ORDER BY id LIMIT @limit
FOR UPDATE SKIP LOCKED`

// stageEvents stages up to a batch of a per-event (or unmapped) feature's
// rows, one item each, in one transaction; more says another batch may
// follow.
func (s *Stager) stageEvents(ctx context.Context, db TxBeginner, target Target, tenant, feature string) (res PassResult, more bool, err error) {
	err = pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		pair, ok, err := lockGroup(ctx, tx, tenant, feature)
		if err != nil || !ok {
			return err
		}
		if pair.Feature != nil && !pair.Feature.Aggregation.PerEvent() {
			return nil // mapped to a windowed aggregation meanwhile
		}
		rows, err := tx.Query(ctx, sqlEventRows, pgx.NamedArgs{
			"tenant": tenant, "feature": feature, "wait": waits(pair, target),
			"origin": gridOrigin, "grace": s.grace(), "future": target.AcceptFuture, "limit": perEventBatch,
		})
		if err != nil {
			return err
		}
		var evs []stagedEvent
		var e stagedEvent
		if _, err := pgx.ForEachRow(rows, []any{&e.rowID, &e.eventID, &e.value, &e.at}, func() error {
			evs = append(evs, e)
			return nil
		}); err != nil {
			return err
		}
		if len(evs) == 0 {
			return nil
		}
		more = len(evs) == perEventBatch
		res, err = s.enqueueEvents(ctx, tx, target, tenant, feature, pair, evs)
		return err
	})
	if err != nil {
		return PassResult{}, false, fmt.Errorf("staging events: %w", err)
	}
	return res, more, nil
}

type stagedEvent struct {
	rowID   int64
	eventID string
	value   int64
	at      time.Time
}

// enqueueEvents makes one item per event and marks each row with its item.
func (s *Stager) enqueueEvents(ctx context.Context, tx pgx.Tx, target Target, tenant, feature string, pair mappings.Pair, evs []stagedEvent) (PassResult, error) {
	stamps := make([]time.Time, len(evs))
	for i, e := range evs {
		stamps[i] = e.at
	}
	outside, err := timestampsOutside(ctx, tx, target, stamps)
	if err != nil {
		return PassResult{}, err
	}
	items := make([]outbox.NewItem, len(evs))
	var res PassResult
	for i, e := range evs {
		items[i] = s.item(pair, target, tenant, feature, outbox.SubjectUsageEvent, EventSubjectRef(feature, e.eventID),
			e.value, e.at, PeriodStart(e.at, anchorOf(pair)))
		if items[i].Quarantine == "" && outside[i] {
			items[i].Quarantine = outbox.ReasonTimestampWindow
		}
		if items[i].Quarantine != "" {
			res.Quarantined++
		}
	}
	enq, err := s.Outbox.EnqueueBatch(ctx, tx, items)
	if err != nil {
		return PassResult{}, err
	}
	rowIDs, itemIDs := make([]int64, len(evs)), make([]int64, len(evs))
	for i := range evs {
		if !enq[i].Inserted {
			return PassResult{}, fmt.Errorf("event %s: its item exists already (item %d); not marking the row with it", evs[i].eventID, enq[i].ID)
		}
		rowIDs[i], itemIDs[i] = evs[i].rowID, enq[i].ID
	}
	if err := markRows(ctx, tx, rowIDs, itemIDs); err != nil {
		return PassResult{}, err
	}
	res.Items, res.Events = len(evs), len(evs)
	return res, nil
}

// stageNewEvents stages, inside the ingest transaction, the new events of
// features mapped per event. Everything else waits for the stager.
func (s *Stager) stageNewEvents(ctx context.Context, tx pgx.Tx, events []Event, unique []int, inserted map[eventKey]insertedRow) error {
	target, ok := s.Target(ctx)
	if !ok {
		return nil
	}
	if err := target.validate(); err != nil {
		return err
	}
	pairs := map[[2]string]bool{}
	for _, i := range unique {
		pairs[[2]string{events[i].Tenant, events[i].Feature}] = true
	}
	var st mappings.Store
	maps, err := st.LookupMany(ctx, tx, pairs)
	if err != nil {
		return err
	}
	groups := map[[2]string][]stagedEvent{}
	for _, i := range unique {
		ev := events[i]
		k := [2]string{ev.Tenant, ev.Feature}
		p := maps[k]
		row, ok := inserted[eventKey{ev.Tenant, ev.ID}]
		if !ok || p.Feature == nil || !p.Feature.Aggregation.PerEvent() || waits(p, target) {
			continue // the stager stages it, after the wait sqlEventRows describes
		}
		groups[k] = append(groups[k], stagedEvent{rowID: row.id, eventID: ev.ID, value: ev.Value, at: row.occurredAt})
	}
	for k, evs := range groups {
		// Events timestamped further ahead than the provider accepts wait
		// for the stager too, rather than being quarantined now.
		ahead, err := timestampsAhead(ctx, tx, target, evs)
		if err != nil {
			return err
		}
		kept := evs[:0]
		for i, e := range evs {
			if !ahead[i] {
				kept = append(kept, e)
			}
		}
		if evs = kept; len(evs) == 0 {
			continue
		}
		if ok, err := tryLock(ctx, tx, k[0], k[1]); err != nil {
			return err
		} else if !ok {
			continue // a stager holds this feature right now; it, or the next pass, stages these
		}
		if _, err := s.enqueueEvents(ctx, tx, target, k[0], k[1], maps[k], evs); err != nil {
			return err
		}
	}
	return nil
}

// item builds an item, quarantined with the first reason that makes it
// ineligible (the timestamp is checked separately, against the database
// clock). Its exporter is the feature mapping's when it names one, else the
// node's (target.Exporter): the exporter is part of the identity, so the
// identifier differs per exporter.
func (s *Stager) item(pair mappings.Pair, target Target, tenant, feature, kind, ref string, value int64, at, period time.Time) outbox.NewItem {
	it := outbox.NewItem{
		Identity: outbox.Identity{
			TenantKey: tenant, SubjectKind: kind, SubjectRef: ref, Exporter: pair.Feature.ExporterOr(target.Exporter),
			DestinationAccount: target.Account, Mode: target.Mode, MappingVersion: pair.Version(),
		},
		Payload: outbox.Payload{Value: value, Timestamp: at.Unix(), Feature: feature, Period: rfc3339(period)},
	}
	if pair.Feature != nil {
		it.Payload.EventName = pair.Feature.EventName
		// The meter's payload keys, when they are not Stripe's defaults
		// (an item without them is sent with the defaults).
		if k := pair.Feature.CustomerPayloadKey; k != mappings.DefaultCustomerPayloadKey {
			it.Payload.CustomerKey = k
		}
		if k := pair.Feature.ValuePayloadKey; k != mappings.DefaultValuePayloadKey {
			it.Payload.ValueKey = k
		}
	}
	if pair.Tenant != nil {
		it.Payload.Customer = pair.Tenant.StripeCustomerID
	}
	switch {
	case pair.Feature == nil:
		it.Quarantine = outbox.ReasonFeatureUnmapped
	case pair.Tenant == nil:
		it.Quarantine = outbox.ReasonNoCustomer
	case target.Account == "":
		it.Quarantine = outbox.ReasonNoAccount
	case kind == outbox.SubjectUsageEvent && pair.Feature.Aggregation.PerEvent() && value != 1:
		it.Quarantine = outbox.ReasonCountValue
	case !target.valueFits(value):
		it.Quarantine = outbox.ReasonValueDigits
	}
	return it
}

// waits reports whether a per-event feature's rows wait for their default
// window and the grace before they are staged: while they would be
// quarantined for a mapping or destination a human can still supply.
func waits(pair mappings.Pair, target Target) bool {
	return pair.Feature == nil || pair.Tenant == nil || target.Account == ""
}

// timestampsAhead reports, for each event, whether its timestamp is further
// ahead than the provider accepts, by the database clock.
func timestampsAhead(ctx context.Context, tx pgx.Tx, target Target, evs []stagedEvent) ([]bool, error) {
	stamps := make([]time.Time, len(evs))
	for i, e := range evs {
		stamps[i] = e.at
	}
	rows, err := tx.Query(ctx, `SELECT ts > clock_timestamp() + @future::interval
		FROM unnest(@stamps::timestamptz[]) WITH ORDINALITY AS u(ts, n) ORDER BY n`,
		pgx.NamedArgs{"future": target.AcceptFuture, "stamps": stamps})
	if err != nil {
		return nil, fmt.Errorf("checking timestamps: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[bool])
}

// timestampReason is timestamp_window when ts is outside what the provider
// accepts, by the database clock.
func timestampReason(ctx context.Context, tx pgx.Tx, target Target, ts time.Time) (outbox.Reason, error) {
	out, err := timestampsOutside(ctx, tx, target, []time.Time{ts})
	if err != nil {
		return "", err
	}
	if out[0] {
		return outbox.ReasonTimestampWindow, nil
	}
	return "", nil
}

func timestampsOutside(ctx context.Context, tx pgx.Tx, target Target, stamps []time.Time) ([]bool, error) {
	rows, err := tx.Query(ctx, `
		SELECT ts < clock_timestamp() - @past::interval OR ts > clock_timestamp() + @future::interval
		FROM unnest(@stamps::timestamptz[]) WITH ORDINALITY AS u(ts, n) ORDER BY n`,
		pgx.NamedArgs{"past": target.AcceptPast, "future": target.AcceptFuture, "stamps": stamps})
	if err != nil {
		return nil, fmt.Errorf("checking timestamps: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[bool])
}

// markRows sets each row's item, once: items has one id for all rows or one
// per row.
func markRows(ctx context.Context, tx pgx.Tx, rows, items []int64) error {
	if len(items) == 1 && len(rows) > 1 {
		one := items[0]
		items = make([]int64, len(rows))
		for i := range items {
			items[i] = one
		}
	}
	tag, err := tx.Exec(ctx, `
		UPDATE usage_events u SET item_id = m.item, staged_at = clock_timestamp()
		FROM unnest($1::bigint[], $2::bigint[]) AS m(row_id, item)
		WHERE u.id = m.row_id AND u.item_id IS NULL`, rows, items)
	if err != nil {
		return fmt.Errorf("marking rows: %w", err)
	}
	if int(tag.RowsAffected()) != len(rows) {
		return fmt.Errorf("marking rows: %d of %d rows were still unstaged", tag.RowsAffected(), len(rows))
	}
	return nil
}

// absorbLate marks the late rows ids of a last window with the window item
// of the window's latest row staged in one (its own ref base or a
// supplement of it), when every one of them is older than that row (by
// occurred_at, then id); absorbed says it did. Rows staged in any other item
// — a per-event item quarantined before the feature was mapped as last,
// say — are not the window's: joining one would make its value, when it is
// rebuilt, the older row's.
func absorbLate(ctx context.Context, tx pgx.Tx, tenant, feature string, w Window, base string, ids []int64) (absorbed bool, err error) {
	var item *int64
	err = tx.QueryRow(ctx, `
		WITH latest AS (
		    SELECT u.item_id, u.occurred_at, u.id FROM usage_events u JOIN outbox_items o ON o.id = u.item_id
		    WHERE u.tenant = $1 AND u.feature = $2 AND u.item_id IS NOT NULL AND u.occurred_at >= $3 AND u.occurred_at < $4
		      AND o.subject_kind = $6 AND (o.subject_ref = $7 OR starts_with(o.subject_ref, $7 || '#'))
		    ORDER BY u.occurred_at DESC, u.id DESC LIMIT 1
		)
		SELECT l.item_id FROM latest l
		WHERE NOT EXISTS (SELECT 1 FROM usage_events u WHERE u.id = ANY($5::bigint[])
		                  AND (u.occurred_at, u.id) > (l.occurred_at, l.id))`,
		tenant, feature, w.From, w.To, ids, outbox.SubjectUsageWindow, base).Scan(&item)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && item == nil) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("comparing late rows: %w", err)
	}
	return true, markRows(ctx, tx, ids, []int64{*item})
}

// numericToInt64 converts a window's exact sum; ok is false when it does not
// fit a signed 64-bit integer.
func numericToInt64(n pgtype.Numeric) (int64, bool) {
	if !n.Valid || n.NaN || n.InfinityModifier != 0 || n.Exp < 0 {
		return 0, false
	}
	v := new(big.Int).Set(n.Int)
	if n.Exp > 0 {
		v.Mul(v, new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(n.Exp)), nil))
	}
	if !v.IsInt64() {
		return 0, false
	}
	return v.Int64(), true
}

// chunk is the part of a window one item carries.
type chunk struct {
	ids   []int64
	value int64
	at    time.Time // the latest occurred_at of its rows
}

// splitWindow splits a window's rows (ids, in time order) into chunks whose
// sums stay within ±limit (at most a signed 64-bit integer's range): a new
// chunk starts when the next value would take the running sum out of range.
// A value out of range on its own makes a chunk of its own, which the
// stager quarantines (value_digits); every chunk holds at least one row.
func splitWindow(ctx context.Context, tx pgx.Tx, ids []int64, limit int64) ([]chunk, error) {
	rows, err := tx.Query(ctx, `SELECT u.id, u.value, u.occurred_at FROM usage_events u
		JOIN unnest($1::bigint[]) WITH ORDINALITY AS w(id, n) ON u.id = w.id ORDER BY w.n`, ids)
	if err != nil {
		return nil, fmt.Errorf("reading the window's rows: %w", err)
	}
	var (
		out []chunk
		cur chunk
		id  int64
		v   int64
		at  time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &v, &at}, func() error {
		if len(cur.ids) > 0 && !sumFits(cur.value, v, limit) {
			out = append(out, cur)
			cur = chunk{}
		}
		cur.ids, cur.value, cur.at = append(cur.ids, id), cur.value+v, at
		return nil
	}); err != nil {
		return nil, fmt.Errorf("reading the window's rows: %w", err)
	}
	return append(out, cur), nil
}

// sumFits reports whether cur and cur+v are both within ±limit (limit ≤
// math.MaxInt64), without overflowing.
func sumFits(cur, v, limit int64) bool {
	if cur < -limit || cur > limit {
		return false
	}
	if (v > 0 && cur > limit-v) || (v < 0 && cur < -limit-v) {
		return false
	}
	return true
}
