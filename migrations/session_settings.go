package migrations

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/pressly/goose/v3"

	"github.com/tallymeter/tally/internal/pgsession"
)

// sessionSettings returns migration 44: pgsession's settings become the
// database's defaults, replacing the startup parameters every connection
// sent, which a pooler refuses. Only the database's owner may set them: a
// migrating role that does not own the database leaves them to the
// operator (docs/operations.md) and tally doctor reports them missing.
func sessionSettings() *goose.Migration {
	return goose.NewGoMigration(44,
		&goose.GoFunc{RunTx: func(ctx context.Context, tx *sql.Tx) error {
			return alterDatabase(ctx, tx, pgsession.Statements)
		}},
		&goose.GoFunc{RunTx: func(ctx context.Context, tx *sql.Tx) error {
			return alterDatabase(ctx, tx, pgsession.ResetStatements)
		}})
}

func alterDatabase(ctx context.Context, tx *sql.Tx, statements func(db string) []string) error {
	var db string
	var owner bool
	if err := tx.QueryRowContext(ctx, `SELECT datname, pg_has_role(current_user, datdba, 'USAGE')
		FROM pg_database WHERE datname = current_database()`).Scan(&db, &owner); err != nil {
		return fmt.Errorf("reading the database's owner: %w", err)
	}
	if !owner {
		return nil
	}
	for _, s := range statements(db) {
		if _, err := tx.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("setting the database's session defaults: %w", err)
		}
	}
	return nil
}
