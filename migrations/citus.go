package migrations

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/pgsession"
)

// DistributedShards is how many shards Distribute gives the distributed
// tables' co-location group: 32 buckets of 1,024 each. A shard splits
// badly on Citus 13.2 (docs/scale.md), so a cluster grows by moving
// shards: the count is the most workers foreseen.
const DistributedShards = 32

// colocationAnchor is the distributed table the others are co-located
// with: the one every foreign key between them points at.
const colocationAnchor = "outbox_item_bodies"

// anchorTrigger moves a tenant's unstaged counters when its period anchor
// moves. A reference table's trigger fires on every node's copy and may
// not write a distributed table from there, so it goes on Citus.
const anchorTrigger = "tenant_mappings_completeness"

// DistributedDefaults are the settings Distribute makes the database's
// defaults on Citus. The distributed tables' triggers need the first, and
// so does a later migration or month's partition that adds one. The
// second keeps a statement to one connection per worker, the one a
// session keeps: by default a statement over many shards of a worker opens
// more whenever its tasks are slow and closes them at the end of its
// transaction, and a loaded cluster then spends its time starting backends
// (docs/scale.md). An operator's own value of the second is left alone.
var DistributedDefaults = []pgsession.Setting{
	{Name: "citus.enable_unsafe_triggers", Value: "on"},
	{Name: "citus.max_adaptive_executor_pool_size", Value: "1"},
}

// ErrCannotDistribute is wrapped by Distribute's refusals: the database is
// not ready to be distributed, and the error says what it lacks. Nothing
// was changed.
var ErrCannotDistribute = errors.New("migrate: cannot distribute")

// DistributeResult says what one Distribute did. A second call on the same
// database does nothing: every list empty.
type DistributeResult struct {
	// Engine is what Distribute found before changing anything.
	Engine Engine
	// Reference are the tables it made reference tables, in order.
	Reference []string
	// Distributed are the tables it distributed by bucket, in order.
	Distributed []string
	// Emptied are the distributed tables whose leftover copy of the rows
	// on the coordinator it removed.
	Emptied []string
	// AnchorDropped says it dropped the tenant mappings' anchor trigger.
	AnchorDropped bool
	// TriggersAllowed says it made citus.enable_unsafe_triggers the
	// database's default.
	TriggersAllowed bool
	// PoolCapped says it made one connection per worker the database's
	// default for a statement (citus.max_adaptive_executor_pool_size).
	PoolCapped bool
	// CustomPlans are the functions it made plan each call.
	CustomPlans []string
}

// Changed reports whether Distribute changed anything.
func (r DistributeResult) Changed() bool {
	return len(r.Reference) > 0 || len(r.Distributed) > 0 || len(r.Emptied) > 0 || r.AnchorDropped || r.TriggersAllowed ||
		r.PoolCapped || len(r.CustomPlans) > 0
}

// String says what Distribute did in one line.
func (r DistributeResult) String() string {
	switch {
	case r.Engine.Citus == "":
		return r.Engine.String() + ": nothing to distribute"
	case !r.Changed():
		return r.Engine.String() + ": every table is already where it must be"
	}
	var parts []string
	if len(r.Reference) > 0 {
		parts = append(parts, fmt.Sprintf("%d reference tables", len(r.Reference)))
	}
	if len(r.Distributed) > 0 {
		parts = append(parts, fmt.Sprintf("%d tables distributed by bucket in %d shards", len(r.Distributed), DistributedShards))
	}
	if len(r.Emptied) > 0 {
		parts = append(parts, fmt.Sprintf("the coordinator's copy of %d removed", len(r.Emptied)))
	}
	if r.AnchorDropped {
		parts = append(parts, "the mappings' anchor trigger dropped")
	}
	if len(r.CustomPlans) > 0 {
		parts = append(parts, fmt.Sprintf("%d functions planned per call", len(r.CustomPlans)))
	}
	if r.PoolCapped {
		parts = append(parts, "one connection per worker for a statement by default")
	}
	if len(parts) == 0 {
		parts = append(parts, "triggers allowed on distributed tables")
	}
	return r.Engine.String() + ": " + strings.Join(parts, "; ")
}

