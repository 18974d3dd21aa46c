package meter

import (
	"context"
	"fmt"
	"time"

	"github.com/tallymeter/tally/mappings"
)

// SinceLastStage is how long ago, by the database's clock, a staging pass
// (the River job StageArgs) last completed, on any node, and false when
// River holds no completed one (it deletes finished jobs after a while).
func SinceLastStage(ctx context.Context, q mappings.Querier) (time.Duration, bool, error) {
	var seconds *float64
	err := q.QueryRow(ctx, `SELECT extract(epoch FROM clock_timestamp() - max(finalized_at))::float8 FROM river_job
		WHERE kind = $1 AND state = 'completed'`, StageArgs{}.Kind()).Scan(&seconds)
	if err != nil {
		return 0, false, fmt.Errorf("meter: reading the last staging pass: %w", err)
	}
	if seconds == nil {
		return 0, false, nil
	}
	return time.Duration(*seconds * float64(time.Second)), true, nil
}
