package outbox

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// The statements a cancellation runs on an item name the item's bucket,
// and are each one shard's: the live-item lock (the chain of successors
// included), the read of the item it locked, withdraw and
// supersede_cancelled.
func TestWithdrawStatementsAreOneShards(t *testing.T) {
	t.Parallel()
	db := testdb.NewDistributed(t)
	bucket := tenantbucket.Of("acme")
	for _, tc := range []struct {
		name string
		sql  string
		args []any
	}{
		{"lock the live item", sqlLockLive, []any{pgx.NamedArgs{"id": int64(29), "bucket": bucket}}},
		{"read the live item", sqlLiveItem, []any{int64(29), bucket}},
		{"withdraw", sqlWithdraw, []any{pgx.NamedArgs{"id": int64(29), "bucket": bucket}}},
		{"supersede_cancelled", sqlSupersedeCancelled, []any{pgx.NamedArgs{"id": int64(29), "successor": int64(30), "bucket": bucket}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, []int{1}, testdb.CitusTasks(t, db, tc.sql, tc.args...))
		})
	}
}
