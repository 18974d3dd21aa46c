package meter

import (
	"context"
	"fmt"
	"time"

	"github.com/tallymeter/tally/internal/pgdb"
)

// SinceLastStage is how long ago, by the database's clock, a staging pass
// (the River job StageArgs) last completed, on any node, and false when
// River holds no completed one (it deletes finished jobs after a while).
// A pass skipped because export is stalled (its output says stalled, see
// StageWorker.Work) staged nothing and is not counted.
func SinceLastStage(ctx context.Context, q pgdb.Querier) (time.Duration, bool, error) {
	var seconds *float64
	err := q.QueryRow(ctx, `SELECT extract(epoch FROM clock_timestamp() - max(finalized_at))::float8 FROM river_job
		WHERE kind = $1 AND state = 'completed'
		AND NOT coalesce((metadata -> 'output' ->> 'stalled')::boolean, false)`, StageArgs{}.Kind()).Scan(&seconds)
	if err != nil {
		return 0, false, fmt.Errorf("meter: reading the last staging pass: %w", err)
	}
	if seconds == nil {
		return 0, false, nil
	}
	return time.Duration(*seconds * float64(time.Second)), true, nil
}
