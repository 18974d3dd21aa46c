package exporter

import (
	"context"
	"net/http"
	"slices"
	"time"

	"github.com/tallymeter/tally/outbox"
)

// sendBatches checks the leases against this node (quarantine) and sends the rest
// in requests of up to MaxBatch items, each on its own goroutine, to end
// by end; every item holds its send slot until its outcome is out. Every
// request's events were taken from the limiter before the claim; the first
// prepaid requests also go on the shared bucket's slots taken with them,
// and any more (a claim of several accounts' items) wait for their own.
func (r *delivery) sendBatches(be BatchExporter, leases []outbox.Lease, dest Destination, prepaid int, end time.Time) {
	ready := leases[:0:0]
	for _, l := range leases {
		if o, ok := r.claimCheck(l, dest, be.Name()); ok {
			o.Lease = l
			r.metrics.outcome(o)
			r.outcomes <- o
			<-r.slots
			continue
		}
		ready = append(ready, l)
	}
	// A request carries one account's items: a stream session belongs to
	// the account it was created on.
	for _, group := range byAccount(ready) {
		for batch := range slices.Chunk(group, be.MaxBatch()) {
			paid := prepaid > 0
			prepaid--
			r.sends.Add(1)
			go func() {
				defer r.sends.Done()
				for _, o := range r.deliverBatch(be, batch, dest, paid, end) {
					r.outcomes <- o
					<-r.slots
				}
			}()
		}
	}
}

// byAccount splits leases by destination account, keeping their order
// within each account and the accounts in order of first appearance.
func byAccount(leases []outbox.Lease) [][]outbox.Lease {
	if len(leases) == 0 {
		return nil
	}
	one := true
	for _, l := range leases[1:] {
		if l.DestinationAccount != leases[0].DestinationAccount {
			one = false
			break
		}
	}
	if one {
		return [][]outbox.Lease{leases}
	}
	var groups [][]outbox.Lease
	at := map[string]int{}
	for _, l := range leases {
		i, ok := at[l.DestinationAccount]
		if !ok {
			i = len(groups)
			at[l.DestinationAccount] = i
			groups = append(groups, nil)
		}
		groups[i] = append(groups[i], l)
	}
	return groups
}

// keySignals reads the key and account signals of a batch's outcomes: the
// first outcome of each account.
func (d *Deliverer) keySignals(out []outbox.Outcome, dest Destination) {
	seen := map[string]bool{}
	for _, o := range out {
		if !seen[o.Lease.DestinationAccount] {
			seen[o.Lease.DestinationAccount] = true
			d.keySignal(o, dest)
		}
	}
}

// deliverBatch sends a batch of checked leases on a context of its own, like
// deliver, and reads the flow-control and key signals of its outcomes.
func (d *Deliverer) deliverBatch(be BatchExporter, batch []outbox.Lease, dest Destination, paid bool, end time.Time) []outbox.Outcome {
	ctx, cancel := context.WithDeadline(context.Background(), end)
	defer cancel()
	start := time.Now()
	// The first request goes on the events taken before the claim, and on
	// the shared slot taken with them when paid; any more (a split, a
	// renewed session) wait for their own, but only while a request
	// timeout still fits before end.
	first := true
	wait := func(ctx context.Context, events int) error {
		switch {
		case first && paid:
			first = false
			return nil
		case first:
			first = false
			return d.waitSlot(ctx, end, 0)
		}
		return d.waitSlot(ctx, end, events)
	}
	out := be.SendBatch(ctx, batch, wait)
	d.metrics.sent(outbox.Outcome{}, time.Since(start))
	slowed, ok := false, false
	for i := range out {
		o := &out[i]
		o.Lease = batch[i]
		switch {
		case o.Kind == outbox.RateLimited && !slowed:
			d.limiter.Slow(start)
			slowed = true
		case (o.Error.Status != 0 || o.Kind == outbox.Accepted) && !ok:
			d.limiter.Ok()
			ok = true
		}
		d.metrics.outcome(*o)
	}
	d.keySignals(out, dest)
	return out
}

