package pgdb_test

import (
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/pgdb"
)

// The handles Tally passes around have the shapes their docs promise.
var (
	_ pgdb.DB       = (*pgxpool.Pool)(nil)
	_ pgdb.DB       = (*pgx.Conn)(nil)
	_ pgdb.Beginner = pgx.Tx(nil)
)
