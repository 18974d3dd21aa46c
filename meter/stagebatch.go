package meter

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// Part is one of Count ranges of equal width of the tenant hash: a staging
// pass of a Part stages only the tenants whose hash (PostgreSQL's
// hashtext(tenant), a signed 32-bit value stable across nodes) lies in its
// range. The ranges are cut as Citus cuts a hash-distributed table into
// shards of equal width. On a distributed database a part owns shard
// groups instead (owns), so that its statements each name one shard's
// buckets. The zero Part is the whole range, every group.
type Part struct {
	// Index is the part's number, 0 to Count-1.
	Index int `json:"part,omitempty"`
	// Count is how many parts the hash range is cut into; 0 or 1 is one
	// part, the whole range.
	Count int `json:"parts,omitempty"`
}

// Range is the part's closed range of tenant hashes, [lo, hi].
func (p Part) Range() (lo, hi int32) {
	if p.Count <= 1 || p.Index < 0 || p.Index >= p.Count {
		return math.MinInt32, math.MaxInt32
	}
	step := (int64(1) << 32) / int64(p.Count)
	l := int64(math.MinInt32) + int64(p.Index)*step
	h := l + step - 1
	if p.Index == p.Count-1 {
		h = math.MaxInt32
	}
	return int32(l), int32(h)
}

// owns reports whether the part stages shard group g of a distributed
// database: the parts deal the groups out in turn.
func (p Part) owns(g int) bool {
	if p.Count <= 1 || p.Index < 0 || p.Index >= p.Count {
		return true
	}
	return g%p.Count == p.Index
}

// Parts are the n parts that cover the hash range.
func Parts(n int) []Part {
	n = max(n, 1)
	out := make([]Part, n)
	for i := range out {
		out[i] = Part{Index: i, Count: n}
	}
	return out
}

// The bounds of one batch: how many tenant-and-feature groups, and how many
// unstaged rows of closed grid buckets, one staging transaction takes at
// most (a group or a bucket larger than that takes a transaction of its
// own).
const (
	stageBatchGroups = 200
	stageBatchRows   = 20000
)

// batchBounds are the bounds of s's batches: stageBatchGroups and
// stageBatchRows unless a test set others.
func (s *Stager) batchBounds() (groups int, rows int64) {
	groups, rows = stageBatchGroups, stageBatchRows
	if s.batchGroups > 0 {
		groups = s.batchGroups
	}
	if s.batchRows > 0 {
		rows = s.batchRows
	}
	return groups, rows
}

// unstagedGroup is a tenant and feature with unstaged rows, and how many.
type unstagedGroup struct {
	tenant, feature string
	rows            int64
	bucket          int16 // the tenant's
}

func (g unstagedGroup) key() [2]string { return [2]string{g.tenant, g.feature} }

// sqlUnstaged lists the tenants and features of a range of tenant hashes
// with unstaged rows, from the partial index that holds the unstaged rows
// only.
const sqlUnstaged = `SELECT tenant, feature, count(*) FROM usage_events
		WHERE item_id IS NULL AND hashtext(tenant) BETWEEN $1 AND $2 GROUP BY 1, 2 ORDER BY 1, 2`

// sqlUnstagedOfShard is sqlUnstaged for the tenants of the buckets of
// the shard groups a part owns: one read of their shards, without locks,
// once per pass, whose rows say which groups to stage.
const sqlUnstagedOfShard = `SELECT tenant, feature, count(*) FROM usage_events
		WHERE item_id IS NULL AND bucket = ANY($1::smallint[]) GROUP BY 1, 2 ORDER BY 1, 2`

// listUnstaged lists the tenants and features with unstaged rows: of
// part's hash range, or, with buckets (a distributed database's), of
// those buckets.
func listUnstaged(ctx context.Context, db pgdb.DB, part Part, buckets []int16) ([]unstagedGroup, error) {
	lo, hi := part.Range()
	sql, args := sqlUnstaged, []any{lo, hi}
	if buckets != nil {
		sql, args = sqlUnstagedOfShard, []any{buckets}
	}
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("meter: listing unstaged usage: %w", err)
	}
	var (
		out []unstagedGroup
		g   unstagedGroup
	)
	if _, err := pgx.ForEachRow(rows, []any{&g.tenant, &g.feature, &g.rows}, func() error {
		g.bucket = tenantbucket.Of(g.tenant)
		out = append(out, g)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("meter: listing unstaged usage: %w", err)
	}
	return out, nil
}

