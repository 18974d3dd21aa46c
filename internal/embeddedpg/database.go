package embeddedpg

import (
	"context"
	"errors"
	"fmt"
	"net/url"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// EnsureDatabase creates the database name in the cluster, owned by the
// superuser, unless it exists. Two callers racing to create it both succeed.
// On a Citus coordinator it does so on every node, then creates the
// extension in it on every node and adds the workers (registerCitus).
func (c *Cluster) EnsureDatabase(ctx context.Context, name string) error {
	if err := c.ensureDatabase(ctx, name); err != nil || len(c.workers) == 0 {
		return err
	}
	for _, w := range c.workers {
		if err := w.ensureDatabase(ctx, name); err != nil {
			return err
		}
	}
	return c.registerCitus(ctx, name)
}

func (c *Cluster) ensureDatabase(ctx context.Context, name string) error {
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

// EnsureLoginRole makes name a login role of the cluster, with the
// superuser's password and a member of group (which must exist), and
// returns the URL of database as name. Tally's nodes connect as it so that
// they hold only group's privileges; whoever reads the data directory's
// password file is the superuser anyway. Safe to call at every start.
func (c *Cluster) EnsureLoginRole(ctx context.Context, database, name, group string) (string, error) {
	conn, err := pgx.Connect(ctx, c.URL(database))
	if err != nil {
		return "", fmt.Errorf("connecting to the embedded postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)", name).Scan(&exists); err != nil {
		return "", fmt.Errorf("reading the embedded postgres' roles: %w", err)
	}
	verb := "ALTER"
	if !exists {
		verb = "CREATE"
	}
	var stmt string
	if err := conn.QueryRow(ctx, "SELECT format('"+verb+" ROLE %I LOGIN PASSWORD %L', $1::text, $2::text)", name, c.password).Scan(&stmt); err != nil {
		return "", fmt.Errorf("preparing the role %s: %w", name, err)
	}
	if _, err := conn.Exec(ctx, stmt); err != nil {
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != duplicateObject {
			return "", fmt.Errorf("making the role %s: %w", name, err)
		}
	}
	if _, err := conn.Exec(ctx, "GRANT "+pgx.Identifier{group}.Sanitize()+" TO "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("granting %s to %s: %w", group, name, err)
	}
	u, err := url.Parse(c.URL(database))
	if err != nil {
		return "", err
	}
	u.User = url.UserPassword(name, c.password)
	return u.String(), nil
}

// duplicateObject is the SQLSTATE of a CREATE ROLE of a role another
// process made meanwhile.
const duplicateObject = "42710"
