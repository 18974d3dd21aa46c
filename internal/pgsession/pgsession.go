// Package pgsession owns the settings every Postgres session Tally's
// statements run in starts with, whatever the server's own defaults:
// serve's workload pools, the commands' pool, a diagnosis's, and the tests'
// and benchmarks' pools, so that benchmarks plan statements as serve does.
//
// They are the database's defaults (ALTER DATABASE … SET, which the
// migrations and the tests' databases apply), never startup parameters: a
// connection pooler such as PgBouncer refuses a startup parameter it does
// not know (or, told to ignore it, drops it), while a database's defaults
// hold in every session on it, through a pooler or not.
//
// It is a leaf. A setting the database URL names still wins (a startup
// parameter overrides the database's default), and it never holds a
// workload's own bounds (statement_timeout and the like are
// cmd/tally/app's, per pool).
package pgsession

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
)

// Setting is one session setting and the value Tally's statements are
// planned for.
type Setting struct{ Name, Value string }

// Settings returns the settings Tally's statements are planned for:
//
//   - jit=off. Every statement Tally runs is built to read little: a claim
//     batch, a report of one month. Postgres's JIT compiles a statement
//     whose estimated cost passes jit_above_cost, and a table with a long
//     history inflates estimates past it: the report then spends far
//     longer compiling than running. A routine statement never runs long
//     enough to pay a compilation back.
//   - max_parallel_workers_per_gather=0, for the same estimates: a
//     parallel scan of a month the statistics overestimate costs more to
//     start than it saves, and on a small machine a worker takes a core
//     from the deliverers.
func Settings() []Setting {
	return []Setting{{"jit", "off"}, {"max_parallel_workers_per_gather", "0"}}
}

// Statements returns the statements that make Settings the defaults of the
// database named database, for the sessions that start after them. Only
// the database's owner (or a superuser) may run them.
func Statements(database string) []string {
	settings := Settings()
	out := make([]string, len(settings))
	for i, s := range settings {
		out[i] = "ALTER DATABASE " + pgx.Identifier{database}.Sanitize() + " SET " + s.Name + " = " + s.Value
	}
	return out
}

// ResetStatements returns the statements that undo Statements.
func ResetStatements(database string) []string {
	settings := Settings()
	out := make([]string, len(settings))
	for i, s := range settings {
		out[i] = "ALTER DATABASE " + pgx.Identifier{database}.Sanitize() + " RESET " + s.Name
	}
	return out
}

// Missing returns, as name=value, the settings a session on q does not
// start with: the database lacks the defaults (the migrations set them only
// when the migrating role owns the database), or the URL overrides them.
func Missing(ctx context.Context, q pgdb.Querier) ([]string, error) {
	var missing []string
	for _, s := range Settings() {
		var v string
		if err := q.QueryRow(ctx, "SELECT current_setting($1)", s.Name).Scan(&v); err != nil {
			return nil, fmt.Errorf("pgsession: reading %s: %w", s.Name, err)
		}
		if v != s.Value {
			missing = append(missing, s.Name+"="+s.Value)
		}
	}
	return missing, nil
}
