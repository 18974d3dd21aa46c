package migrations

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// RuntimeRole is the role without login that migration 36 creates for the
// nodes: it reads and writes every table, never deletes a ledger, outbox
// or audit row, and owns nothing, so it cannot truncate, detach or drop
// (docs/security.md).
const RuntimeRole = "tally_runtime"

// PrivilegesEnforced reports whether the role pool connects as is held to
// the runtime role's privileges: it neither owns the ledger (nor is a
// member of its owner, as a superuser is) nor may delete from it.
func PrivilegesEnforced(ctx context.Context, pool *pgxpool.Pool) (bool, error) {
	var enforced bool
	err := pool.QueryRow(ctx, `SELECT NOT pg_has_role(current_user, c.relowner, 'USAGE')
			AND NOT has_table_privilege(c.oid, 'DELETE') AND NOT has_table_privilege(c.oid, 'TRUNCATE')
		FROM pg_class c WHERE c.oid = 'usage_events'::regclass`).Scan(&enforced)
	if err != nil {
		return false, fmt.Errorf("migrate: reading the ledger's privileges: %w", err)
	}
	return enforced, nil
}

// GrantRuntime makes role, a login role the nodes connect as, a member of
// RuntimeRole. It runs as the owner (who migrated).
func GrantRuntime(ctx context.Context, pool *pgxpool.Pool, role string) error {
	if _, err := pool.Exec(ctx, "GRANT "+RuntimeRole+" TO "+pgx.Identifier{role}.Sanitize()); err != nil {
		return fmt.Errorf("migrate: granting %s to %s: %w", RuntimeRole, role, err)
	}
	return nil
}

// Ownership is who owns the tables of the schema Tally migrated.
type Ownership struct {
	// Owners are the roles owning them, by name: one when every migration
	// ran as the owner.
	Owners []string
	// Superuser says one of them is a superuser, which a managed Postgres
	// gives no one.
	Superuser bool
}

// TableOwners reads who owns the tables of the current schema (Tally's,
// River's and goose's): any role may.
func TableOwners(ctx context.Context, pool *pgxpool.Pool) (Ownership, error) {
	var o Ownership
	err := pool.QueryRow(ctx, `SELECT coalesce(array_agg(DISTINCT r.rolname ORDER BY r.rolname), '{}'), coalesce(bool_or(r.rolsuper), false)
		FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
		WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) AND c.relkind IN ('r', 'p')`).
		Scan(&o.Owners, &o.Superuser)
	if err != nil {
		return o, fmt.Errorf("migrate: reading the tables' owners: %w", err)
	}
	return o, nil
}
