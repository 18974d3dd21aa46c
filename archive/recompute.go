package archive

import (
	"cmp"
	"encoding/json"
	"fmt"
	"math/big"
	"slices"
	"time"

	"github.com/tallymeter/tally/quarantine"
)

// The completeness totals recomputed from an archive's own rows: the same
// rules as the report's query (quarantine's sqlCompleteness) in one merged
// pass over the ledger (ordered by item, then id) and the items' bodies and
// states (ordered by id). Every event is attributed to the state of the
// item that carries it now — the end of its item's chain of successors —
// in the billing period of the item it was staged into; an event cancelled
// as withdrawn counts as cancelled; every other cancelled event counts in
// its item's state and as cancelled, not twice (the report's cn/cv). Memory
// is the lines', the re-addressed items' and the period's cancellations',
// never the events'.

// itemInfo is what the totals need of an item's body and state.
type itemInfo struct {
	state          string
	next           int64 // superseded_by, 0 when none
	subjectKind    string
	mappingVersion int64
	value          *big.Rat
	period         string // RFC 3339 UTC, as the report writes it
	periodTime     time.Time
	late           bool
	account        string
}

// payloadFields are the payload keys the totals read.
type payloadFields struct {
	Period string      `json:"period"`
	Value  json.Number `json:"value"`
	Late   bool        `json:"late"`
}

func (it *itemInfo) setBody(r record) error {
	it.subjectKind = r.str("subject_kind")
	it.mappingVersion = r.int("mapping_version")
	it.account = r.str("destination_account")
	var p payloadFields
	if err := json.Unmarshal([]byte(r.str("payload")), &p); err != nil {
		return fmt.Errorf("item %d: payload: %w", r.int("id"), err)
	}
	v, ok := new(big.Rat).SetString(p.Value.String())
	if !ok {
		return fmt.Errorf("item %d: payload value %q", r.int("id"), p.Value)
	}
	it.value, it.late = v, p.Late
	t, err := time.Parse(time.RFC3339Nano, p.Period)
	if err != nil {
		return fmt.Errorf("item %d: payload period %q: %w", r.int("id"), p.Period, err)
	}
	it.periodTime = t.UTC()
	it.period = it.periodTime.Format(time.RFC3339)
	return nil
}

// rowSource yields the records of one archive file in order.
type rowSource interface {
	next() (record, bool, error)
}

// aggregations answers which aggregation a feature had at a mapping
// version: the latest version at or below it (feature_mapping_versions).
type aggregations map[string][]struct {
	version int64
	agg     string
}

func (a aggregations) at(feature string, version int64) string {
	out := ""
	for _, v := range a[feature] {
		if v.version <= version {
			out = v.agg
		}
	}
	return out
}

// bucketKey is one bucket of one line.
type bucketKey struct{ tenant, feature, period, state string }

type bucketSum struct {
	n, bad, lateN int64
	v, lateV      quarantine.Value
	accounts      []string
}

// totals accumulates buckets.
type totals struct {
	from, to time.Time
	buckets  map[bucketKey]*bucketSum
}

func (t *totals) add(k bucketKey, n int64, v quarantine.Value, bad bool, late bool, account string) {
	b := t.buckets[k]
	if b == nil {
		b = &bucketSum{}
		t.buckets[k] = b
	}
	b.n += n
	b.v = b.v.Plus(v)
	if bad {
		b.bad++
	}
	if late {
		b.lateN += n
		b.lateV = b.lateV.Plus(v)
	}
	if account != "" && !slices.Contains(b.accounts, account) {
		b.accounts = append(b.accounts, account)
	}
}

// group is the events of one item, tenant, feature and withdrawn-or-not.
type group struct {
	tenant, feature string
	gone            bool
	n, cn           int64
	v, cv           quarantine.Value
	lastValue       int64
	lastAt, lastID  int64
}

