package meter

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

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
	// CancelMargin is how long before Stripe's 24 hours a count event's
	// cancellation is refused as too late (Cancel); 0 means
	// DefaultCancelMargin.
	CancelMargin time.Duration

	// batchGroups and batchRows, when positive, bound a batch instead of
	// stageBatchGroups and stageBatchRows (tests).
	batchGroups int
	batchRows   int64

	// shards is the buckets' placement, read on a pass's first use and
	// kept until a pass on a distributed database fails (shardsOf).
	shards tenantbucket.Placement
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

// Pass stages everything that is due, for every tenant: PassPart of the
// whole hash range.
func (s *Stager) Pass(ctx context.Context, db pgdb.DB) (PassResult, error) {
	return s.PassPart(ctx, db, Part{})
}

// PassPart stages everything that is due for the tenants of part: every
// closed window of windowed features, every event of per-event features,
// and, once their default window has closed, the events of unmapped
// features (quarantined as feature_unmapped, one item each, so that any
// later mapping can re-address them one to one). Windows are staged in
// batches, many tenants and features to a transaction (stageBatch); a
// batch that fails is staged again one window a transaction, so that the
// error of one tenant and feature does not stop the others; errors are
// joined in the result.
func (s *Stager) PassPart(ctx context.Context, db pgdb.DB, part Part) (PassResult, error) {
	return s.pass(ctx, db, part, true)
}

// pass lists part's unstaged usage and stages it, in batches or (batched
// false) one window a transaction. On a distributed database one read of
// the shards of the groups the part owns lists their unstaged usage, and
// the groups that hold some are staged one after the other, every
// statement of a group naming its buckets; on one server, the part's hash
// range.
func (s *Stager) pass(ctx context.Context, db pgdb.DB, part Part, batched bool) (PassResult, error) {
	target, ok := s.Target(ctx)
	if !ok {
		return PassResult{Stalled: true}, nil
	}
	if err := target.validate(); err != nil {
		return PassResult{}, err
	}
	shards, err := s.shardsOf(ctx, db)
	if err != nil {
		return PassResult{}, err
	}
	var (
		total PassResult
		errs  []error
	)
	if !shards.Distributed() {
		groups, err := listUnstaged(ctx, db, part, nil)
		if err != nil {
			return PassResult{}, err
		}
		total, err = s.passShard(ctx, db, target, groups, nil, batched)
		if err != nil {
			errs = append(errs, err)
		}
	} else {
		// One read of the part's shards lists what is unstaged; only the
		// groups that hold some are staged, each by statements of its own.
		var owned []int16
		for g := range shards.Groups() {
			if part.owns(g) {
				owned = append(owned, shards.Buckets(g)...)
			}
		}
		listed, listErr := listUnstaged(ctx, db, part, owned)
		byGroup := map[int][]unstagedGroup{}
		for _, u := range listed {
			g := shards.GroupOf(u.bucket)
			byGroup[g] = append(byGroup[g], u)
		}
		for g := range shards.Groups() {
			if ctx.Err() != nil {
				break
			}
			groups := byGroup[g]
			if listErr != nil && part.owns(g) {
				// A worker is down: each group is listed on its own,
				// and those of the workers that answer are staged.
				var err error
				if groups, err = listUnstaged(ctx, db, part, shards.Buckets(g)); err != nil {
					errs = append(errs, err)
					continue
				}
			}
			if len(groups) == 0 {
				continue
			}
			res, err := s.passShard(ctx, db, target, groups, shards.Buckets(g), batched)
			total.add(res)
			if err != nil {
				errs = append(errs, err)
			}
		}
	}
	if len(errs) > 0 && shards.Distributed() {
		// A statement naming a group may have been refused as spanning
		// shards (a split): the next pass reads the placement again.
		s.shards.Forget()
	}
	if err := ctx.Err(); err != nil && len(errs) == 0 {
		errs = append(errs, err) // cut short: what was left waits for the next pass
	}
	return total, errors.Join(errs...)
}

