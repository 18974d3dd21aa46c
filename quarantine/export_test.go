package quarantine

import (
	"context"

	"github.com/tallymeter/tally/internal/pgdb"
)

// RequeueMatchingAfterRead is RequeueMatching with afterRead run between
// the read of the items and their requeues: a test changes a mapping there.
func (r *Requeuer) RequeueMatchingAfterRead(ctx context.Context, db pgdb.DB, req BulkRequest,
	afterRead func(context.Context) error) (BulkResult, error) {
	return r.requeueMatching(ctx, db, req, afterRead)
}
