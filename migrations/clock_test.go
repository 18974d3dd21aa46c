package migrations_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/migrations"
)

// The database's clock moves, and on one machine it is the node's.
func TestDatabaseTime(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	first, err := migrations.DatabaseTime(ctx, pool)
	require.NoError(t, err)
	require.WithinDuration(t, time.Now(), first, 5*time.Second)
	second, err := migrations.DatabaseTime(ctx, pool)
	require.NoError(t, err)
	require.True(t, second.After(first), "clock_timestamp(), not the transaction's start")
}