// Distribute places Tally's tables on the Citus coordinator behind pool as
// Placements says, in place, with their rows: the mappings become
// reference tables, the ledger's and the outbox's tables are distributed
// by the tenant's bucket in one co-location group of DistributedShards
// shards, every other table stays on the coordinator. It runs as the
// tables' owner, after Apply, under the migrations' advisory lock, in two
// transactions: the placement (which blocks writes to every table it
// copies until it commits), then the removal of the coordinator's leftover
// copy of the rows. Tables already placed are skipped, so a second call
// does nothing. On plain PostgreSQL it does nothing and its result says
// so. It refuses, wrapping ErrCannotDistribute and changing nothing, a
// cluster without an active worker (or with an inactive one), a schema
// without the bucket columns and a table placed otherwise by hand. Nodes
// that were running keep sessions without the settings it makes the
// database's defaults: restart them. A nil logger discards its
// progress lines.
func Distribute(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) (DistributeResult, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	var res DistributeResult

	lock, err := pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("migrate: opening the lock's transaction: %w", err)
	}
	defer func() { _ = lock.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := lock.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey); err != nil {
		return res, fmt.Errorf("migrate: taking the migration lock: %w", err)
	}

	if res.Engine, err = ReadEngine(ctx, pool); err != nil {
		return res, err
	}
	if res.Engine.Citus == "" {
		logger.Info("plain PostgreSQL: nothing to distribute")
		return res, nil
	}
	p, err := planDistribution(ctx, pool, res.Engine)
	if err != nil {
		return res, err
	}
	if p.placing() {
		if err := p.place(ctx, pool, logger); err != nil {
			return res, err
		}
		res.Reference, res.Distributed = p.reference, p.distributed
		res.AnchorDropped = p.anchor
		for _, d := range p.defaults {
			res.TriggersAllowed = res.TriggersAllowed || d == DistributedDefaults[0]
			res.PoolCapped = res.PoolCapped || d == DistributedDefaults[1]
		}
	}
	if res.Emptied, err = removeLocalCopies(ctx, pool, logger); err != nil {
		return res, err
	}
	if res.CustomPlans, err = planEachCall(ctx, pool); err != nil {
		return res, err
	}
	return res, nil
}

// planEachCall makes the functions that keep a generic plan on one server
// (the completeness counters') plan each call: inside a function Citus
// refuses a generic plan whose parameters route a statement on a
// distributed table. It returns the functions it changed; a function a
// later migration writes again with a generic plan is changed by the next
// run.
func planEachCall(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	rows, err := pool.Query(ctx, `SELECT p.oid::regprocedure::text FROM pg_proc p
		WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
		  AND 'plan_cache_mode=force_generic_plan' = ANY (p.proconfig)
		ORDER BY 1`)
	if err != nil {
		return nil, fmt.Errorf("migrate: reading the functions' plan settings: %w", err)
	}
	funcs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("migrate: reading the functions' plan settings: %w", err)
	}
	for _, f := range funcs {
		if _, err := pool.Exec(ctx, "ALTER FUNCTION "+f+" SET plan_cache_mode = force_custom_plan"); err != nil {
			return nil, fmt.Errorf("migrate: planning %s per call: %w", f, err)
		}
	}
	return funcs, nil
}

// distribution is what Distribute has left to do on a cluster.
type distribution struct {
	// reference and distributed are the tables to place, in the order
	// they must be placed: a table after those its foreign keys point at.
	reference, distributed []string
	// anchor: the anchor trigger is still there.
	anchor bool
	// defaults are the DistributedDefaults the database lacks.
	defaults []pgsession.Setting
}

func (p distribution) placing() bool {
	return len(p.reference) > 0 || len(p.distributed) > 0 || p.anchor || len(p.defaults) > 0
}