// recompute computes the completeness lines of the billing periods
// starting in [from, to) from an archive's files: events (ordered by
// item_id, id), bodies and states (each ordered by id, read twice: a first
// pass learns the re-addressed items' successors), the period's
// cancellations (event row to outcome) and the feature mapping versions.
func recompute(from, to time.Time, events rowSource, bodies, states func() (rowSource, error),
	cancels map[int64]string, aggs aggregations) ([]quarantine.Line, error) {
	// First pass: the chains. A successor is made after its predecessor,
	// so its id is larger: one ascending pass finds every link.
	chain := map[int64]*itemInfo{}
	need := map[int64]bool{}
	src, err := states()
	if err != nil {
		return nil, err
	}
	for {
		r, ok, err := src.next()
		if err != nil {
			return nil, err
		}
		if !ok {
			break
		}
		id := r.int("id")
		if r.str("state") == "superseded" || need[id] {
			it := &itemInfo{state: r.str("state"), next: r.int("superseded_by")}
			chain[id] = it
			if it.next != 0 {
				need[it.next] = true
			}
		}
	}
	src, err = bodies()
	if err != nil {
		return nil, err
	}
	for {
		r, ok, err := src.next()
		if err != nil {
			return nil, err
		}
		if !ok {
			break
		}
		if it := chain[r.int("id")]; it != nil && need[r.int("id")] {
			if err := it.setBody(r); err != nil {
				return nil, err
			}
		}
	}

	// The merged pass.
	bsrc, err := bodies()
	if err != nil {
		return nil, err
	}
	ssrc, err := states()
	if err != nil {
		return nil, err
	}
	bodyAt := merger{src: bsrc}
	stateAt := merger{src: ssrc}
	t := &totals{from: from, to: to, buckets: map[bucketKey]*bucketSum{}}
	var (
		run    []*group
		runID  int64
		inRun  bool
		finish = func() error {
			if !inRun {
				return nil
			}
			root := &itemInfo{}
			br, okB, err := bodyAt.seek(runID)
			if err != nil {
				return err
			}
			if okB {
				if err := root.setBody(br); err != nil {
					return err
				}
			}
			sr, okS, err := stateAt.seek(runID)
			if err != nil {
				return err
			}
			if okS {
				root.state, root.next = sr.str("state"), sr.int("superseded_by")
			}
			for _, g := range run {
				if err := t.addGroup(g, root, okB, okS, chain, aggs); err != nil {
					return err
				}
			}
			run, inRun = run[:0], false
			return nil
		}
	)
	for {
		r, ok, err := events.next()
		if err != nil {
			return nil, err
		}
		if !ok {
			break
		}
		if r.null("item_id") {
			return nil, fmt.Errorf("event row %d is not staged: an archive holds staged events only", r.int("id"))
		}
		item := r.int("item_id")
		if inRun && item < runID {
			return nil, fmt.Errorf("usage_events.parquet is not ordered by item_id at row %d", r.int("id"))
		}
		if !inRun || item != runID {
			if err := finish(); err != nil {
				return nil, err
			}
			runID, inRun = item, true
		}
		tenant, feature := r.str("tenant"), r.str("feature")
		cancel := ""
		if !r.null("cancelled_at") {
			cancel = cancels[r.int("id")]
			if cancel == "" {
				cancel = "withdrawn"
			}
		}
		gone := cancel == "withdrawn"
		var g *group
		for _, x := range run {
			if x.tenant == tenant && x.feature == feature && x.gone == gone {
				g = x
			}
		}
		if g == nil {
			g = &group{tenant: tenant, feature: feature, gone: gone, lastAt: -1 << 62}
			run = append(run, g)
		}
		value := r.int("value")
		g.n++
		g.v = g.v.Plus(quarantine.ValueOf(value))
		if cancel != "" {
			g.cn++
			g.cv = g.cv.Plus(quarantine.ValueOf(value))
		}
		at, id := r.int("occurred_at"), r.int("id")
		if at > g.lastAt || (at == g.lastAt && id > g.lastID) {
			g.lastAt, g.lastID, g.lastValue = at, id, value
		}
	}
	if err := finish(); err != nil {
		return nil, err
	}
	return t.lines(), nil
}