// onShard is a batch statement's variant for one shard group: each
// replacement (old, new, …) must match exactly once. On one server the
// statement runs as written; the variant names the group's buckets on
// every distributed table and joins by the bucket.
func onShard(sql string, pairs ...string) string {
	for i := 0; i+1 < len(pairs); i += 2 {
		if n := strings.Count(sql, pairs[i]); n != 1 {
			panic(fmt.Sprintf("meter: a shard variant's %q matches %d times", pairs[i], n))
		}
		sql = strings.Replace(sql, pairs[i], pairs[i+1], 1)
	}
	return sql
}

// stageBatches stages the windows of the windowed groups in batches and
// returns the groups left for staging one window (or one batch of events)
// a transaction: per-event and unmapped features, and the groups of a batch
// that failed.
// On a distributed database, groups and buckets are one shard group's.
func (s *Stager) stageBatches(ctx context.Context, db pgdb.DB, target Target, groups []unstagedGroup, buckets []int16) (rest []unstagedGroup, total PassResult) {
	keys := make(map[[2]string]bool, len(groups))
	for _, g := range groups {
		keys[g.key()] = true
	}
	var st mappings.Store
	pairs, err := st.LookupMany(ctx, db, keys)
	if err != nil {
		return groups, total // the slow way reads them again, one group at a time
	}
	var batch []unstagedGroup
	var rows int64
	maxGroups, maxRows := s.batchBounds()
	flush := func() {
		for len(batch) > 0 && ctx.Err() == nil {
			res, more, err := s.stageBatch(ctx, db, target, batch, buckets)
			if err != nil {
				rest = append(rest, batch...) // staged again one window a transaction, which isolates the error
				return
			}
			total.add(res)
			if res.Events == 0 {
				return // what is left is not due yet
			}
			batch = more
		}
	}
	for _, g := range groups {
		if p := pairs[g.key()]; p.Feature == nil || p.Feature.Aggregation.PerEvent() {
			rest = append(rest, g)
			continue
		}
		if len(batch) > 0 && (len(batch) >= maxGroups || rows+g.rows > maxRows) {
			flush()
			batch, rows = nil, 0
		}
		batch, rows = append(batch, g), rows+g.rows
	}
	flush()
	return rest, total
}

// batchWindow is a window of a batch, and its group.
type batchWindow struct {
	group  int
	window Window
	rows   windowRows
}

// stageBatch stages the closed windows of a batch of windowed groups in one
// transaction: it try-locks each group (the per-tenant-and-feature advisory
// lock of stageWindow; a group another stager holds is left to it), reads
// their mappings holding the locks, lists the grid buckets of their
// unstaged rows, locks and reduces the rows of every window in one
// statement, and enqueues the items and marks the rows in one statement
// each. The windows past stageBatchRows are left; more are the groups that
// have some.
//
// Two passes whose parts overlap never stage a window twice: of two
// transactions only the one holding a group's advisory lock stages it (the
// other skips it, and the ingest's per-event staging too); it reads the
// rows unstaged (item_id IS NULL) after taking the lock, under READ
// COMMITTED, so a commit of an earlier holder is seen; it marks a row only
// while unstaged and fails unless every row was; and a window's ref is
// part of the item's unique identity.
//
// buckets, on a distributed database, are the batch's shard group's: the
// reads, the locks and the writes are then each one shard's statement.
func (s *Stager) stageBatch(ctx context.Context, db pgdb.DB, target Target, batch []unstagedGroup, buckets []int16) (res PassResult, more []unstagedGroup, err error) {
	err = pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		res, more = PassResult{}, nil
		groups, pairs, err := lockGroups(ctx, tx, batch)
		if err != nil || len(groups) == 0 {
			return err
		}
		windows, cut, err := s.batchWindows(ctx, tx, groups, pairs, buckets)
		if err != nil {
			return err
		}
		for _, i := range cut {
			more = append(more, groups[i])
		}
		if windows, err = s.lockBatchRows(ctx, tx, groups, windows, buckets); err != nil || len(windows) == 0 {
			return err
		}
		res, err = s.enqueueBatch(ctx, tx, target, groups, pairs, windows)
		return err
	})
	if err != nil {
		return PassResult{}, nil, fmt.Errorf("staging a batch of %d features: %w", len(batch), err)
	}
	return res, more, nil
}

