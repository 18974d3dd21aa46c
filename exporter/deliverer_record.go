package exporter

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/tallymeter/tally/outbox"
)

// recordTimeout bounds writing one batch of outcomes.
const recordTimeout = 30 * time.Second

// record writes outcomes in batches: every FlushEvery, or at RecordBatch,
// up to Recorders batches at once, each a transaction of its own. While
// every recorder is busy the batch being gathered grows to RecordBatch,
// then record stops reading outcomes until a recorder is free (the sends
// wait on the channel: back-pressure). Concurrent batches cannot deadlock:
// each locks its rows in ascending id order before it writes (outbox.Record),
// and an item named in two of them (an outcome of each of two leases) is
// settled by the lease-token fence, whichever commits first. It returns
// once outcomes is closed and every batch is written.
func (d *Deliverer) record(outcomes <-chan outbox.Outcome) {
	t := time.NewTicker(d.cfg.FlushEvery)
	defer t.Stop()
	busy := make(chan struct{}, d.cfg.Recorders) // a token per batch being written
	var writing sync.WaitGroup
	var batch []outbox.Outcome
	// flush hands the batch to a recorder; when every recorder is busy it
	// waits for one (wait) or leaves the batch to grow.
	flush := func(wait bool) {
		if len(batch) == 0 {
			return
		}
		if wait {
			busy <- struct{}{}
		} else {
			select {
			case busy <- struct{}{}:
			default:
				return
			}
		}
		b := batch
		batch = make([]outbox.Outcome, 0, len(b))
		writing.Add(1)
		go func() {
			defer writing.Done()
			defer func() { <-busy }()
			d.write(b)
		}()
	}
	for {
		select {
		case o, ok := <-outcomes:
			if !ok {
				flush(true)
				writing.Wait()
				return
			}
			batch = append(batch, o)
			if len(batch) >= d.cfg.RecordBatch {
				flush(true)
			}
		case <-t.C:
			flush(false)
		}
	}
}

// write writes one batch of outcomes.
func (d *Deliverer) write(batch []outbox.Outcome) {
	ctx, cancel := context.WithTimeout(context.Background(), recordTimeout)
	defer cancel()
	batch = d.latestPerItem(batch)
	d.meterOf(ctx, batch)
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

// meterOf names, on each accepted outcome of batch, the meter its item's
// event name resolves to in its account (Config.Meters), which the accept
// records for reconciliation. An unknown meter is left unnamed: the item
// is compared with its event name's meter.
func (d *Deliverer) meterOf(ctx context.Context, batch []outbox.Outcome) {
	if d.cfg.Meters == nil {
		return
	}
	for i := range batch {
		o := &batch[i]
		if o.Kind != outbox.Accepted || o.Meter != "" {
			continue
		}
		id, ok, err := d.cfg.Meters.ActiveMeter(ctx, d.pool, o.Lease.DestinationAccount, o.Lease.Mode, o.Lease.Payload.EventName)
		if err != nil {
			d.logger.Warn("reading the meters failed; accepted items are recorded without their meter", "error", err)
			return
		}
		if ok {
			o.Meter = id
		}
	}
}
