package migrations_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/migrations"
)

// TestEveryTableHasAPlacement holds Placements to the schema: a new table
// must say where it lives on Citus, and no placement names a table that is
// gone. River's and goose's tables and the ledger's month partitions (they
// follow their parent) are not Tally's to place.
func TestEveryTableHasAPlacement(t *testing.T) {
	t.Parallel()
	pool := testdb.New(t)
	rows, err := pool.Query(context.Background(), `SELECT c.relname FROM pg_class c
		WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
		  AND c.relkind IN ('r', 'p') AND NOT c.relispartition
		  AND c.relname NOT LIKE 'river\_%' AND c.relname <> 'goose_db_version'
		ORDER BY 1`)
	require.NoError(t, err)
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)

	var unplaced []string
	for _, name := range tables {
		if _, ok := migrations.Placements[name]; !ok {
			unplaced = append(unplaced, name)
		}
	}
	require.Empty(t, unplaced, "tables without a placement on Citus (migrations.Placements)")
	var gone []string
	for name := range migrations.Placements {
		if !slices.Contains(tables, name) {
			gone = append(gone, name)
		}
	}
	require.Empty(t, gone, "placements of tables the schema does not have")
}

func TestReadEngineOnPlainPostgres(t *testing.T) {
	t.Parallel()
	pool := testdb.New(t)
	e, err := migrations.ReadEngine(context.Background(), pool)
	require.NoError(t, err)
	require.Empty(t, e.Citus)
	require.Empty(t, e.Nodes)
	require.Empty(t, e.Tables)
	require.Empty(t, e.Misplaced())
	require.True(t, strings.HasPrefix(e.Server, "15."), e.Server)
	require.Equal(t, "PostgreSQL "+e.Server, e.String())
}

// On Citus before Tally's tables are distributed, the engine names the
// coordinator and both workers and says every table is local: the doctor
// fails on the ones that must be distributed or copied.
func TestReadEngineOnCitus(t *testing.T) {
	t.Parallel()
	pool := testdb.NewCitus(t)
	e, err := migrations.ReadEngine(context.Background(), pool)
	require.NoError(t, err)
	require.Regexp(t, `^\d+\.\d+\.\d+$`, e.Citus)
	require.Len(t, e.Nodes, 1+testdb.CitusWorkers)
	require.True(t, e.Nodes[0].Coordinator, "the coordinator comes first")
	require.Len(t, e.Workers(), testdb.CitusWorkers)
	for _, n := range e.Nodes {
		require.True(t, n.Active, "%+v", n)
	}
	require.Len(t, e.Tables, len(migrations.Placements))
	want := 0
	for _, p := range migrations.Placements {
		if p != migrations.Local {
			want++
		}
	}
	require.Len(t, e.Misplaced(), want)
	require.Contains(t, e.String(), "Citus "+e.Citus+" on PostgreSQL")
}
