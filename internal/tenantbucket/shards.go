package tenantbucket

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// Shards is how the buckets are placed: the groups of buckets whose rows
// live together, one per shard group of a distributed database. A
// statement that reads or writes many tenants' rows runs once per group,
// each run naming its group's buckets, and is then one shard's statement.
// On one server every bucket is in one group, and that group names none:
// its statements carry no bucket list.
type Shards struct {
	groups [][]int16 // nil: one group, every bucket, no list
	of     [Count]int16
}

// OneServer is the placement of one server: one group of every bucket.
func OneServer() *Shards { return &Shards{} }

// Distributed reports whether the buckets are spread over shards, so that
// a statement must name a group's buckets to stay one shard's.
func (s *Shards) Distributed() bool { return s.groups != nil }

// Groups is the number of groups: 1 on one server.
func (s *Shards) Groups() int {
	if s.groups == nil {
		return 1
	}
	return len(s.groups)
}

// Buckets is group g's buckets, in order; nil on one server, where a
// statement names no list.
func (s *Shards) Buckets(g int) []int16 {
	if s.groups == nil {
		return nil
	}
	return s.groups[g]
}

// GroupOf is the group that holds bucket b.
func (s *Shards) GroupOf(b int16) int {
	if s.groups == nil {
		return 0
	}
	return int(s.of[b])
}

// Split cuts items into runs of one group each, keeping their order within
// a group; bucket names each item's bucket. The runs come in the order of
// their groups' first items.
func Split[T any](s *Shards, items []T, bucket func(T) int16) [][]T {
	if s.groups == nil || len(items) == 0 {
		return [][]T{items}
	}
	var out [][]T
	index := map[int]int{}
	for _, it := range items {
		g := s.GroupOf(bucket(it))
		i, ok := index[g]
		if !ok {
			i = len(out)
			index[g] = i
			out = append(out, nil)
		}
		out[i] = append(out[i], it)
	}
	return out
}

// ReadShards reads the placement of the buckets from the database: on
// PostgreSQL, or on a Citus coordinator whose outbox_item_states is not
// distributed, one server's; on a distributed database, the shard of each
// bucket (every table that holds a tenant is co-located with
// outbox_item_states). Read it again after a statement naming a group is
// refused as spanning shards: a split changes the groups; a move does not.
func ReadShards(ctx context.Context, q pgdb.Querier) (*Shards, error) {
	var distributed bool
	err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')`).Scan(&distributed)
	if err != nil {
		return nil, fmt.Errorf("tenantbucket: reading the engine: %w", err)
	}
	if distributed {
		err = q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_dist_partition
			WHERE logicalrelid = 'outbox_item_states'::regclass AND partmethod = 'h')`).Scan(&distributed)
		if err != nil {
			return nil, fmt.Errorf("tenantbucket: reading the placement: %w", err)
		}
	}
	if !distributed {
		return OneServer(), nil
	}
	rows, err := q.Query(ctx, `SELECT array_agg(b::smallint ORDER BY b)
		FROM generate_series(0, $1 - 1) b
		GROUP BY get_shard_id_for_distribution_column('outbox_item_states', b::smallint)
		ORDER BY min(b)`, Count)
	if err != nil {
		return nil, fmt.Errorf("tenantbucket: reading the shards: %w", err)
	}
	defer rows.Close()
	s := &Shards{groups: [][]int16{}}
	for rows.Next() {
		var g []int16
		if err := rows.Scan(&g); err != nil {
			return nil, fmt.Errorf("tenantbucket: reading the shards: %w", err)
		}
		for _, b := range g {
			s.of[b] = int16(len(s.groups))
		}
		s.groups = append(s.groups, g)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("tenantbucket: reading the shards: %w", err)
	}
	if n := countBuckets(s.groups); n != Count {
		return nil, fmt.Errorf("tenantbucket: the shards hold %d buckets, not %d", n, Count)
	}
	return s, nil
}

func countBuckets(groups [][]int16) int {
	seen := map[int16]bool{}
	for _, g := range groups {
		for _, b := range g {
			seen[b] = true
		}
	}
	return len(seen)
}

// String names the placement, for logs.
func (s *Shards) String() string {
	if s.groups == nil {
		return "one server"
	}
	sizes := make([]int, len(s.groups))
	for i, g := range s.groups {
		sizes[i] = len(g)
	}
	return fmt.Sprintf("%d shard groups of %d to %d buckets", len(s.groups), slices.Min(sizes), slices.Max(sizes))
}

// Placement keeps the Shards a process read: read from the database on
// first use and kept until Forget. It is safe for concurrent use; the zero
// value is ready.
type Placement struct{ shards atomic.Pointer[Shards] }

// Get returns the placement, reading it with q the first time.
func (p *Placement) Get(ctx context.Context, q pgdb.Querier) (*Shards, error) {
	if sh := p.shards.Load(); sh != nil {
		return sh, nil
	}
	sh, err := ReadShards(ctx, q)
	if err != nil {
		return nil, err
	}
	p.shards.Store(sh)
	return sh, nil
}

// Last is the placement read last; nil before the first read or after
// Forget.
func (p *Placement) Last() *Shards { return p.shards.Load() }

// Forget makes the next Get read the placement again: after a statement
// naming one group's buckets was refused as spanning shards (a split), or
// after the tables were distributed.
func (p *Placement) Forget() { p.shards.Store(nil) }

// ReadAcross runs sql, a read of many shards that returns buckets, and
// returns them. It runs in a transaction of its own that lets Citus use
// one connection per worker for it, the one the session keeps: by
// default a read of many shards opens more whenever its tasks are slow,
// and a loaded cluster then spends its time starting backends. On one
// server the setting is unknown and unread.
func ReadAcross(ctx context.Context, db pgdb.Beginner, sql string, args ...any) ([]int16, error) {
	var out []int16
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL citus.max_adaptive_executor_pool_size = 1"); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, sql, args...)
		if err != nil {
			return err
		}
		out, err = pgx.CollectRows(rows, pgx.RowTo[int16])
		return err
	})
	return out, err
}