// addGroup attributes one group of events, of the item root (its body
// and state found or not), to its bucket, as the report's per_item and
// resolved parts do.
func (t *totals) addGroup(g *group, root *itemInfo, hasBody, hasState bool, chain map[int64]*itemInfo, aggs aggregations) error {
	if !hasBody {
		return nil // the report's period is NULL: outside every month
	}
	if root.periodTime.Before(t.from) || !root.periodTime.Before(t.to) {
		return nil
	}
	zero := quarantine.Value{}
	if g.gone {
		t.add(bucketKey{g.tenant, g.feature, root.period, "cancelled"}, g.n, g.v, false, false, "")
		return nil
	}
	state, live := "missing", (*itemInfo)(nil)
	if hasState {
		live = root
		for depth := 0; live.next != 0 && depth <= 1000; depth++ {
			live = chain[live.next]
			if live == nil || live.value == nil {
				live = nil
				break
			}
		}
		if live != nil && live.next == 0 {
			state = live.state
		} else {
			live = nil
		}
	}
	if live == nil {
		t.add(bucketKey{g.tenant, g.feature, root.period, state}, g.n, g.v, false, false, "")
		return nil
	}
	var consistent bool
	switch {
	case live.subjectKind == "usage_event":
		consistent = live.value.Cmp(ratOf(g.v)) == 0 && g.n == 1
	case aggs.at(g.feature, live.mappingVersion) == "last":
		consistent = live.value.Cmp(new(big.Rat).SetInt64(g.lastValue)) == 0
	default:
		consistent = live.value.Cmp(ratOf(g.v)) == 0
	}
	negCV := quarantine.ValueOf(0)
	if g.cv.Cmp(zero) != 0 {
		negCV = neg(g.cv)
	}
	t.add(bucketKey{g.tenant, g.feature, root.period, state}, g.n-g.cn, g.v.Plus(negCV), !consistent, live.late, live.account)
	if g.cn > 0 {
		t.add(bucketKey{g.tenant, g.feature, root.period, "cancelled"}, g.cn, g.cv, false, false, "")
	}
	return nil
}

func ratOf(v quarantine.Value) *big.Rat {
	r, _ := new(big.Rat).SetString(v.String())
	return r
}

func neg(v quarantine.Value) quarantine.Value {
	var out quarantine.Value
	_ = out.UnmarshalJSON([]byte(new(big.Int).Neg(mustInt(v)).String()))
	return out
}

func mustInt(v quarantine.Value) *big.Int {
	n, _ := new(big.Int).SetString(v.String(), 10)
	return n
}

// lines turns the buckets into report lines, as quarantine's readLines
// does, sorted by tenant, feature and period.
func (t *totals) lines() []quarantine.Line {
	index := map[[3]string]int{}
	var out []quarantine.Line
	keys := make([]bucketKey, 0, len(t.buckets))
	for k := range t.buckets {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b bucketKey) int {
		return cmp.Or(cmp.Compare(a.tenant, b.tenant), cmp.Compare(a.feature, b.feature), cmp.Compare(a.period, b.period),
			cmp.Compare(a.state, b.state))
	})
	for _, k := range keys {
		s := t.buckets[k]
		key := [3]string{k.tenant, k.feature, k.period}
		i, ok := index[key]
		if !ok {
			i = len(out)
			index[key] = i
			out = append(out, quarantine.Line{Tenant: k.tenant, Feature: k.feature, Period: k.period, Accounts: []string{}})
		}
		l := &out[i]
		b := quarantine.Bucket{Events: s.n, Value: s.v}
		l.Ingested = plus(l.Ingested, b)
		for _, a := range s.accounts {
			if !slices.Contains(l.Accounts, a) {
				l.Accounts = append(l.Accounts, a)
			}
		}
		slices.Sort(l.Accounts)
		switch k.state {
		case "confirmed":
			l.Confirmed = plus(l.Confirmed, b)
		case "accepted":
			l.Accepted = plus(l.Accepted, b)
		case "pending", "leased":
			l.Pending = plus(l.Pending, b)
		case "quarantined":
			l.Quarantined = plus(l.Quarantined, b)
		case "uncertain":
			l.Uncertain = plus(l.Uncertain, b)
		case "rejected":
			l.Rejected = plus(l.Rejected, b)
		case "cancelled":
			l.Cancelled = plus(l.Cancelled, b)
		}
		l.InconsistentItems += s.bad
		l.PeriodClosed = plus(l.PeriodClosed, quarantine.Bucket{Events: s.lateN, Value: s.lateV})
	}
	for i := range out {
		l := &out[i]
		sum := quarantine.Bucket{}
		for _, b := range []quarantine.Bucket{l.Confirmed, l.Accepted, l.Pending, l.Quarantined, l.Uncertain, l.Rejected, l.Cancelled} {
			sum = plus(sum, b)
		}
		l.Holds = sum.Events == l.Ingested.Events && sum.Value.Cmp(l.Ingested.Value) == 0 && l.InconsistentItems == 0
	}
	return out
}

