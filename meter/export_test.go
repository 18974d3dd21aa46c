package meter

import (
	"context"

	"github.com/tallymeter/tally/internal/pgdb"
)

// SerialPass is a pass the way staging ran before batches: one window a
// transaction, every tenant. Tests compare the batched passes with it.
func SerialPass(ctx context.Context, s *Stager, db pgdb.DB) (PassResult, error) {
	return s.pass(ctx, db, Part{}, false)
}

// SetBatchBounds makes s's batches at most groups features and rows rows.
func SetBatchBounds(s *Stager, groups int, rows int64) {
	s.batchGroups, s.batchRows = groups, rows
}

// SerialPassPart is SerialPass over one part of the tenants.
func SerialPassPart(ctx context.Context, s *Stager, db pgdb.DB, part Part) (PassResult, error) {
	return s.pass(ctx, db, part, false)
}
