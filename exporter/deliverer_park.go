package exporter

import (
	"context"
	"slices"
	"sync"
	"time"
)

// Parking skipped keys. A claim that skips a stalled connected account or
// a paused event name filters their due items out of the index it reads
// in order: left due, that backlog is read past by every claim on every
// node. The deliverer parks the due items of what it skips (outbox.Park:
// their next attempt moved a little into the future, no attempt spent)
// every ParkEvery while they stay skipped, and unparks them
// (outbox.Unpark) as soon as it sees them skipped no longer.
const (
	// ParkEvery is how often a deliverer parks the due items of the keys
	// it skips.
	ParkEvery = 20 * time.Second
	// ParkFor is how far a park moves an item's next attempt: past a few
	// parks, so that a node that stops parking leaves the items due again
	// within it.
	ParkFor = time.Minute
)

// parking is a deliverer's record of what it parked. It is safe for
// concurrent use by the deliverer's claim loops.
type parking struct {
	mu sync.Mutex
	// at is when the skipped keys were last parked.
	at time.Time
	// keys are the skip keys parked, as last skipped.
	keys []string
}

// park parks the due items of this deliverer's exporter of skip (the
// claim's skipped accounts and event names) every ParkEvery, and unparks
// those of keys it parked that are skipped no longer, at once. A failure
// is logged: claims still skip the keys, only more slowly.
func (d *Deliverer) park(ctx context.Context, skip []string) {
	p := &d.parking
	p.mu.Lock()
	defer p.mu.Unlock()
	var gone []string
	for _, k := range p.keys {
		if !slices.Contains(skip, k) {
			gone = append(gone, k)
		}
	}
	if len(gone) > 0 {
		n, err := d.store.Unpark(ctx, d.pool, d.exporter.Name(), gone, ParkFor)
		if err != nil {
			d.logger.WarnContext(ctx, "unparking the items of keys no longer skipped failed; they are due within a minute", "error", err)
		} else if n > 0 {
			d.logger.InfoContext(ctx, "items of keys no longer skipped are due again", "items", n, "keys", len(gone))
		}
	}
	if len(skip) == 0 {
		p.keys = nil
		return
	}
	changed := !slices.Equal(skip, p.keys)
	p.keys = slices.Clone(skip)
	if !changed && time.Since(p.at) < ParkEvery {
		return
	}
	p.at = time.Now()
	if _, err := d.store.Park(ctx, d.pool, d.exporter.Name(), skip, ParkFor); err != nil && ctx.Err() == nil {
		d.logger.WarnContext(ctx, "parking the due items of skipped keys failed; claims read past them", "error", err)
	}
}
