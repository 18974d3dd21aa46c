package reconcile

import (
	"cmp"
	"math"
	"math/big"
	"slices"
	"strconv"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// held is one item of a key as the comparison sees it.
type held struct {
	id      int64
	state   outbox.State
	value   int64
	ts      int64 // the event timestamp, Unix seconds
	settled bool  // accepted longer ago than the settle delay
	// identifier is the item's; cancels, on a cancellation (a meter event
	// adjustment, which shares its event's key and hour), the identifier of
	// the event it cancels.
	identifier, cancels string
	// meter is the provider's meter the item was accepted for; empty when
	// not recorded (the event name's meter, then).
	meter string
}

// later orders items as a last meter does: by event time, then by id (the
// order they were staged, and so sent).
func later(a, b held) bool { return a.ts > b.ts || (a.ts == b.ts && a.id > b.id) }

// verdict is what one hour of one key came to.
type verdict struct {
	// skip is why the hour was not compared ("" when it was).
	skip string
	// match: the accepted items of the hour may be confirmed.
	match    bool
	confirm  []int64 // the hour's accepted items, on a match
	expected *big.Int
	// provider is Stripe's value; nil for a last meter with no event in
	// the hour. providerText is it as Stripe sent it.
	provider     *big.Float
	providerText string
	counted      []int64 // accepted and confirmed items: what Tally expects
	confirmed    []int64 // those of counted confirmed already: Stripe's number had matched
	uncertain    []int64
	explainedBy  []int64
	explanation  string
}

// Skip reasons.
const (
	skipInFlight  = "in_flight" // an item of the hour is pending or leased
	skipUnsettled = "unsettled" // an accepted item of the hour is younger than the settle delay
	skipNothing   = "nothing"   // no accepted or uncertain item, and the period closed: nothing to learn
)

// maxSubset bounds the uncertain items whose subsets are searched for an
// explanation of a sum's difference (2^maxSubset sums).
const maxSubset = 20

// compareHour compares the items of one hour of one key with Stripe's
// summary of it (found false: no summary, i.e. no event in the hour), by
// the meter's formula. An hour of an open billing period (open) is
// compared even when all its items are confirmed, or it has none.
func compareHour(formula string, items []held, summary float64, found, open bool) verdict {
	var v verdict
	skip, accepted, counted, uncertain := classify(items, open)
	if skip != "" {
		return verdict{skip: skip}
	}
	for _, it := range counted {
		v.counted = append(v.counted, it.id)
		if it.state == outbox.StateConfirmed {
			v.confirmed = append(v.confirmed, it.id)
		}
	}
	for _, it := range uncertain {
		v.uncertain = append(v.uncertain, it.id)
	}

	if found {
		v.provider = new(big.Float).SetFloat64(summary)
		v.providerText = strconv.FormatFloat(summary, 'f', -1, 64)
	} else if formula != "last" {
		// Sum and count of no events: zero.
		v.provider = new(big.Float)
		v.providerText = "0"
	}

	var last held
	v.expected, last = expectedOf(formula, counted)

	if formula == "last" && len(counted) == 0 {
		// Only uncertain items: a match is no event at all.
		if v.provider == nil {
			v.match = true
			return v
		}
	} else if v.provider != nil && v.provider.Cmp(new(big.Float).SetInt(v.expected)) == 0 {
		v.match = true
		for _, it := range accepted {
			v.confirm = append(v.confirm, it.id)
		}
		return v
	}

	v.explanation = "unexplained"
	diff, whole := v.difference()
	switch formula {
	case "sum":
		if whole && diff.IsInt64() && len(uncertain) > 0 && len(uncertain) <= maxSubset {
			if set, n := subsetSum(uncertain, diff.Int64()); n == 1 {
				v.explanation, v.explainedBy = "explained", set
			} else if n > 1 {
				v.explanation = "ambiguous"
			}
		} else if whole && len(uncertain) > maxSubset {
			v.explanation = "ambiguous" // too many to tell which
		}
	case "count":
		if whole && diff.IsInt64() && diff.Sign() > 0 {
			switch k := diff.Int64(); {
			case k == int64(len(uncertain)):
				v.explanation, v.explainedBy = "explained", ids(uncertain)
			case k < int64(len(uncertain)):
				v.explanation = "ambiguous" // some of them landed; which cannot be told
			}
		}
	case "last":
		// The provider's last value is that of the latest event that
		// landed: the latest uncertain item later than Tally's last with
		// that value explains it.
		if v.provider != nil {
			var best *held
			for i, it := range uncertain {
				if later(it, last) && new(big.Float).SetInt64(it.value).Cmp(v.provider) == 0 && (best == nil || later(it, *best)) {
					best = &uncertain[i]
				}
			}
			if best != nil {
				v.explanation, v.explainedBy = "explained", []int64{best.id}
			}
		}
	}
	return v
}

// classify sorts one hour's items for a comparison: the settled accepted
// ones (which a match confirms), the accepted and confirmed ones (which
// Tally counts) and the uncertain ones; or says why the hour is skipped.
// An hour of a closed billing period with nothing accepted or uncertain
// is skipped (nothing to learn); one of an open period (open) is not: its
// confirmed items are compared again.
func classify(items []held, open bool) (skip string, accepted, counted, uncertain []held) {
	// Cancellations first. No answer to one is proof (docs/stripe.md):
	// the event an accepted or confirmed cancellation names is expected
	// absent, and a match confirms the cancellation too; one pending or
	// leased holds the hour back; one uncertain or quarantined (a 4xx Tally
	// cannot read) leaves its event in doubt, like an uncertain item.
	gone, doubt := map[string]bool{}, map[string]bool{}
	for _, it := range items {
		if skip := heldBack(it); skip != "" {
			return skip, nil, nil, nil
		}
		if it.cancels == "" {
			continue
		}
		switch it.state {
		case outbox.StateAccepted:
			accepted = append(accepted, it)
			gone[it.cancels] = true
		case outbox.StateConfirmed:
			gone[it.cancels] = true
		default:
			doubt[it.cancels] = true
		}
	}
	for _, it := range items {
		if it.cancels != "" {
			continue
		}
		switch it.state {
		case outbox.StateAccepted:
			accepted = append(accepted, it)
		case outbox.StateConfirmed:
		case outbox.StateUncertain:
			if !gone[it.identifier] {
				uncertain = append(uncertain, it)
			}
			continue
		default:
			continue
		}
		switch {
		case gone[it.identifier]:
		case doubt[it.identifier]:
			uncertain = append(uncertain, it)
		default:
			counted = append(counted, it)
		}
	}
	if !open && len(accepted) == 0 && len(uncertain) == 0 {
		return skipNothing, nil, nil, nil
	}
	return "", accepted, counted, uncertain
}

// heldBack is why an item keeps its hour out of a comparison: in flight
// (pending or leased), or accepted but not settled; "" when it does not.
func heldBack(it held) string {
	switch {
	case it.state == outbox.StatePending || it.state == outbox.StateLeased:
		return skipInFlight
	case it.state == outbox.StateAccepted && !it.settled:
		return skipUnsettled
	}
	return ""
}

// expectedOf is what Stripe should hold for the counted items by the
// meter's formula, and for last the item that gives it (ts MinInt64 when
// none: nothing is expected when only uncertain items are).
func expectedOf(formula string, counted []held) (*big.Int, held) {
	last := held{ts: math.MinInt64}
	switch formula {
	case "count":
		return big.NewInt(int64(len(counted))), last
	case "last":
		for i, it := range counted {
			if i == 0 || later(it, last) {
				last = it
			}
		}
		if len(counted) > 0 {
			return big.NewInt(last.value), last
		}
		return new(big.Int), last
	}
	sum := new(big.Int)
	for _, it := range counted {
		sum.Add(sum, big.NewInt(it.value))
	}
	return sum, last
}

// uncompared is what Tally holds over the hours of a key whose summaries
// Stripe refused: the hours that would have been compared, their items,
// and the value expected over them all by the meter's formula (for last,
// the latest item's); and how many hours would have been skipped anyway.
type uncompared struct {
	hours, skipped     int
	expected           *big.Int
	counted, uncertain []int64 // ascending
}

// holdOver sums up the given hours of a key (each with its items, those of
// an open period said by open) as a run that could read no summary of the
// key sees them: the hours a comparison would skip (an item in flight or
// unsettled) are left out, and the rest give the items involved and what
// Tally expects.
func holdOver(formula string, byHour map[int64][]held, hours []int64, open func(int64) bool) uncompared {
	var (
		u       uncompared
		counted []held
	)
	u.counted, u.uncertain = []int64{}, []int64{}
	for _, h := range hours {
		skip, _, c, unc := classify(byHour[h], open(h))
		if skip == skipNothing {
			continue // nothing this run would confirm or learn
		}
		if skip != "" {
			u.skipped++
			continue
		}
		u.hours++
		counted = append(counted, c...)
		for _, it := range c {
			u.counted = append(u.counted, it.id)
		}
		for _, it := range unc {
			u.uncertain = append(u.uncertain, it.id)
		}
	}
	u.expected, _ = expectedOf(formula, counted)
	slices.Sort(u.counted)
	slices.Sort(u.uncertain)
	return u
}

// difference is provider - expected, and whether it is a whole number; nil
// when the provider has no value.
func (v verdict) difference() (*big.Int, bool) {
	if v.provider == nil {
		return nil, false
	}
	d := new(big.Float).Sub(v.provider, new(big.Float).SetInt(v.expected))
	i, acc := d.Int(nil)
	return i, acc == big.Exact
}

// differenceText renders the difference for the record; "" without one.
func (v verdict) differenceText() string {
	if v.provider == nil {
		return ""
	}
	d := new(big.Float).Sub(v.provider, new(big.Float).SetInt(v.expected))
	if i, acc := d.Int(nil); acc == big.Exact {
		return i.String()
	}
	f, _ := d.Float64()
	return strconv.FormatFloat(f, 'f', -1, 64)
}

// subsetSum finds the subsets of items whose values sum to target: the
// first one found (ids ascending) and how many there are, counting to 2.
// The empty set does not count.
func subsetSum(items []held, target int64) ([]int64, int) {
	var found []int64
	n := 0
	total := 1 << len(items)
	for mask := 1; mask < total && n < 2; mask++ {
		var sum int64
		overflow := false
		for i, it := range items {
			if mask&(1<<i) != 0 {
				if (it.value > 0 && sum > math.MaxInt64-it.value) || (it.value < 0 && sum < math.MinInt64-it.value) {
					overflow = true
					break
				}
				sum += it.value
			}
		}
		if overflow || sum != target {
			continue
		}
		n++
		if found == nil {
			for i, it := range items {
				if mask&(1<<i) != 0 {
					found = append(found, it.id)
				}
			}
			slices.Sort(found)
		}
	}
	return found, n
}

func ids(items []held) []int64 {
	out := make([]int64, len(items))
	for i, it := range items {
		out[i] = it.id
	}
	slices.Sort(out)
	return out
}

// worthComparing: an hour with a settled accepted item (to confirm) or an
// uncertain one (to learn whether it landed).
func worthComparing(items []held) bool {
	for _, it := range items {
		if (it.state == outbox.StateAccepted && it.settled) || it.state == outbox.StateUncertain {
			return true
		}
	}
	return false
}

// combineMeters folds the summaries of meter other, a meter of the event
// name that some of the key's items were accepted for, into sums, the
// summaries of def, the event name's meter: what Stripe counted of the
// key in each hour. A sum or a count adds up over the meters, since each
// event reached one of them. A last meter's hour is the value of the
// meter its latest counted item was accepted for (an item naming no meter
// is def's).
func combineMeters(formula string, byHour map[int64][]held, def string, sums []stripeapi.Summary, other string, more []stripeapi.Summary) []stripeapi.Summary {
	value := map[int64]float64{}
	for _, s := range sums {
		value[s.Start] = s.Value
	}
	if formula != "last" {
		for _, s := range more {
			value[s.Start] += s.Value
		}
	} else {
		theirs := map[int64]float64{}
		for _, s := range more {
			theirs[s.Start] = s.Value
		}
		for h, items := range byHour {
			latest, ok := latestCounted(items)
			if !ok || latest.meter != other {
				continue
			}
			if v, found := theirs[h]; found {
				value[h] = v
			} else {
				delete(value, h)
			}
		}
	}
	out := make([]stripeapi.Summary, 0, len(value))
	for h, v := range value {
		out = append(out, stripeapi.Summary{Start: h, End: h + hour, Value: v})
	}
	slices.SortFunc(out, func(a, b stripeapi.Summary) int { return cmp.Compare(a.Start, b.Start) })
	return out
}

// latestCounted is the latest accepted or confirmed item of an hour that is
// not a cancellation: the one a last meter's value comes from.
func latestCounted(items []held) (held, bool) {
	var latest held
	found := false
	for _, it := range items {
		if it.cancels != "" || (it.state != outbox.StateAccepted && it.state != outbox.StateConfirmed) {
			continue
		}
		if !found || later(it, latest) {
			latest, found = it, true
		}
	}
	return latest, found
}
