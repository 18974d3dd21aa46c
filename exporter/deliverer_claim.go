package exporter

import (
	"context"
	"slices"
	"time"

	"github.com/tallymeter/tally/outbox"
)

// work is one claim loop: it reserves send slots, claims at most as many
// items (the claim) and hands them to the sends, until ctx ends.
func (r *delivery) work(ctx context.Context, owner string) {
	for ctx.Err() == nil {
		dest, err := r.dest()
		if err != nil {
			r.idle(ctx) // export is stalled; items stay pending
			continue
		}
		n, ok := r.reserveSlots(ctx)
		if !ok {
			return
		}
		n, prepaid, ok := r.prepay(ctx, n)
		if !ok {
			return
		}
		// The leases start after this instant, on the database's clock:
		// counted from here, a send ends before its lease expires.
		end := time.Now().Add(r.sendWindow())
		leases, err := r.claim(ctx, owner, n, dest, end)
		if err != nil || len(leases) == 0 {
			r.idle(ctx)
			continue
		}
		if be := r.batch; be != nil {
			r.sendBatches(be, leases, dest, prepaid, end)
			continue
		}
		for i, l := range leases {
			paid := i < prepaid
			r.sends.Add(1)
			go func() {
				defer r.sends.Done()
				defer func() { <-r.slots }()
				r.outcomes <- r.deliver(l, dest, paid, end)
			}()
		}
	}
}

// sendWindow is how long after its claim a send may still run: the lease
// less a tenth, kept for writing the outcome. A send that ran on past its
// lease would overlap the next claimer's send of the same item — a second
// call in flight for its customer and meter, which Stripe's v1 limit
// answers 429 — and its outcome would be fenced out.
func (d *Deliverer) sendWindow() time.Duration {
	lease := d.store.Config().Lease
	return lease - lease/10
}

// idle waits for a notification, the poll interval or the end of ctx.
func (r *delivery) idle(ctx context.Context) {
	t := time.NewTimer(r.cfg.PollInterval)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-r.wake:
	case <-t.C:
	}
}

// reserveSlots reserves the send slots of one claim: it waits, one loop at
// a time, for a share of them (gatherShare; a batch exporter: a full
// request's worth), then takes what else is free, up to Batch. Without ok,
// ctx ended and it holds none.
func (r *delivery) reserveSlots(ctx context.Context) (n int, ok bool) {
	want := gatherShare(r.cfg)
	if be := r.batch; be != nil {
		want = min(be.MaxBatch(), r.cfg.Batch, r.cfg.InFlight)
	}
	n, ok = r.reserve(ctx, want)
	if !ok {
		return 0, false
	}
	for n < r.cfg.Batch {
		select {
		case r.slots <- struct{}{}:
			n++
			continue
		default:
		}
		break
	}
	return n, true
}

// gatherShare is how many send slots a claim loop of a one-item-a-request
// exporter waits for before it claims: an eighth of the slots in flight,
// at most Batch. Waiting for one would make the loops claim as soon as any
// send ended, and the faster the claim the smaller the batch: more claims,
// each a transaction, for the same items. An eighth keeps the slots held
// while one loop gathers below one in eight.
func gatherShare(c DelivererConfig) int {
	return max(1, min(c.Batch, c.InFlight/8))
}

// prepay takes the slots at the limiter for n items first — an item is a
// unit of the limiter: a v1 call, or an event of a stream request, whose
// requests take their slots of the shared bucket with them — then gives
// back the send slots of the items they cannot carry: leased items must
// not wait at the limiter, where a slowed rate would hold them past their
// leases (a slot unused because the claim finds less is lost). It returns
// the items to claim and the requests paid for in the shared bucket.
// Without ok, ctx ended and it holds no send slot.
func (r *delivery) prepay(ctx context.Context, n int) (int, int, bool) {
	units, err := r.limiter.Take(ctx, n)
	if err != nil {
		for ; n > 0; n-- {
			<-r.slots
		}
		return 0, 0, false
	}
	for ; n > units; n-- {
		<-r.slots
	}
	return n, r.limiter.requests(units), true
}

// minGroupQuiet is the least time a shard group of a distributed database
// in which a claim found nothing is passed over by this process's claims
// of the exporter (outbox.ClaimOptions.Quiet), unless a notification names
// it: a poll faster than that would read every empty group at every poll
// of every loop. A retry that falls due in a quiet group waits for it.
const minGroupQuiet = time.Second

// claim leases at most n items of this deliverer's exporter, but none
// of a stalled account or a paused event name, and gives back the send
// slots of those it did not find. The end of ctx (a shutdown) does not cut
// a claim short: the database may have committed it, and its items would
// wait leased and unsent until their leases expired, with an attempt
// counted that never went out. The claim runs until end at most, when the
// sends of its leases would have to stop.
func (r *delivery) claim(ctx context.Context, owner string, n int, dest Destination, end time.Time) ([]outbox.Lease, error) {
	past, future := r.exporter.Accepts()
	opts := outbox.ClaimOptions{
		Owner: owner, Limit: n, Policy: r.cfg.Policy, AcceptPast: past, AcceptFuture: future,
		Exporter: r.exporter.Name(), SkipAccounts: r.cfg.Accounts.skipped(),
		Quiet: max(r.cfg.PollInterval, minGroupQuiet),
	}
	if m := r.cfg.Meters; m != nil {
		skip, err := m.SkipKeys(ctx, r.pool, dest.Mode)
		if err != nil {
			// Unknown which names are paused: claim nothing this round
			// rather than send to a deactivated meter.
			for ; n > 0; n-- {
				<-r.slots
			}
			if ctx.Err() == nil {
				r.logger.ErrorContext(ctx, "reading the paused meters failed", "error", err)
			}
			return nil, err
		}
		opts.SkipMeters = skip
	}
	r.park(ctx, slices.Concat(opts.SkipAccounts, opts.SkipMeters))
	cctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), end)
	defer cancel()
	leases, err := r.store.Claim(cctx, r.pool, opts)
	for i := len(leases); i < n; i++ {
		<-r.slots
	}
	if err != nil && ctx.Err() == nil {
		r.logger.ErrorContext(ctx, "claiming outbox items failed", "error", err)
	}
	return leases, err
}

// reserve waits until it holds want send slots, or ctx ends (then it holds
// none and says so). Waiting for more than one, it first takes gather, so
// that only one loop at a time holds part of what it waits for: the slots
// freed by the sends in flight then all reach it.
func (r *delivery) reserve(ctx context.Context, want int) (int, bool) {
	if want > 1 {
		select {
		case r.gather <- struct{}{}:
			defer func() { <-r.gather }()
		case <-ctx.Done():
			return 0, false
		}
	}
	for n := 0; n < want; {
		select {
		case r.slots <- struct{}{}:
			n++
		case <-ctx.Done():
			for ; n > 0; n-- {
				<-r.slots
			}
			return 0, false
		}
	}
	return want, true
}