// planDistribution reads what is left to do, and refuses a cluster or a
// schema that cannot be distributed.
func planDistribution(ctx context.Context, pool *pgxpool.Pool, e Engine) (distribution, error) {
	var p distribution
	active := 0
	for _, n := range e.Workers() {
		if n.Active {
			active++
		}
	}
	if active == 0 {
		return p, fmt.Errorf("%w: no active worker is registered on the coordinator; add the workers first (SELECT citus_add_node(host, port))", ErrCannotDistribute)
	}
	if active < len(e.Workers()) {
		return p, fmt.Errorf("%w: a worker is inactive; activate it first (SELECT citus_activate_node(host, port)) or remove it", ErrCannotDistribute)
	}

	var missing, wrong, want []string
	for _, t := range e.Tables {
		switch {
		case t.Have == "":
			missing = append(missing, t.Name)
		case t.Have == t.Want:
		case t.Have != Local:
			wrong = append(wrong, fmt.Sprintf("%s is %s, must be %s", t.Name, t.Have, t.Want))
		case t.Want == Reference:
			p.reference = append(p.reference, t.Name)
		case t.Want == Distributed:
			p.distributed = append(p.distributed, t.Name)
		}
		if t.Want == Distributed {
			want = append(want, t.Name)
		}
	}
	if len(missing) > 0 {
		return p, fmt.Errorf("%w: tables missing: %s; is this Tally's database, migrated?", ErrCannotDistribute, strings.Join(missing, ", "))
	}
	if len(wrong) > 0 {
		return p, fmt.Errorf("%w: %s; Distribute does not move a table between placements: undistribute_table it first", ErrCannotDistribute, strings.Join(wrong, "; "))
	}
	unbucketed, err := queryNames(ctx, pool, `SELECT n FROM unnest($1::text[]) AS n
		WHERE NOT EXISTS (SELECT 1 FROM pg_attribute a
			WHERE a.attrelid = to_regclass(quote_ident(n)) AND a.attname = 'bucket' AND NOT a.attisdropped)
		ORDER BY n`, want)
	if err != nil {
		return p, fmt.Errorf("migrate: reading the bucket columns: %w", err)
	}
	if len(unbucketed) > 0 {
		return p, fmt.Errorf("%w: no bucket column in %s: the schema predates the tenant bucket (migration 48); run tally migrate with a binary that has it", ErrCannotDistribute, strings.Join(unbucketed, ", "))
	}
	// A table already distributed must be by the bucket, with the anchor.
	astray, err := queryNames(ctx, pool, `SELECT c.relname FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid
		WHERE c.relname = ANY($1) AND c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
		  AND (column_to_column_name(p.logicalrelid, p.partkey) <> 'bucket'
		       OR p.colocationid <> coalesce((SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = to_regclass(quote_ident($2))), p.colocationid))
		ORDER BY 1`, want, colocationAnchor)
	if err != nil {
		return p, fmt.Errorf("migrate: reading the distributed tables: %w", err)
	}
	if len(astray) > 0 {
		return p, fmt.Errorf("%w: %s distributed, but not by bucket with %s; undistribute_table it first", ErrCannotDistribute, strings.Join(astray, ", "), colocationAnchor)
	}

	if p.reference, err = foreignKeyOrder(ctx, pool, p.reference, ""); err != nil {
		return p, err
	}
	if p.distributed, err = foreignKeyOrder(ctx, pool, p.distributed, colocationAnchor); err != nil {
		return p, err
	}
	if i := slices.Index(p.distributed, colocationAnchor); i > 0 {
		return p, fmt.Errorf("migrate: %s, which the distributed tables are co-located with, has a foreign key to another of them", colocationAnchor)
	}
	var config []string
	err = pool.QueryRow(ctx, `SELECT
			EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = $1 AND tgrelid = to_regclass('tenant_mappings')),
			coalesce((SELECT s.setconfig FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase
				WHERE d.datname = current_database() AND s.setrole = 0), '{}')`, anchorTrigger).Scan(&p.anchor, &config)
	if err != nil {
		return p, fmt.Errorf("migrate: reading the database's settings: %w", err)
	}
	triggers, pool1 := DistributedDefaults[0], DistributedDefaults[1]
	if !slices.Contains(config, triggers.Name+"="+triggers.Value) {
		p.defaults = append(p.defaults, triggers)
	}
	if !slices.ContainsFunc(config, func(c string) bool { return strings.HasPrefix(c, pool1.Name+"=") }) {
		p.defaults = append(p.defaults, pool1)
	}
	return p, nil
}

