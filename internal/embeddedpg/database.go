package embeddedpg

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// EnsureDatabase creates the database name in the cluster, owned by the
// superuser, unless it exists. Two callers racing to create it both succeed.
func (c *Cluster) EnsureDatabase(ctx context.Context, name string) error {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return fmt.Errorf("connecting to the embedded postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		return fmt.Errorf("reading the embedded postgres' databases: %w", err)
	}
	if exists {
		return nil
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && (pgErr.Code == duplicateDatabase || pgErr.Code == uniqueViolation) {
			return nil // created in the meantime by another process
		}
		return fmt.Errorf("creating database %s: %w", name, err)
	}
	return nil
}

// The SQLSTATEs of a CREATE DATABASE of a name that exists: duplicate_database,
// or unique_violation when the other creation committed while this one ran.
const (
	duplicateDatabase = "42P04"
	uniqueViolation   = "23505"
)
