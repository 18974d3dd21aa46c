package reconcile

import (
	"context"
	"slices"
	"time"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// reconcileKey compares one key's hours and commits, in one transaction,
// its confirmations, its discrepancies, the older discrepancies of the
// hours it compared (cleared), its open billing periods and the run's
// cursor past it. A key whose summaries Stripe refuses with a 4xx about the
// key is one discrepancy (ReasonSummariesRefused) committed the same way,
// and no error: the run goes on to the next key. The key's Stripe calls
// are those made since start (its account's meters, read with its first
// key, count with that key).
func (r *Reconciler) reconcileKey(ctx context.Context, db pgdb.DB, id int64, dest exporter.Destination, client *stripeapi.Client,
	byEvent map[string]stripeapi.Meter, k runKey, scope runScope, start int64) error {
	kh, err := r.readKeyHours(ctx, db, dest.Mode, k, scope.settle, scope.sinceTS)
	if err != nil {
		return err
	}
	out, err := r.compareKey(ctx, id, dest, client, byEvent, k, kh)
	if err != nil {
		return err
	}
	return r.commitKey(ctx, db, id, dest, k, kh, out, start)
}

// keyHours are the items of one key in its compared range [from, to), by
// hour.
type keyHours struct {
	from, to int64
	byHour   map[int64][]held
	hours    []int64 // the hours with items, in time order
	// candidates are the hours a comparison looks at, in time order: those
	// with a settled accepted item (to confirm) or an uncertain one (to
	// learn whether it landed), and every hour of an open billing period
	// with an item of the key.
	candidates []int64
	// periods are the billing periods of the items read.
	periods map[keyPeriod]bool
}

// readKeyHours reads the items of key k that a comparison looks at — the
// accepted, confirmed and uncertain ones, and the pending and leased ones
// that hold their hour back — over the hours the run reads of the key
// (runKey.hours): its settled items' and its open periods'.
func (r *Reconciler) readKeyHours(ctx context.Context, db pgdb.DB, mode outbox.Mode, k runKey,
	settle time.Duration, sinceTS int64) (keyHours, error) {
	kh := keyHours{byHour: map[int64][]held{}, periods: map[keyPeriod]bool{}}
	kh.from, kh.to = k.hours(sinceTS)
	if kh.from >= kh.to {
		return kh, nil
	}
	items, err := r.cfg.Outbox.KeyItems(ctx, db, outbox.KeyRange{OrderingKey: k.OrderingKey, Customer: k.Customer, Mode: mode, From: kh.from, To: kh.to,
		Settle: settle})
	if err != nil {
		return keyHours{}, err
	}
	for _, it := range items {
		h := it.Timestamp - it.Timestamp%hour
		if _, ok := kh.byHour[h]; !ok {
			kh.hours = append(kh.hours, h)
		}
		kh.byHour[h] = append(kh.byHour[h], held{id: it.ID, state: it.State, value: it.Value, ts: it.Timestamp, settled: it.Settled,
			identifier: it.Identifier, cancels: it.Cancels, meter: it.Meter})
		kh.periods[keyPeriod{tenant: it.Tenant, start: it.Period}] = true
	}
	for _, h := range kh.hours {
		if worthComparing(kh.byHour[h]) || k.inOpen(h) {
			kh.candidates = append(kh.candidates, h)
		}
	}
	return kh, nil
}

// keyOutcome is what the comparison of one key came to: the run's counts,
// the accepted items to confirm, the discrepancies to record, the hours it
// looked at (compared, or of an open period and empty on both sides: their
// older discrepancies are cleared) and whether it read the key's summaries
// (or had them refused: the key's older refusals are cleared).
type keyOutcome struct {
	compared, matched, skipped int
	confirm                    []int64
	found                      []Discrepancy
	looked                     []int64
	read                       bool
}

// compareKey reads the key's hourly summaries from Stripe and compares
// every hour worth comparing. A key whose event name no meter has any more
// has its hours skipped; a key whose summaries Stripe refuses is one
// discrepancy; any other failed read is the run's error.
func (r *Reconciler) compareKey(ctx context.Context, id int64, dest exporter.Destination, client *stripeapi.Client,
	byEvent map[string]stripeapi.Meter, k runKey, kh keyHours) (keyOutcome, error) {
	if kh.from >= kh.to {
		return keyOutcome{}, nil
	}
	m, ok := byEvent[k.EventName]
	if !ok {
		// No meter has the event name any more, or (byEvent nil) Stripe
		// refused the key's connected account: nothing to read evidence
		// from. The hours are skipped, visibly in the run's totals, and the
		// next run looks again.
		if byEvent != nil {
			r.cfg.Logger.Warn("reconcile: no meter for an event name with accepted items", "event_name", k.EventName)
		}
		return keyOutcome{skipped: len(kh.candidates)}, nil
	}
	var summaries []stripeapi.Summary
	err := r.read(ctx, func() (err error) {
		summaries, err = client.EventSummaries(ctx, m.ID, k.Customer, kh.from, kh.to, stripeapi.Hour)
		return err
	})
	if refusal, refused := refusedKey(ctx, err); refused {
		return r.refusedKeyOutcome(id, dest, m, k, kh, refusal), nil
	}
	if err != nil {
		return keyOutcome{}, err
	}
	// Items accepted for another meter of the event name (one deactivated
	// and replaced since) are compared with that meter's summaries over
	// their hours.
	for _, other := range kh.otherMeters(m.ID) {
		from, to := kh.rangeOf(other)
		var more []stripeapi.Summary
		err := r.read(ctx, func() (err error) {
			more, err = client.EventSummaries(ctx, other, k.Customer, from, to, stripeapi.Hour)
			return err
		})
		if refusal, refused := refusedKey(ctx, err); refused {
			return r.refusedKeyOutcome(id, dest, m, k, kh, refusal), nil
		}
		if err != nil {
			return keyOutcome{}, err
		}
		summaries = combineMeters(m.Formula, kh.byHour, m.ID, summaries, other, more)
	}
	return compareSummaries(dest, m, k, kh, summaries), nil
}

// otherMeters are the meters, other than the event name's meter def, that
// items of the key were accepted for, sorted.
func (kh keyHours) otherMeters(def string) []string {
	seen := map[string]bool{}
	var out []string
	for _, items := range kh.byHour {
		for _, it := range items {
			if it.meter != "" && it.meter != def && !seen[it.meter] {
				seen[it.meter] = true
				out = append(out, it.meter)
			}
		}
	}
	slices.Sort(out)
	return out
}

// rangeOf is the hours [from, to) of the key's items accepted for meter.
func (kh keyHours) rangeOf(meter string) (from, to int64) {
	for h, items := range kh.byHour {
		for _, it := range items {
			if it.meter == meter {
				if from == 0 || h < from {
					from = h
				}
				to = max(to, h+hour)
			}
		}
	}
	return from, to
}

// refusedKeyOutcome is a key whose summaries Stripe refused (a customer or
// a meter it does not know): nothing of the key is compared; the key is a
// discrepancy of its own, with the items it holds, and the run goes on.
func (r *Reconciler) refusedKeyOutcome(id int64, dest exporter.Destination, m stripeapi.Meter, k runKey, kh keyHours,
	refusal outbox.ErrorInfo) keyOutcome {
	u := holdOver(m.Formula, kh.byHour, kh.candidates, k.inOpen)
	if !k.settled && len(u.counted)+len(u.uncertain) == 0 {
		// Read for its open period alone, the key holds nothing Stripe
		// could count any more (its items left accepted since: an error
		// report named them): there is nothing to record.
		r.cfg.Logger.Warn("reconcile: Stripe refused the summaries of a key that holds nothing to compare; nothing is recorded",
			"run", id, "event_name", k.EventName, "meter", m.ID, "error", refusal.String())
		return keyOutcome{}
	}
	d := keyDiscrepancy(dest, m, k.SettledKey)
	d.Reason, d.ErrorCode, d.ErrorStatus = ReasonSummariesRefused, refusal.Code, refusal.Status
	d.Hour, d.Expected = time.Unix(kh.from, 0).UTC(), u.expected.String()
	d.ExpectedItems, d.UncertainItems, d.ExplainedBy, d.Explanation = u.counted, u.uncertain, []int64{}, ExplanationNotCompared
	r.cfg.Logger.Warn("reconcile: Stripe refused a key's summaries; the key is recorded as a discrepancy and the run goes on",
		"run", id, "event_name", k.EventName, "meter", m.ID, "error", refusal.String(), "hours", u.hours,
		"items", len(u.counted)+len(u.uncertain))
	return keyOutcome{skipped: u.skipped, found: []Discrepancy{d}, read: true}
}

// compareSummaries compares each hour of the key worth comparing with
// Stripe's summary of it: a match confirms the hour's accepted items (an
// hour of confirmed items alone, in an open period, changes nothing), a
// mismatch is a discrepancy, and an hour with an item in flight or
// unsettled is skipped. An hour of an open period with no item of the key
// is compared too when Stripe's summary of it has a value other than 0:
// Stripe has more than Tally sent. (A summary of 0 there is read as none:
// whether Stripe lists hours without events, with 0, is not documented.)
func compareSummaries(dest exporter.Destination, m stripeapi.Meter, k runKey, kh keyHours, summaries []stripeapi.Summary) keyOutcome {
	out := keyOutcome{read: true}
	provider := map[int64]float64{}
	for _, s := range summaries {
		provider[s.Start] = s.Value
	}
	skipped := map[int64]bool{}
	verdicts := map[int64]verdict{}
	for _, h := range kh.candidates {
		value, inSummary := provider[h]
		verdicts[h] = compareHour(m.Formula, kh.byHour[h], value, inSummary, k.inOpen(h))
	}
	for h, value := range provider {
		if len(kh.byHour[h]) == 0 && k.inOpen(h) && value != 0 {
			verdicts[h] = compareHour(m.Formula, nil, value, true, true)
		}
	}
	hours := make([]int64, 0, len(verdicts))
	for h := range verdicts {
		hours = append(hours, h)
	}
	slices.Sort(hours)
	for _, h := range hours {
		v := verdicts[h]
		switch {
		case v.skip != "":
			out.skipped++
			skipped[h] = true
			continue
		case v.match:
			out.matched++
			out.confirm = append(out.confirm, v.confirm...)
		default:
			out.found = append(out.found, mismatch(dest, m, k.SettledKey, h, v))
		}
		out.compared++
		if !k.inOpen(h) {
			out.looked = append(out.looked, h)
		}
	}
	// Every hour of the open periods that was not skipped was looked at:
	// compared, or empty on both sides (no item, no number of Stripe's).
	for _, s := range k.open {
		for h := max(s.from, kh.from); h < min(s.to, kh.to); h += hour {
			if !skipped[h] {
				out.looked = append(out.looked, h)
			}
		}
	}
	return out
}

// mismatch is the discrepancy of hour h of key k, whose verdict v is not a
// match.
func mismatch(dest exporter.Destination, m stripeapi.Meter, k outbox.SettledKey, h int64, v verdict) Discrepancy {
	d := keyDiscrepancy(dest, m, k)
	d.Reason, d.Hour, d.Expected = ReasonMismatch, time.Unix(h, 0).UTC(), v.expected.String()
	d.ExpectedItems, d.UncertainItems, d.ConfirmedItems = nonNil(v.counted), nonNil(v.uncertain), nonNil(v.confirmed)
	d.ExplainedBy, d.Explanation = nonNil(v.explainedBy), v.explanation
	if v.provider != nil {
		p, diff := v.providerText, v.differenceText()
		d.Provider, d.Difference = &p, &diff
	}
	return d
}

// keyDiscrepancy is a discrepancy of key k at meter m, with what names
// them filled in.
func keyDiscrepancy(dest exporter.Destination, m stripeapi.Meter, k outbox.SettledKey) Discrepancy {
	return Discrepancy{Account: dest.Account, Mode: string(dest.Mode), EventName: k.EventName, Meter: m.ID,
		Customer: k.Customer, Formula: m.Formula}
}

func nonNil(s []int64) []int64 {
	if s == nil {
		return []int64{}
	}
	return s
}