// lockGroups try-locks each group of batch in one statement and reads the
// mappings of those it locked; it keeps those still mapped to a windowed
// aggregation (a group mapped per event meanwhile is left to the slow way
// of the next pass).
func lockGroups(ctx context.Context, tx pgx.Tx, batch []unstagedGroup) ([]unstagedGroup, []mappings.Pair, error) {
	tenants, features := make([]string, len(batch)), make([]string, len(batch))
	for i, g := range batch {
		tenants[i], features[i] = g.tenant, g.feature
	}
	rows, err := tx.Query(ctx, `SELECT n FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS g(tenant, feature, n)
		WHERE pg_try_advisory_xact_lock($1::int4, hashtext(tenant || '|' || feature)) ORDER BY n`,
		stageLockSpace, tenants, features)
	if err != nil {
		return nil, nil, fmt.Errorf("locking the features: %w", err)
	}
	locked, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, nil, fmt.Errorf("locking the features: %w", err)
	}
	keys := make(map[[2]string]bool, len(locked))
	for _, n := range locked {
		keys[batch[n-1].key()] = true
	}
	var st mappings.Store
	pairs, err := st.LookupMany(ctx, tx, keys)
	if err != nil {
		return nil, nil, err
	}
	var (
		groups []unstagedGroup
		ps     []mappings.Pair
	)
	for _, n := range locked {
		g := batch[n-1]
		if p := pairs[g.key()]; p.Feature != nil && !p.Feature.Aggregation.PerEvent() {
			groups, ps = append(groups, g), append(ps, p)
		}
	}
	return groups, ps, nil
}

// sqlBatchBuckets lists, for each group, the grid buckets (of its feature's
// width) holding unstaged rows that may be in a closed window (older than
// the grace), with how many and whether the whole bucket has closed.
const sqlBatchBuckets = `
SELECT g.n, b.bucket, b.rows, b.bucket + g.width + @grace::interval <= statement_timestamp()
FROM unnest(@tenants::text[], @features::text[], @widths::interval[]) WITH ORDINALITY AS g(tenant, feature, width, n)
CROSS JOIN LATERAL (
    SELECT date_bin(g.width, u.occurred_at, @origin::timestamptz) AS bucket, count(*) AS rows
    FROM usage_events u
    WHERE u.tenant = g.tenant AND u.feature = g.feature AND u.item_id IS NULL
      AND u.occurred_at < statement_timestamp() - @grace::interval
    GROUP BY 1
) b
ORDER BY g.n, b.bucket`

// sqlBatchBucketsOnShard is sqlBatchBuckets for one shard group's groups
// (@buckets), each with its tenant's bucket.
var sqlBatchBucketsOnShard = onShard(sqlBatchBuckets,
	"@widths::interval[])", "@widths::interval[], @tbuckets::smallint[])",
	"g(tenant, feature, width, n)", "g(tenant, feature, width, tbucket, n)",
	"WHERE u.tenant = g.tenant", "WHERE u.bucket = ANY(@buckets::smallint[]) AND u.bucket = g.tbucket AND u.tenant = g.tenant")

// batchWindows lists the windows of the groups' buckets, in time order per
// group, up to stageBatchRows rows of closed buckets (at least one bucket);
// cut are the groups whose later windows were left.
func (s *Stager) batchWindows(ctx context.Context, tx pgx.Tx, groups []unstagedGroup, pairs []mappings.Pair, buckets []int16) ([]batchWindow, []int, error) {
	tenants, features, widths := make([]string, len(groups)), make([]string, len(groups)), make([]time.Duration, len(groups))
	tbuckets := make([]int16, len(groups))
	for i, g := range groups {
		tenants[i], features[i], widths[i] = g.tenant, g.feature, time.Duration(pairs[i].Feature.Window)
		tbuckets[i] = g.bucket
	}
	sql, args := sqlBatchBuckets, pgx.NamedArgs{
		"tenants": tenants, "features": features, "widths": widths, "grace": s.grace(), "origin": gridOrigin,
	}
	if buckets != nil {
		sql, args["tbuckets"], args["buckets"] = sqlBatchBucketsOnShard, tbuckets, buckets
	}
	rows, err := tx.Query(ctx, sql, args)
	if err != nil {
		return nil, nil, fmt.Errorf("listing the windows: %w", err)
	}
	var (
		out    []batchWindow
		cut    []int
		used   int64
		n      int
		bucket time.Time
		count  int64
		closed bool
		last   = -1 // the last group cut
	)
	_, maxRows := s.batchBounds()
	if _, err := pgx.ForEachRow(rows, []any{&n, &bucket, &count, &closed}, func() error {
		i := n - 1
		if i == last {
			return nil
		}
		if closed {
			if used > 0 && used+count > maxRows {
				cut, last = append(cut, i), i
				return nil
			}
			used += count
		}
		for _, w := range windowsOfBucket(bucket, widths[i], anchorOf(pairs[i])) {
			out = append(out, batchWindow{group: i, window: w})
		}
		return nil
	}); err != nil {
		return nil, nil, fmt.Errorf("listing the windows: %w", err)
	}
	return out, cut, nil
}