// foreignKeyOrder orders tables so that each follows the tables of the list
// its foreign keys point at, first first and then by name where the keys
// leave a choice.
func foreignKeyOrder(ctx context.Context, pool *pgxpool.Pool, tables []string, first string) ([]string, error) {
	rows, err := pool.Query(ctx, `SELECT DISTINCT r.relname, f.relname
		FROM pg_constraint k JOIN pg_class r ON r.oid = k.conrelid JOIN pg_class f ON f.oid = k.confrelid
		WHERE k.contype = 'f' AND k.conrelid <> k.confrelid AND r.relname = ANY($1) AND f.relname = ANY($1)
		  AND r.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
		  AND f.relnamespace = r.relnamespace`, tables)
	if err != nil {
		return nil, fmt.Errorf("migrate: reading the foreign keys: %w", err)
	}
	after := map[string][]string{} // a referenced table: the tables that reference it
	waits := map[string]int{}      // a table: how many tables it references are not placed yet
	var from, to string
	_, err = pgx.ForEachRow(rows, []any{&from, &to}, func() error {
		after[to] = append(after[to], from)
		waits[from]++
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("migrate: reading the foreign keys: %w", err)
	}
	order := make([]string, 0, len(tables))
	var ready []string
	for _, t := range tables {
		if waits[t] == 0 {
			ready = append(ready, t)
		}
	}
	for len(ready) > 0 {
		slices.SortFunc(ready, func(a, b string) int {
			switch {
			case a == b:
				return 0
			case a == first:
				return -1
			case b == first:
				return 1
			}
			return strings.Compare(a, b)
		})
		next := ready[0]
		ready = ready[1:]
		order = append(order, next)
		for _, t := range after[next] {
			if waits[t]--; waits[t] == 0 {
				ready = append(ready, t)
			}
		}
	}
	if len(order) < len(tables) {
		return nil, fmt.Errorf("migrate: the foreign keys between %s form a cycle", strings.Join(tables, ", "))
	}
	return order, nil
}

// place runs the placement in one transaction: the triggers allowed, the
// anchor trigger dropped, the reference tables, then the distributed ones,
// each with its user triggers off for the copy.
func (p distribution) place(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// Distributing a table with triggers needs the setting, and so
		// does creating one on it later (a new month's partition gets its
		// no-truncate trigger): the database's default keeps later
		// migrations and the months' creation working.
		if _, err := tx.Exec(ctx, "SET LOCAL citus.enable_unsafe_triggers = on"); err != nil {
			return fmt.Errorf("migrate: allowing triggers on distributed tables: %w", err)
		}
		var db string
		if err := tx.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
			return fmt.Errorf("migrate: reading the database's name: %w", err)
		}
		for _, d := range p.defaults {
			if _, err := tx.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{db}.Sanitize()+" SET "+d.Name+" = "+d.Value); err != nil {
				return fmt.Errorf("migrate: making %s=%s the database's default: %w", d.Name, d.Value, err)
			}
		}
		if p.anchor {
			if _, err := tx.Exec(ctx, "DROP TRIGGER "+anchorTrigger+" ON tenant_mappings"); err != nil {
				return fmt.Errorf("migrate: dropping the mappings' anchor trigger: %w", err)
			}
		}
		for _, t := range p.reference {
			logger.Info("making a reference table", "table", t)
			if err := withoutTriggers(ctx, tx, t, "SELECT create_reference_table("+literal(t)+")"); err != nil {
				return err
			}
		}
		for _, t := range p.distributed {
			logger.Info("distributing a table", "table", t, "column", "bucket", "shards", DistributedShards)
			colocate := fmt.Sprintf("colocate_with => %s", literal(colocationAnchor))
			if t == colocationAnchor {
				colocate = fmt.Sprintf("colocate_with => 'none', shard_count => %d", DistributedShards)
			}
			if err := withoutTriggers(ctx, tx, t, "SELECT create_distributed_table("+literal(t)+", 'bucket', "+colocate+")"); err != nil {
				return err
			}
		}
		return nil
	})
}

// withoutTriggers runs sql, which copies table's rows into Citus, with the
// user triggers of table and of its partitions off: the copy fires them on
// every new shard or placement, where the completeness counters would count
// every row again. They are on again, on the tables and their shards,
// before it returns.
func withoutTriggers(ctx context.Context, tx pgx.Tx, table, sql string) error {
	// pg_partition_tree has no row for a table that is not partitioned.
	rows, err := tx.Query(ctx, "SELECT relid::text FROM pg_partition_tree($1::regclass) WHERE level > 0 ORDER BY level, 1", table)
	if err != nil {
		return fmt.Errorf("migrate: reading %s's partitions: %w", table, err)
	}
	partitions, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("migrate: reading %s's partitions: %w", table, err)
	}
	tree := append([]string{pgx.Identifier{table}.Sanitize()}, partitions...)
	for _, rel := range tree {
		if _, err := tx.Exec(ctx, "ALTER TABLE "+rel+" DISABLE TRIGGER USER"); err != nil {
			return fmt.Errorf("migrate: disabling %s's triggers for its copy: %w", rel, err)
		}
	}
	if _, err := tx.Exec(ctx, sql); err != nil {
		return fmt.Errorf("migrate: placing %s: %w", table, err)
	}
	for _, rel := range tree {
		if _, err := tx.Exec(ctx, "ALTER TABLE "+rel+" ENABLE TRIGGER USER"); err != nil {
			return fmt.Errorf("migrate: enabling %s's triggers after its copy: %w", rel, err)
		}
	}
	return nil
}

