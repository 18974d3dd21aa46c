package migrations_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// No trigger notifies and no function of Tally's reads the moving clock: a
// trigger fires on the node that holds its row, where a NOTIFY keeps a
// write to two nodes from committing, and the statements that call
// Tally's functions decide with the statement's time, which a distributed
// database evaluates once; the outbox sends its notification itself.
func TestNoTriggerNotifiesAndNoFunctionReadsTheClock(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	var notifying []string
	require.NoError(t, pool.QueryRow(ctx, `
		SELECT coalesce(array_agg(t.tgrelid::regclass || '.' || t.tgname ORDER BY 1), '{}')
		FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
		WHERE NOT t.tgisinternal AND (p.prosrc ILIKE '%notify%')`).Scan(&notifying))
	require.Empty(t, notifying)

	var clocked []string
	require.NoError(t, pool.QueryRow(ctx, `
		SELECT coalesce(array_agg(p.oid::regprocedure::text ORDER BY 1), '{}')
		FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
		WHERE n.nspname = current_schema() AND p.prosrc ILIKE '%clock_timestamp%'`).Scan(&clocked))
	require.Empty(t, clocked)
}