// sqlBatchRows is sqlWindowRows for many windows: it locks the unstaged
// rows of each closed window and reduces them, one row per window that has
// any, by the window's number.
const sqlBatchRows = `
WITH locked AS (
    SELECT w.n, u.id, u.value, u.occurred_at
    FROM unnest(@tenants::text[], @features::text[], @froms::timestamptz[], @tos::timestamptz[])
         WITH ORDINALITY AS w(tenant, feature, wfrom, wto, n)
    CROSS JOIN LATERAL (
        SELECT id, value, occurred_at FROM usage_events
        WHERE tenant = w.tenant AND feature = w.feature AND item_id IS NULL
          AND occurred_at >= w.wfrom AND occurred_at < w.wto
          AND w.wto + @grace::interval <= statement_timestamp()
        FOR UPDATE SKIP LOCKED
    ) u
)
SELECT n, array_agg(id ORDER BY occurred_at, id), sum(value)::numeric,
       (array_agg(value ORDER BY occurred_at DESC, id DESC))[1], max(occurred_at)
FROM locked GROUP BY n ORDER BY n`

// sqlBatchRowsOnShard is sqlBatchRows for the windows of one shard group's
// groups (@buckets), each with its tenant's bucket.
var sqlBatchRowsOnShard = onShard(sqlBatchRows,
	"@tos::timestamptz[])", "@tos::timestamptz[], @tbuckets::smallint[])",
	"w(tenant, feature, wfrom, wto, n)", "w(tenant, feature, wfrom, wto, tbucket, n)",
	"WHERE tenant = w.tenant", "WHERE bucket = ANY(@buckets::smallint[]) AND bucket = w.tbucket AND tenant = w.tenant")

