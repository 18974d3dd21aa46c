package outbox

import (
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tallymeter/tally/internal/tenantbucket"
)

// quietGroups is what a Store's claims on a distributed database remember
// of the shard groups they found nothing in: a claim of an exporter passes
// over a group another claim of it found empty less than ClaimOptions.Quiet
// ago, and asks about the groups whose quiet lapsed in one read
// (sqlClaimProbe): an idle outbox costs that read per Quiet, not a
// transaction per group per claim of every loop. A notification naming a
// group's buckets (Stir) ends its quiet at once. It is a process's
// scheduling hint only, on the process's own clock: nothing in the
// database depends on it, and an item it passes over is claimed by a
// later claim.
type quietGroups struct {
	mu sync.Mutex
	// of is the placement the groups are numbered in; a new one starts
	// every group loud.
	of *tenantbucket.Shards
	// until is, per exporter filter and group, when the group may be
	// claimed from again.
	until map[quietKey]time.Time
}

type quietKey struct {
	exporter string
	group    int
}

// quiet reports whether claims of exporter pass over group g of shards.
func (q *quietGroups) quiet(shards *tenantbucket.Shards, exporter string, g int) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.of != shards {
		return false
	}
	until, ok := q.until[quietKey{exporter, g}]
	return ok && time.Now().Before(until)
}

// hush makes claims of exporter pass over group g of shards for d.
func (q *quietGroups) hush(shards *tenantbucket.Shards, exporter string, g int, d time.Duration) {
	if d <= 0 {
		return
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.of != shards {
		q.of, q.until = shards, make(map[quietKey]time.Time)
	}
	q.until[quietKey{exporter, g}] = time.Now().Add(d)
}

// lapsed takes the groups of shards whose quiet for claims of exporter
// has ended, for the probe (sqlClaimProbe) to ask about: they are quiet
// for another d meanwhile, so that the process's other claims pass over
// them instead of probing them at the same time.
func (q *quietGroups) lapsed(shards *tenantbucket.Shards, exporter string, d time.Duration) []int {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.of != shards {
		return nil
	}
	now := time.Now()
	var out []int
	for k, until := range q.until {
		if k.exporter == exporter && !now.Before(until) {
			out = append(out, k.group)
			q.until[k] = now.Add(d)
		}
	}
	slices.Sort(out)
	return out
}

// wake ends the quiet of group g of shards for claims of exporter.
func (q *quietGroups) wake(shards *tenantbucket.Shards, exporter string, g int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.of == shards {
		delete(q.until, quietKey{exporter, g})
	}
}

// stir ends the quiet of the groups of buckets, of every group if
// buckets is empty.
func (q *quietGroups) stir(buckets []int16) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(buckets) == 0 || q.of == nil {
		q.until = nil
		q.of = nil
		return
	}
	groups := make(map[int]bool, len(buckets))
	for _, b := range buckets {
		groups[q.of.GroupOf(b)] = true
	}
	for k := range q.until {
		if groups[k.group] {
			delete(q.until, k)
		}
	}
}

// Stir tells the Store's claims that items became pending in the buckets
// a notification named (NotifyChannel's payload; empty: anywhere), so
// that the next claim looks in their shard groups even if one found them
// empty a moment ago. Without it a group found empty is looked in again
// after ClaimOptions.Quiet.
func (s *Store) Stir(payload string) { s.quiet.stir(parseBuckets(payload)) }

// parseBuckets reads a notification's payload: buckets in decimal,
// separated by commas. A part that is not a bucket makes it name every
// bucket (nil).
func parseBuckets(payload string) []int16 {
	if payload == "" {
		return nil
	}
	parts := strings.Split(payload, ",")
	out := make([]int16, 0, len(parts))
	for _, p := range parts {
		b, err := strconv.ParseInt(p, 10, 16)
		if err != nil || b < 0 || b >= tenantbucket.Count {
			return nil
		}
		out = append(out, int16(b))
	}
	return out
}

// formatBuckets writes a notification's payload: the distinct buckets of
// bs, in ascending order.
func formatBuckets(bs []int16) string {
	bs = slices.Clone(bs)
	slices.Sort(bs)
	bs = slices.Compact(bs)
	out := make([]string, len(bs))
	for i, b := range bs {
		out[i] = strconv.Itoa(int(b))
	}
	return strings.Join(out, ",")
}