// passShard stages the unstaged usage listed in groups, of tenants whose
// buckets are buckets (one shard group's; nil on one server: every
// bucket).
func (s *Stager) passShard(ctx context.Context, db pgdb.DB, target Target, groups []unstagedGroup, buckets []int16, batched bool) (PassResult, error) {
	var (
		total PassResult
		errs  []error
	)
	if batched {
		groups, total = s.stageBatches(ctx, db, target, groups, buckets)
	}
	for _, g := range groups {
		if ctx.Err() != nil {
			break
		}
		res, err := s.stageGroup(ctx, db, target, g.tenant, g.feature)
		total.add(res)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s/%s: %w", g.tenant, g.feature, err))
		}
	}
	return total, errors.Join(errs...)
}

// distributed reports whether the placement read last is a distributed
// database's.
func (s *Stager) distributed() bool {
	sh := s.shards.Last()
	return sh != nil && sh.Distributed()
}

// shardsOf is the placement of the buckets, read once and kept.
func (s *Stager) shardsOf(ctx context.Context, db pgdb.DB) (*tenantbucket.Shards, error) {
	sh, err := s.shards.Get(ctx, db)
	if err != nil {
		return nil, fmt.Errorf("meter: %w", err)
	}
	return sh, nil
}

// sqlGroupBuckets lists the grid buckets of a tenant's feature that hold
// unstaged rows.
const sqlGroupBuckets = `
SELECT DISTINCT date_bin(@width::interval, occurred_at, @origin::timestamptz)
FROM usage_events WHERE bucket = @bucket AND tenant = @tenant AND feature = @feature AND item_id IS NULL ORDER BY 1`

func (s *Stager) stageGroup(ctx context.Context, db pgdb.DB, target Target, tenant, feature string) (PassResult, error) {
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
	rows, err := db.Query(ctx, sqlGroupBuckets,
		pgx.NamedArgs{"width": width, "origin": gridOrigin, "tenant": tenant, "feature": feature, "bucket": tenantbucket.Of(tenant)})
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

// sqlTenantUnstaged lists the features of a tenant that hold unstaged
// rows: a range of the unstaged rows' partial index, in the tenant's shard.
const sqlTenantUnstaged = `
SELECT DISTINCT feature FROM usage_events WHERE bucket = @bucket AND tenant = @tenant AND item_id IS NULL ORDER BY 1`

// CloseTenant stages every unstaged row of a tenant whose window has
// ended, without waiting for the window grace: its billing period's
// invoice is being made, and what the period holds must reach Stripe now.
// A row that comes later, in the grace, is a supplement of its window.
func (s *Stager) CloseTenant(ctx context.Context, db pgdb.DB, tenant string) (PassResult, error) {
	target, ok := s.Target(ctx)
	if !ok {
		return PassResult{Stalled: true}, nil
	}
	if err := target.validate(); err != nil {
		return PassResult{}, err
	}
	rows, err := db.Query(ctx, sqlTenantUnstaged, pgx.NamedArgs{"tenant": tenant, "bucket": tenantbucket.Of(tenant)})
	if err != nil {
		return PassResult{}, fmt.Errorf("meter: listing %s's unstaged usage: %w", tenant, err)
	}
	features, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return PassResult{}, fmt.Errorf("meter: listing %s's unstaged usage: %w", tenant, err)
	}
	now := &Stager{Outbox: s.Outbox, Grace: time.Nanosecond, Target: s.Target, CancelMargin: s.CancelMargin}
	if _, err := now.shardsOf(ctx, db); err != nil {
		return PassResult{}, err
	}
	var (
		total PassResult
		errs  []error
	)
	for _, f := range features {
		res, err := now.stageGroup(ctx, db, target, tenant, f)
		total.add(res)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s/%s: %w", tenant, f, err))
		}
	}
	return total, errors.Join(errs...)
}