// lockBatchRows locks and reduces the unstaged rows of the windows and
// returns those that have any, closed (their end plus the grace has passed
// on the database clock).
func (s *Stager) lockBatchRows(ctx context.Context, tx pgx.Tx, groups []unstagedGroup, windows []batchWindow, buckets []int16) ([]batchWindow, error) {
	n := len(windows)
	tenants, features, froms, tos := make([]string, n), make([]string, n), make([]time.Time, n), make([]time.Time, n)
	tbuckets := make([]int16, n)
	for i, w := range windows {
		g := groups[w.group]
		tenants[i], features[i], froms[i], tos[i], tbuckets[i] = g.tenant, g.feature, w.window.From, w.window.To, g.bucket
	}
	sql, args := sqlBatchRows, pgx.NamedArgs{
		"tenants": tenants, "features": features, "froms": froms, "tos": tos, "grace": s.grace(),
	}
	if buckets != nil {
		sql, args["tbuckets"], args["buckets"] = sqlBatchRowsOnShard, tbuckets, buckets
	}
	rows, err := tx.Query(ctx, sql, args)
	if err != nil {
		return nil, fmt.Errorf("locking the windows' rows: %w", err)
	}
	var (
		out []batchWindow
		k   int
		r   windowRows
	)
	if _, err := pgx.ForEachRow(rows, []any{&k, &r.ids, &r.sum, &r.last, &r.ts}, func() error {
		w := windows[k-1]
		w.rows, r = r, windowRows{}
		out = append(out, w)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("locking the windows' rows: %w", err)
	}
	return out, nil
}

// enqueueBatch makes the items of the batch's windows, as enqueueChunks
// does for one — numbered after each window's items so far, a late row of
// a last window absorbed as absorbLate says, a sum split as windowChunks
// does — with one count of the windows' items, one check of the
// timestamps, one insert of the items and one update of the rows.
func (s *Stager) enqueueBatch(ctx context.Context, tx pgx.Tx, target Target, groups []unstagedGroup, pairs []mappings.Pair,
	windows []batchWindow) (res PassResult, err error) {
	tenants, bases := make([]string, len(windows)), make([]string, len(windows))
	for i, w := range windows {
		g := groups[w.group]
		tenants[i], bases[i] = g.tenant, w.window.SubjectRef(g.feature, 0)
	}
	counts, err := s.Outbox.WindowItemCounts(ctx, tx, tenants, bases)
	if err != nil {
		return PassResult{}, err
	}
	var (
		items  []outbox.NewItem
		chunks []chunk
		checks []stampCheck
	)
	for i, w := range windows {
		g, pair := groups[w.group], pairs[w.group]
		if pair.Feature.Aggregation == mappings.Last && counts[i] > 0 {
			// See stageWindow: older late rows join the item that carries
			// the window's latest row. A window without items has none.
			absorbed, err := absorbLate(ctx, tx, s.distributed(), g.tenant, g.feature, w.window, bases[i], w.rows.ids)
			if err != nil {
				return PassResult{}, fmt.Errorf("window %s: %w", bases[i], err)
			}
			if absorbed {
				res.Events += len(w.rows.ids)
				continue
			}
		}
		cs, err := windowChunks(ctx, tx, pair.Feature.Aggregation, target, g.bucket, w.rows)
		if err != nil {
			return PassResult{}, fmt.Errorf("window %s: %w", bases[i], err)
		}
		for k, c := range cs {
			items = append(items, s.item(pair, target, g.tenant, g.feature, outbox.SubjectUsageWindow,
				w.window.SubjectRef(g.feature, counts[i]+k), c.value, c.at, w.window.PeriodStart))
			chunks = append(chunks, c)
			checks = append(checks, target.stampCheckOf(pair, c.at, w.window.PeriodStart))
		}
	}
	if len(items) == 0 {
		return res, nil
	}
	verdicts, err := checkStamps(ctx, tx, target, checks)
	if err != nil {
		return PassResult{}, err
	}
	for k := range items {
		verdicts[k].apply(target, &items[k])
	}
	enq, err := s.Outbox.EnqueueBatch(ctx, tx, items)
	if err != nil {
		return PassResult{}, err
	}
	var marks []rowMark
	for k, c := range chunks {
		if !enq[k].Inserted {
			return PassResult{}, fmt.Errorf("window %s: the item exists already (item %d); not marking rows with it", items[k].SubjectRef, enq[k].ID)
		}
		for _, id := range c.ids {
			marks = append(marks, rowMark{id, enq[k].ID})
		}
		res.Items++
		res.Events += len(c.ids)
		if items[k].Quarantine != "" {
			res.Quarantined++
		}
	}
	from, to := windows[0].window.From, windows[0].window.To
	var bs []int16
	for _, w := range windows {
		from, to = minTime(from, w.window.From), maxTime(to, w.window.To)
		if b := groups[w.group].bucket; !slices.Contains(bs, b) {
			bs = append(bs, b)
		}
	}
	if err := markBatchRows(ctx, tx, marks, bs, windowSpan{from, to, s.grace()}); err != nil {
		return PassResult{}, err
	}
	return res, nil
}

// rowMark is a ledger row and the item that carries it.
type rowMark struct{ row, item int64 }

// markBatchRows is markRows for a batch: the rows in the order of their ids
// (the order of the ledger's pages and of its primary key), of the
// batch's tenants' buckets, bounded by the batch's time span, which a
// ledger partitioned by time prunes by.
func markBatchRows(ctx context.Context, tx pgx.Tx, marks []rowMark, buckets []int16, span windowSpan) error {
	slices.SortFunc(marks, func(a, b rowMark) int { return cmp.Compare(a.row, b.row) })
	rows, items := make([]int64, len(marks)), make([]int64, len(marks))
	for i, m := range marks {
		rows[i], items[i] = m.row, m.item
	}
	return markWindowRows(ctx, tx, rows, items, buckets, span)
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
