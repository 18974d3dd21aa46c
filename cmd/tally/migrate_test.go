package main

import (
	"context"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/migrations"
)

// tally migrate on a Citus coordinator says that Tally's tables are not
// distributed and how to distribute them, and leaves them; --distribute
// refuses a cluster without a worker, naming what is missing.
func TestMigrateOnCitus(t *testing.T) {
	t.Parallel()
	url := testdb.CitusURL(t)
	code, out, errs := tally(t, url, "migrate")
	require.Equal(t, 0, code, errs)
	unplaced := 0
	for _, p := range migrations.Placements {
		if p != migrations.Local {
			unplaced++
		}
	}
	require.Regexp(t, `^migrations applied\nCitus \S+ on PostgreSQL 15\.\d+, 2 workers: `+strconv.Itoa(unplaced)+` of Tally's tables are not yet distributed or reference tables; `+
		`to place them, run tally migrate --distribute \(docs/scale\.md\)\n$`, out)

	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	defer pool.Close()
	testdb.RemoveWorkers(t, pool)
	code, _, errs = tally(t, url, "migrate", "--distribute")
	require.Equal(t, 1, code, errs)
	require.Contains(t, errs, "migrate: cannot distribute: no active worker is registered on the coordinator")
}

// On plain PostgreSQL tally migrate says nothing of Citus, and
// --distribute says there is nothing to distribute.
func TestMigrateDistributeOnPlainPostgres(t *testing.T) {
	t.Parallel()
	url := testdb.URL(t)
	code, out, errs := tally(t, url, "migrate")
	require.Equal(t, 0, code, errs)
	require.Equal(t, "migrations applied\n", out)
	code, out, errs = tally(t, url, "migrate", "--distribute")
	require.Equal(t, 0, code, errs)
	require.Regexp(t, `^migrations applied\nPostgreSQL 15\.\d+: nothing to distribute\n$`, out)
}