// keySignal tells KeyHealth, or for a connected account Connected, what an
// outcome says about the key's access. Stripe refusing a connected account
// (account_invalid, or a 403 on a call for it) stalls that account alone;
// a 401 is the key's, and any refusal of the node's own destination stalls
// the node.
func (d *Deliverer) keySignal(o outbox.Outcome, dest Destination) {
	acct := o.Lease.DestinationAccount
	if c := d.cfg.Accounts; c != nil && acct != "" && acct != dest.Account {
		refused := o.Error.Code == codeAccountRefused || o.Error.Code == codeAuth && o.Error.Status == http.StatusForbidden
		switch {
		case refused:
			if c.Refused(acct, o.Error.Status) {
				d.logger.Error("Stripe refused this platform's access to a connected account: its items wait, the others export; access is probed every 15s",
					"account", acct, "status", o.Error.Status)
			}
			return
		case o.Kind == outbox.Accepted && c.Works(acct):
			d.logger.Info("Stripe accepts deliveries to the connected account again: its items export", "account", acct)
			return
		}
	}
	k := d.cfg.Keys
	if k == nil {
		return
	}
	switch {
	case refusedKeyOrAccount(o.Error.Code) && k.KeyRefused(o.Error.Status):
		d.logger.Error("Stripe refused the API key: export is stalled until the key is fixed; items are retried with backoff",
			"status", o.Error.Status)
	case o.Kind == outbox.Accepted && k.KeyWorks():
		d.logger.Info("Stripe accepts the API key again: export resumed")
	}
}

// waitSlot waits for a request's slot at the limiter, carrying units (0:
// units taken already), while a request timeout still fits before end;
// past that it gives up without one.
func (d *Deliverer) waitSlot(ctx context.Context, end time.Time, units int) error {
	ctx, cancel := context.WithDeadline(ctx, end.Add(-d.timeout))
	defer cancel()
	return d.limiter.WaitN(ctx, units)
}

// deliver checks a leased item against this node (quarantine) and sends it: on the
// limiter's slot taken before the claim when paid, else on one it waits
// for. The send runs on a context of its own that ends at end, inside the
// item's lease, so that a shutdown lets it finish and records its outcome,
// and no call for the item is still in flight when another claimer may
// take it over.
func (d *Deliverer) deliver(l outbox.Lease, dest Destination, paid bool, end time.Time) outbox.Outcome {
	if o, ok := d.claimCheck(l, dest, d.exporter.Name()); ok {
		o.Lease = l
		d.metrics.outcome(o)
		return o
	}
	ctx, cancel := context.WithDeadline(context.Background(), end)
	defer cancel()
	if !paid {
		if err := d.waitSlot(ctx, end, 1); err != nil {
			return outbox.Outcome{Lease: l, Kind: outbox.Retry, Refused: true,
				Error: outbox.ErrorInfo{Code: "limiter", Message: "the rate limiter gave no slot while the lease had time for a request"}}
		}
	}
	start := time.Now()
	o := d.exporter.Send(ctx, l)
	o.Lease = l
	d.metrics.sent(o, time.Since(start))
	switch {
	case d.selfPaced(l):
		// Its calls were paced, and their answers read, by the exporter on
		// another class's limiter.
	case o.Kind == outbox.RateLimited:
		d.limiter.Slow(start)
	case o.Error.Status != 0 || o.Kind == outbox.Accepted:
		d.limiter.Ok()
	}
	d.keySignal(o, dest)
	d.metrics.outcome(o)
	return o
}

// selfPacer is an exporter that paces some items' calls on a limiter of its
// own (StripeV1.PaceAdjustments).
type selfPacer interface{ SelfPaced(outbox.Lease) bool }

