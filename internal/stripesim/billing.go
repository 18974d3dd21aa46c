package stripesim

import (
	"fmt"
	"net/http"
	"time"
)

// The billing cycle: what Stripe does on its own as time passes. When a
// subscription's period ends it renews: a draft invoice bills the ended
// period's metered usage and the items' periods advance. "All invoices
// have a default finalization grace period of 1 hour. During the
// finalization grace period, you can continue to report usage for the
// previous billing period. During finalization, Stripe updates the invoice
// to reflect the latest quantity for its billing period"
// (docs.stripe.com/billing/subscriptions/usage-based/configure-grace-period):
// a draft with auto_advance finalizes at created plus Options.InvoiceGrace,
// its lines recomputed from the usage recorded until then.
//
// The simulator applies what is due lazily, in time order, at the start of
// every request, in [Server.AdvanceBilling], and before its readbacks; each
// transition happens at its due time, not at the time it is applied, and
// sees only the usage received until its due time.

// AdvanceBilling applies every renewal and automatic finalization due at
// the simulator's now, in time order, in every account: what Stripe would
// have done by now. Requests and readbacks do so by themselves; a test
// calls it to make the simulator catch up without a request, before
// delivering events, say.
func (s *Server) AdvanceBilling() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.advanceBillingLocked(s.now())
}

// advanceBillingLocked applies what is due at now in every account. s.mu
// must be held.
func (s *Server) advanceBillingLocked(now time.Time) {
	for _, a := range s.accounts {
		s.advanceAccountLocked(a, now)
	}
}

// advanceAccountLocked applies a's due renewals and finalizations one at a
// time, the earliest first (a renewal before a finalization due at the
// same time). s.mu must be held.
func (s *Server) advanceAccountLocked(a *account, now time.Time) {
	for {
		var due time.Time
		var renew *subscription
		var final *invoice
		found := false
		earlier := func(t time.Time) bool { return !t.After(now) && (!found || t.Before(due)) }
		for _, sub := range a.subs {
			if end := sub.periodEnd(); sub.status == SubscriptionActive && earlier(end) {
				renew, final, due, found = sub, nil, end, true
			}
		}
		for _, inv := range a.invoices {
			if inv.status == InvoiceDraft && inv.autoAdvance && earlier(inv.finalizesAt) {
				renew, final, due, found = nil, inv, inv.finalizesAt, true
			}
		}
		switch {
		case renew != nil:
			s.renewLocked(a, renew, due)
		case final != nil:
			s.finalizeLocked(a, final, due, nil)
		default:
			return
		}
	}
}

// renewLocked ends sub's current period at end: a draft invoice bills it,
// and the subscription either moves to its next period or, set to cancel
// at the period's end, is canceled: "Any metered usage is charged for in a
// final invoice when the subscription cancels at the end of the billing
// period" (Stripe's cancellation guide, as quoted by its readers). s.mu
// must be held.
func (s *Server) renewLocked(a *account, sub *subscription, end time.Time) {
	before := snapshot(sub.json(priceView{}))
	s.openInvoiceLocked(a, sub, billingReasonCycle, end, end, nil)
	if sub.cancelAtPeriodEnd {
		sub.status, sub.endedAt, sub.cancelReason = SubscriptionCanceled, end, "cancellation_requested"
		s.stopCollectionLocked(a, sub, end, nil)
		s.emitLocked(a, EventSubscriptionDeleted, sub.livemode, end, sub.json(priceView{}), nil, nil)
		return
	}
	sub.periodStart = end
	sub.periodIndex++
	for _, it := range sub.items {
		it.periodStart = end
	}
	after := sub.json(priceView{})
	s.emitLocked(a, EventSubscriptionUpdated, sub.livemode, end, after, previousAttributes(before, snapshot(after)), nil)
}

