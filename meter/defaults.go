package meter

import "time"

// DefaultStageInterval is how often the periodic staging pass runs
// (PeriodicStage; TALLY_STAGE_INTERVAL): a closed window waits at most this
// long, after its end and the grace (DefaultGrace), to be staged.
const DefaultStageInterval = 10 * time.Second