// selfPaced reports whether the exporter paces the calls of l itself.
func (d *Deliverer) selfPaced(l outbox.Lease) bool {
	sp, ok := d.exporter.(selfPacer)
	return ok && sp.SelfPaced(l)
}

// claimCheck is quarantine: an item staged for another account, mode or exporter
// than this node's, or one that cannot be sent as it stands, is quarantined
// without being sent. An account other than the node's own destination
// must be a connected account some tenant mapping names.
func (d *Deliverer) claimCheck(l outbox.Lease, dest Destination, exporter string) (outbox.Outcome, bool) {
	q := func(r outbox.Reason, msg string) (outbox.Outcome, bool) {
		return outbox.Outcome{Kind: outbox.Quarantined, Reason: r, Error: outbox.ErrorInfo{Code: string(r), Message: msg}}, true
	}
	switch {
	case dest.Account == "":
		return q(outbox.ReasonNoAccount, "this node has no destination account (STRIPE_ACCOUNT)")
	case l.DestinationAccount != dest.Account:
		if o, stop := d.connectedCheck(l); stop {
			return o, true
		}
	}
	switch {
	case l.Mode != dest.Mode:
		return q(outbox.ReasonModeMismatch, "staged for another mode than this node exports to")
	case l.Payload.EventName == "":
		return q(outbox.ReasonFeatureUnmapped, "no meter event name")
	case l.Payload.Customer == "":
		return q(outbox.ReasonNoCustomer, "no Stripe customer")
	case l.TimestampOutside && l.Payload.Cancels == "":
		// An adjustment names its event by identifier and carries no
		// timestamp of its own: the event's may have aged past Stripe's
		// window since it was received, which does not matter to it.
		return q(outbox.ReasonTimestampWindow, "the timestamp is outside what Stripe accepts")
	case l.PastDeadline && l.RefusedAttempts == l.Attempts-1:
		// Stripe cancels an event only within 24 hours of receiving it, and
		// this lease ends after them; no earlier attempt may have reached
		// Stripe, so nothing of it was applied. One that may have is sent:
		// Stripe's refusal then sends the exporter to the earlier keys.
		return q(outbox.ReasonCancelTooLate, "the lease would end after Stripe's 24 hours to cancel the event")
	case !ValueFits(l.Payload.Value):
		return q(outbox.ReasonValueDigits, "the value has more digits than Stripe accepts (15); it is never sent or truncated")
	case l.Exporter != exporter:
		// Not a mapping problem: another node's exporter sends it. Put it back
		// without an attempt's refusal being its fault.
		return outbox.Outcome{Kind: outbox.Retry, Refused: true,
			Error: outbox.ErrorInfo{Code: "exporter_mismatch", Message: "staged for another exporter than this node runs"}}, true
	}
	return outbox.Outcome{}, false
}

// connectedCheck is quarantine for an item staged for another account than the
// node's own destination: it goes on when a tenant mapping has named that
// account (a connected account), and is quarantined account_mismatch when
// none has; when the mappings cannot be read it is put back.
func (d *Deliverer) connectedCheck(l outbox.Lease) (outbox.Outcome, bool) {
	mismatch := outbox.Outcome{Kind: outbox.Quarantined, Reason: outbox.ReasonAccountMismatch, Error: outbox.ErrorInfo{
		Code: string(outbox.ReasonAccountMismatch), Message: "staged for an account that is neither this node's destination nor a connected account a tenant mapping names"}}
	if d.cfg.Accounts == nil {
		return mismatch, true
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	known, err := d.cfg.Accounts.Known(ctx, l.DestinationAccount)
	switch {
	case err != nil:
		return outbox.Outcome{Kind: outbox.Retry, Refused: true,
			Error: outbox.ErrorInfo{Code: "account_lookup", Message: "the connected accounts of the tenant mappings could not be read"}}, true
	case !known:
		return mismatch, true
	}
	return outbox.Outcome{}, false
}
