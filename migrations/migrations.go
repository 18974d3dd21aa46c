// Package migrations owns Tally's database schema: the embedded SQL files in
// this directory and the one migration in Go (44, session_settings.go),
// applied in order by goose, and River's own schema, applied
// by rivermigrate in the same step. Both run under one Postgres advisory lock,
// a transaction's (so that it holds through a transaction-mode pooler), so
// that nodes starting together migrate one at a time. On a Citus
// coordinator, Distribute places the tables where Placements says, with
// their rows, under the same lock; the goose migrations run the same on
// plain PostgreSQL and Citus. It also answers questions about the database
// itself rather than a table, for tally doctor: DatabaseTime (the server's
// clock), who owns the tables (TableOwners), whether the nodes' role is
// held to the runtime role's privileges (PrivilegesEnforced) and the
// engine (ReadEngine).
//
// It must never hold data logic: no function here reads or writes an outbox
// or ledger row (Distribute moves whole tables into Citus and drops only
// the coordinator's copy of rows already in the shards), and a down
// migration is for development only.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

//go:embed *.sql
var files embed.FS

// lockKey is the transaction-level advisory lock (single bigint key space)
// held while migrating: "tally" in ASCII.
const lockKey int64 = 0x74616c6c79

// Result says what one Apply did.
type Result struct {
	// TallyVersion is Tally's schema version after the step.
	TallyVersion int64
	// TallyApplied counts the Tally migrations applied by this step.
	TallyApplied int
	// RiverApplied counts River's migrations applied by this step.
	RiverApplied int
}

// Apply brings the database behind pool up to date: Tally's migrations, then
// River's, both under one advisory lock. It is safe to call from many nodes at
// once and cheap when there is nothing to do. A nil logger discards River's
// and goose's progress lines.
func Apply(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) (Result, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	var res Result

	// The lock is the transaction's, held open while the migrations run on
	// other connections: a session lock would outlive its statement on a
	// transaction-mode pooler's server connection, and be released from
	// another one. The transaction only waits; it holds no snapshot.
	lock, err := pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("migrate: opening the lock's transaction: %w", err)
	}
	// A fresh context: the lock must be released even when ctx has ended.
	defer func() { _ = lock.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := lock.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey); err != nil {
		return res, fmt.Errorf("migrate: taking the migration lock: %w", err)
	}

	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	provider, err := newProvider(db, logger)
	if err != nil {
		return res, err
	}
	applied, err := provider.Up(ctx)
	if err != nil {
		return res, fmt.Errorf("migrate: applying Tally's migrations: %w", err)
	}
	res.TallyApplied = len(applied)
	if res.TallyVersion, err = provider.GetDBVersion(ctx); err != nil {
		return res, fmt.Errorf("migrate: reading Tally's schema version: %w", err)
	}

	migrator, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: logger})
	if err != nil {
		return res, fmt.Errorf("migrate: preparing River's migrations: %w", err)
	}
	rres, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil)
	if err != nil {
		return res, fmt.Errorf("migrate: applying River's migrations: %w", err)
	}
	res.RiverApplied = len(rres.Versions)
	return res, nil
}

// ErrBehind is returned by Check when the database lacks migrations this
// binary knows.
var ErrBehind = errors.New("database schema is behind this binary; run `tally migrate`")

// Check reports whether the database behind pool has every migration this
// binary carries, Tally's and River's, without changing anything. /readyz
// uses it.
func Check(ctx context.Context, pool *pgxpool.Pool) error {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	provider, err := newProvider(db, nil)
	if err != nil {
		return err
	}
	pending, err := provider.HasPending(ctx)
	if err != nil {
		return fmt.Errorf("migrate: reading Tally's schema version: %w", err)
	}
	if pending {
		return ErrBehind
	}
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return fmt.Errorf("migrate: preparing River's migrations: %w", err)
	}
	existing, err := migrator.ExistingVersions(ctx)
	if err != nil {
		return fmt.Errorf("migrate: reading River's schema version: %w", err)
	}
	if all := migrator.AllVersions(); len(existing) < len(all) {
		return ErrBehind
	}
	return nil
}

func newProvider(db *sql.DB, logger *slog.Logger) (*goose.Provider, error) {
	opts := []goose.ProviderOption{goose.WithDisableGlobalRegistry(true), goose.WithGoMigrations(sessionSettings())}
	if logger != nil {
		opts = append(opts, goose.WithSlog(logger))
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, files, opts...)
	if err != nil {
		return nil, fmt.Errorf("migrate: loading the embedded migrations: %w", err)
	}
	return p, nil
}
