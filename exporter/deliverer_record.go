package exporter

import (
	"context"
	"errors"
	"time"

	"github.com/tallymeter/tally/outbox"
)

// recordTimeout bounds writing one batch of outcomes.
const recordTimeout = 30 * time.Second

// record writes outcomes in batches: every FlushEvery, or at RecordBatch.
func (d *Deliverer) record(outcomes <-chan outbox.Outcome) {
	t := time.NewTicker(d.cfg.FlushEvery)
	defer t.Stop()
	var batch []outbox.Outcome
	flush := func() {
		if len(batch) == 0 {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), recordTimeout)
		defer cancel()
		batch = d.latestPerItem(batch)
		res, err := d.store.Record(ctx, d.pool, batch)
		if err != nil {
			// The items stay leased until their leases expire; the resend
			// carries the same identifier, so the provider deduplicates it.
			d.logger.Error("recording delivery outcomes failed; their items will be claimed again", "items", len(batch), "error", err)
		}
		for _, r := range res {
			if errors.Is(r.Err, outbox.ErrStaleLease) {
				d.logger.Warn("a delivery outcome was fenced out: the item was claimed again meanwhile", "item", r.ID)
			}
		}
		batch = batch[:0]
	}
	for {
		select {
		case o, ok := <-outcomes:
			if !ok {
				flush()
				return
			}
			batch = append(batch, o)
			if len(batch) >= d.cfg.RecordBatch {
				flush()
			}
		case <-t.C:
			flush()
		}
	}
}

// latestPerItem keeps, of several outcomes for one item in a batch, the
// one of its latest lease: the item was claimed again while an outcome of
// its earlier lease still waited here, and that one would be fenced out
// anyway (outbox.Record refuses a batch naming an item twice, which would
// lose the whole batch).
func (d *Deliverer) latestPerItem(batch []outbox.Outcome) []outbox.Outcome {
	at := make(map[int64]int, len(batch))
	out := batch[:0]
	for _, o := range batch {
		i, seen := at[o.Lease.ID]
		switch {
		case !seen:
			at[o.Lease.ID] = len(out)
			out = append(out, o)
		case o.Lease.LeaseToken > out[i].Lease.LeaseToken:
			d.logger.Warn("a delivery outcome was fenced out: the item was claimed again meanwhile", "item", o.Lease.ID)
			out[i] = o
		default:
			d.logger.Warn("a delivery outcome was fenced out: the item was claimed again meanwhile", "item", o.Lease.ID)
		}
	}
	return out
}