// removeLocalCopies removes the copy of the rows create_distributed_table
// leaves on the coordinator, of every distributed table that still has
// one, in one transaction, and returns those tables. Tally's no-truncate
// triggers refuse it: they are off for that transaction only, on the
// coordinator's tables only (the shards are not touched), and on again
// before it commits.
func removeLocalCopies(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) ([]string, error) {
	var want []string
	for name, pl := range Placements {
		if pl == Distributed {
			want = append(want, name)
		}
	}
	// A leaf of a table's partition tree with pages on disk holds the copy.
	full, err := queryNames(ctx, pool, `SELECT c.relname FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid
		WHERE p.partmethod = 'h' AND c.relname = ANY($1)
		  AND c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
		  AND (pg_relation_size(c.oid) > 0
		       OR EXISTS (SELECT 1 FROM pg_partition_tree(c.oid) t WHERE t.isleaf AND pg_relation_size(t.relid) > 0))
		ORDER BY 1`, want)
	if err != nil {
		return nil, fmt.Errorf("migrate: reading the coordinator's copies: %w", err)
	}
	if len(full) == 0 {
		return nil, nil
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// Off, DDL changes the coordinator's tables and not their shards;
		// the truncation cascades along the foreign keys, so the triggers
		// of every distributed table and partition go off.
		for _, set := range []string{"SET LOCAL citus.enable_ddl_propagation = off", "SET LOCAL citus.enable_unsafe_triggers = on"} {
			if _, err := tx.Exec(ctx, set); err != nil {
				return fmt.Errorf("migrate: %s: %w", set, err)
			}
		}
		rows, err := tx.Query(ctx, `SELECT t.tgrelid::regclass::text, t.tgname
			FROM pg_trigger t JOIN pg_dist_partition p ON p.logicalrelid = t.tgrelid
			WHERE p.partmethod = 'h' AND NOT t.tgisinternal AND t.tgname ~ '_no_truncate$' AND t.tgenabled <> 'D'
			ORDER BY 1, 2`)
		if err != nil {
			return fmt.Errorf("migrate: reading the no-truncate triggers: %w", err)
		}
		var triggers [][2]string // table, trigger
		var rel, name string
		_, err = pgx.ForEachRow(rows, []any{&rel, &name}, func() error {
			triggers = append(triggers, [2]string{rel, name})
			return nil
		})
		if err != nil {
			return fmt.Errorf("migrate: reading the no-truncate triggers: %w", err)
		}
		alter := func(verb string) error {
			for _, t := range triggers {
				if _, err := tx.Exec(ctx, "ALTER TABLE "+t[0]+" "+verb+" TRIGGER "+pgx.Identifier{t[1]}.Sanitize()); err != nil {
					return fmt.Errorf("migrate: %s trigger %s of %s: %w", verb, t[1], t[0], err)
				}
			}
			return nil
		}
		if err := alter("DISABLE"); err != nil {
			return err
		}
		for _, t := range full {
			logger.Info("removing the coordinator's copy of a distributed table", "table", t)
			if _, err := tx.Exec(ctx, "SELECT truncate_local_data_after_distributing_table($1::regclass)", t); err != nil {
				return fmt.Errorf("migrate: removing the coordinator's copy of %s: %w", t, err)
			}
		}
		return alter("ENABLE")
	})
	if err != nil {
		return nil, err
	}
	return full, nil
}

// queryNames runs sql and returns its one text column.
func queryNames(ctx context.Context, pool *pgxpool.Pool, sql string, args ...any) ([]string, error) {
	rows, err := pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// literal quotes s as an SQL string literal.
func literal(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
