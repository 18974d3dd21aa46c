package migrations

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// DatabaseTime reads the database's clock (clock_timestamp()): the clock
// Tally decides with, which tally doctor compares with the node's.
func DatabaseTime(ctx context.Context, pool *pgxpool.Pool) (time.Time, error) {
	var now time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&now); err != nil {
		return time.Time{}, fmt.Errorf("migrations: reading the database's clock: %w", err)
	}
	return now, nil
}
