package reconcile

import (
	"context"
	"time"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// reconcileKey compares one key's hours and commits, in one transaction,
// its confirmations, its discrepancies and the run's cursor past it. A key
// whose summaries Stripe refuses with a 4xx about the key is one
// discrepancy (ReasonSummariesRefused) committed the same way, and no
// error: the run goes on to the next key. The key's Stripe calls are those
// made since start (its account's meters, read with its first key, count
// with that key).
func (r *Reconciler) reconcileKey(ctx context.Context, db DB, id int64, dest exporter.Destination, client *stripeapi.Client,
	byEvent map[string]stripeapi.Meter, k outbox.SettledKey, settle time.Duration, sinceTS, start int64) error {
	kh, err := r.readKeyHours(ctx, db, dest.Mode, k, settle, sinceTS)
	if err != nil {
		return err
	}
	out, err := r.compareKey(ctx, id, dest, client, byEvent, k, kh)
	if err != nil {
		return err
	}
	return r.commitKey(ctx, db, id, k, out, start)
}

// keyHours are the items of one key in its compared range [from, to), by
// hour.
type keyHours struct {
	from, to int64
	byHour   map[int64][]held
	hours    []int64 // the hours with items, in time order
}

// readKeyHours reads the items of key k that a comparison looks at — the
// accepted, confirmed and uncertain ones, and the pending and leased ones
// that hold their hour back — from its first hour (not before sinceTS) to
// the end of its last.
func (r *Reconciler) readKeyHours(ctx context.Context, db DB, mode outbox.Mode, k outbox.SettledKey,
	settle time.Duration, sinceTS int64) (keyHours, error) {
	kh := keyHours{from: max(k.Earliest-k.Earliest%hour, sinceTS), to: k.Latest - k.Latest%hour + hour, byHour: map[int64][]held{}}
	items, err := r.cfg.Outbox.KeyItems(ctx, db, outbox.KeyRange{OrderingKey: k.OrderingKey, Mode: mode, From: kh.from, To: kh.to,
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
			identifier: it.Identifier, cancels: it.Cancels})
	}
	return kh, nil
}

// keyOutcome is what the comparison of one key came to: the run's counts,
// the accepted items to confirm and the discrepancies to record.
type keyOutcome struct {
	compared, matched, skipped int
	confirm                    []int64
	found                      []Discrepancy
}

// compareKey reads the key's hourly summaries from Stripe and compares
// every hour worth comparing. A key whose event name no meter has any more
// has its hours skipped; a key whose summaries Stripe refuses is one
// discrepancy; any other failed read is the run's error.
func (r *Reconciler) compareKey(ctx context.Context, id int64, dest exporter.Destination, client *stripeapi.Client,
	byEvent map[string]stripeapi.Meter, k outbox.SettledKey, kh keyHours) (keyOutcome, error) {
	m, ok := byEvent[k.EventName]
	if !ok {
		// No meter has the event name any more, or (byEvent nil) Stripe
		// refused the key's connected account: nothing to read evidence
		// from. The hours are skipped, visibly in the run's totals, and the
		// next run looks again.
		if byEvent != nil {
			r.cfg.Logger.Warn("reconcile: no meter for an event name with accepted items", "event_name", k.EventName)
		}
		var out keyOutcome
		for _, h := range kh.hours {
			if worthComparing(kh.byHour[h]) {
				out.skipped++
			}
		}
		return out, nil
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
	return compareSummaries(dest, m, k, kh, summaries), nil
}

// refusedKeyOutcome is a key whose summaries Stripe refused (a customer or
// a meter it does not know): nothing of the key is compared; the key is a
// discrepancy of its own, with the items it holds, and the run goes on.
func (r *Reconciler) refusedKeyOutcome(id int64, dest exporter.Destination, m stripeapi.Meter, k outbox.SettledKey, kh keyHours,
	refusal outbox.ErrorInfo) keyOutcome {
	u := holdOver(m.Formula, kh.byHour, kh.hours)
	d := keyDiscrepancy(dest, m, k)
	d.Reason, d.ErrorCode, d.ErrorStatus = ReasonSummariesRefused, refusal.Code, refusal.Status
	d.Hour, d.Expected = time.Unix(kh.from, 0).UTC(), u.expected.String()
	d.ExpectedItems, d.UncertainItems, d.ExplainedBy, d.Explanation = u.counted, u.uncertain, []int64{}, ExplanationNotCompared
	r.cfg.Logger.Warn("reconcile: Stripe refused a key's summaries; the key is recorded as a discrepancy and the run goes on",
		"run", id, "event_name", k.EventName, "meter", m.ID, "error", refusal.String(), "hours", u.hours,
		"items", len(u.counted)+len(u.uncertain))
	return keyOutcome{skipped: u.skipped, found: []Discrepancy{d}}
}

// compareSummaries compares each hour of the key worth comparing with
// Stripe's summary of it: a match confirms the hour's accepted items, a
// mismatch is a discrepancy, and an hour with an item in flight or
// unsettled is skipped.
func compareSummaries(dest exporter.Destination, m stripeapi.Meter, k outbox.SettledKey, kh keyHours, summaries []stripeapi.Summary) keyOutcome {
	var out keyOutcome
	provider := map[int64]float64{}
	for _, s := range summaries {
		provider[s.Start] = s.Value
	}
	for _, h := range kh.hours {
		if !worthComparing(kh.byHour[h]) {
			continue // nothing this run would confirm or learn
		}
		value, inSummary := provider[h]
		v := compareHour(m.Formula, kh.byHour[h], value, inSummary)
		switch {
		case v.skip != "":
			out.skipped++
		case v.match:
			out.compared++
			out.matched++
			out.confirm = append(out.confirm, v.confirm...)
		default:
			out.compared++
			out.found = append(out.found, mismatch(dest, m, k, h, v))
		}
	}
	return out
}

// mismatch is the discrepancy of hour h of key k, whose verdict v is not a
// match.
func mismatch(dest exporter.Destination, m stripeapi.Meter, k outbox.SettledKey, h int64, v verdict) Discrepancy {
	d := keyDiscrepancy(dest, m, k)
	d.Reason, d.Hour, d.Expected = ReasonMismatch, time.Unix(h, 0).UTC(), v.expected.String()
	d.ExpectedItems, d.UncertainItems = nonNil(v.counted), nonNil(v.uncertain)
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