// openInvoiceLocked makes, at at, sub's draft invoice for the usage of its
// items until end (each from its own period start), and records
// invoice.created. s.mu must be held.
func (s *Server) openInvoiceLocked(a *account, sub *subscription, reason string, end, at time.Time, cause *http.Request) *invoice {
	inv := &invoice{
		id: randomID("in_", 24), livemode: sub.livemode, customer: sub.customer, subscription: sub.id,
		subMetadata: cloneMetadata(sub.metadata), currency: sub.currency, billingReason: reason, created: at,
		status: InvoiceDraft, autoAdvance: true, finalizesAt: at.Add(s.grace), periodStart: sub.periodStart,
		periodEnd: end, metadata: map[string]string{},
	}
	for _, it := range sub.items {
		inv.lines = append(inv.lines, &invoiceLine{id: randomID("il_", 24), item: it.id, price: it.price, start: it.periodStart, end: end})
	}
	a.computeLinesLocked(inv, at)
	a.invoices = append(a.invoices, inv)
	sub.latestInvoice = inv.id
	s.emitLocked(a, EventInvoiceCreated, inv.livemode, at, a.invoiceJSONLocked(inv), nil, cause)
	return inv
}

// finalizeLocked finalizes the draft inv at at: its lines recomputed from
// the usage received until then, status open, a number. s.mu must be
// held.
func (s *Server) finalizeLocked(a *account, inv *invoice, at time.Time, cause *http.Request) {
	a.computeLinesLocked(inv, at)
	inv.status, inv.finalizedAt = InvoiceOpen, at
	k := modeID{inv.livemode, inv.customer}
	a.invoiceNumbers[k]++
	inv.number = fmt.Sprintf("%s-%04d", invoicePrefix(inv.customer), a.invoiceNumbers[k])
	s.emitLocked(a, EventInvoiceFinalized, inv.livemode, at, a.invoiceJSONLocked(inv), nil, cause)
}

// stopCollectionLocked turns off auto_advance on the open invoices of
// sub's customer, as Stripe stops their automatic collection when a
// subscription is canceled. s.mu must be held.
func (s *Server) stopCollectionLocked(a *account, sub *subscription, at time.Time, cause *http.Request) {
	for _, inv := range a.invoices {
		if inv.livemode != sub.livemode || inv.customer != sub.customer || inv.status != InvoiceOpen || !inv.autoAdvance {
			continue
		}
		before := snapshot(a.invoiceJSONLocked(inv))
		inv.autoAdvance = false
		after := a.invoiceJSONLocked(inv)
		s.emitLocked(a, EventInvoiceUpdated, inv.livemode, at, after, previousAttributes(before, snapshot(after)), cause)
	}
}

// computeLinesLocked sets the quantity and amount of every line of inv
// from the usage received until cutoff. s.mu must be held.
func (a *account) computeLinesLocked(inv *invoice, cutoff time.Time) {
	for _, l := range inv.lines {
		formula := "sum"
		if m := a.findMeterLocked(inv.livemode, l.price.recurring.meter); m != nil {
			formula = m.Formula
		}
		l.quantity = a.usageLocked(l.price.recurring.meter, formula, inv.customer, inv.livemode, l.start, l.end, cutoff)
		l.amount = l.price.lineAmount(l.quantity)
		name := l.price.product
		if p := a.products[modeID{inv.livemode, l.price.product}]; p != nil && p.name != "" {
			name = p.name
		}
		l.description = fmt.Sprintf("%d × %s", l.quantity, name)
	}
}

// usageLocked aggregates, by formula, the customer's events of the meter
// and mode that are recorded (not dropped, not cancelled), have a
// timestamp in [start, end) and were received no later than cutoff. A
// negative result is 0: "If the overall cycle usage is negative, Stripe
// reports the invoice line item usage quantity as 0"
// (docs.stripe.com/billing/subscriptions/usage-based/recording-usage-api,
// "Usage values"). s.mu must be held.
func (a *account) usageLocked(meter, formula, customer string, livemode bool, start, end, cutoff time.Time) int64 {
	var sum int64
	var count int64
	var last *event
	for _, ev := range a.events {
		if ev.status != EventRecorded || ev.meter != meter || ev.customer != customer || ev.livemode != livemode ||
			ev.timestamp.Before(start) || !ev.timestamp.Before(end) || ev.received.After(cutoff) {
			continue
		}
		sum += ev.value
		count++
		if last == nil || laterEvent(ev, last) {
			last = ev
		}
	}
	q := sum
	switch formula {
	case "count":
		q = count
	case "last":
		q = 0
		if last != nil {
			q = last.value
		}
	}
	return max(q, 0)
}