func plus(a, b quarantine.Bucket) quarantine.Bucket {
	return quarantine.Bucket{Events: a.Events + b.Events, Value: a.Value.Plus(b.Value)}
}

// merger finds records by id in a source ordered by id.
type merger struct {
	src  rowSource
	cur  record
	has  bool
	done bool
}

// seek returns the record whose id is id, if any, moving only forward.
func (m *merger) seek(id int64) (record, bool, error) {
	for !m.done {
		if m.has {
			switch c := m.cur.int("id"); {
			case c == id:
				return m.cur, true, nil
			case c > id:
				return record{}, false, nil
			}
		}
		r, ok, err := m.src.next()
		if err != nil {
			return record{}, false, err
		}
		if !ok {
			m.done, m.has = true, false
			break
		}
		m.cur, m.has = r, true
	}
	return record{}, false, nil
}

// Differences lists where two completeness reports' totals differ, line by
// line (tenant, feature and period), in every bucket, the inconsistent
// items, the accounts and whether the line holds; the discrepancy counts,
// which come from reconcile's tables and not from the ledger, are not
// compared. Empty when they agree.
func Differences(a, b []quarantine.Line, aName, bName string) []string {
	type key = [3]string
	am, bm := map[key]quarantine.Line{}, map[key]quarantine.Line{}
	for _, l := range a {
		am[key{l.Tenant, l.Feature, l.Period}] = l
	}
	for _, l := range b {
		bm[key{l.Tenant, l.Feature, l.Period}] = l
	}
	var out []string
	for k, la := range am {
		lb, ok := bm[k]
		if !ok {
			out = append(out, fmt.Sprintf("%s/%s/%s: in %s only", k[0], k[1], k[2], aName))
			continue
		}
		if d := lineDiff(la, lb); d != "" {
			out = append(out, fmt.Sprintf("%s/%s/%s: %s (%s vs %s)", k[0], k[1], k[2], d, aName, bName))
		}
	}
	for k := range bm {
		if _, ok := am[k]; !ok {
			out = append(out, fmt.Sprintf("%s/%s/%s: in %s only", k[0], k[1], k[2], bName))
		}
	}
	slices.Sort(out)
	return out
}

func lineDiff(a, b quarantine.Line) string {
	buckets := []struct {
		name string
		x, y quarantine.Bucket
	}{{"ingested", a.Ingested, b.Ingested}, {"confirmed", a.Confirmed, b.Confirmed}, {"accepted", a.Accepted, b.Accepted},
		{"pending", a.Pending, b.Pending}, {"quarantined", a.Quarantined, b.Quarantined}, {"uncertain", a.Uncertain, b.Uncertain},
		{"rejected", a.Rejected, b.Rejected}, {"cancelled", a.Cancelled, b.Cancelled}, {"unstaged", a.Unstaged, b.Unstaged},
		{"period_closed", a.PeriodClosed, b.PeriodClosed}}
	for _, x := range buckets {
		if x.x.Events != x.y.Events || x.x.Value.Cmp(x.y.Value) != 0 {
			return fmt.Sprintf("%s %d/%s vs %d/%s", x.name, x.x.Events, x.x.Value, x.y.Events, x.y.Value)
		}
	}
	if a.InconsistentItems != b.InconsistentItems {
		return fmt.Sprintf("inconsistent items %d vs %d", a.InconsistentItems, b.InconsistentItems)
	}
	if !slices.Equal(a.Accounts, b.Accounts) {
		return fmt.Sprintf("accounts %v vs %v", a.Accounts, b.Accounts)
	}
	if a.Holds != b.Holds {
		return fmt.Sprintf("holds %v vs %v", a.Holds, b.Holds)
	}
	return ""
}
