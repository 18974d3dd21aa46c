package api_test

import (
	"encoding/json"
	"fmt"
	"runtime"
	"testing"
	"time"
)

// BenchmarkIngestOneVsThreeNodes measures POST /v1/usage on one PostgreSQL
// server and on a Citus coordinator with two workers (`make citus`) on
// the same machine, both durable, the tables distributed by the tenant's
// bucket, in the same run: batches of one tenant (one shard group a
// request) and of four tenants (a request of four groups: a two-phase
// commit on Citus). The two are measured one after the other for each
// shape. On one machine the three nodes share its cores, and every
// request takes a hop more (Tally to the coordinator to a worker): the
// figure is what distribution costs, not what it gains, which is the
// capacity of more machines (docs/scale.md).
func BenchmarkIngestOneVsThreeNodes(b *testing.B) {
	const (
		events  = 100_000 // per shape and engine
		batch   = 500
		clients = 8
	)
	one := startDurableOn(b, nil, 0)
	three := startDurableOn(b, nil, 2)
	shapes := []int{1, 4} // tenants a request
	type result struct{ one, three float64 }
	results := map[int]result{}
	for _, tenants := range shapes {
		var r result
		for i, env := range []*benchEnv{one, three} {
			w := newTenantWorkload(b, fmt.Sprintf("t%d-e%d-", tenants, i), batch, events, tenants)
			checkpoint(b, env.pool)
			rate := benchAPI(b, env, w, clients)
			if i == 0 {
				r.one = rate
			} else {
				r.three = rate
			}
		}
		results[tenants] = r
	}
	for _, tenants := range shapes {
		r := results[tenants]
		b.ReportMetric(r.one, fmt.Sprintf("one_t%d_events/s", tenants))
		b.ReportMetric(r.three, fmt.Sprintf("three_t%d_events/s", tenants))
		b.ReportMetric(r.three/r.one, fmt.Sprintf("ratio_t%d", tenants))
	}
	fmt.Printf("\n%d events a shape and engine, batches of %d, %d clients; durable; %d CPUs\n", events, batch, clients, runtime.NumCPU())
	fmt.Printf("%-18s %16s %22s %8s\n", "tenants a request", "one server /s", "coordinator + 2 /s", "ratio")
	for _, tenants := range shapes {
		r := results[tenants]
		fmt.Printf("%-18d %16.0f %22.0f %7.2fx\n", tenants, r.one, r.three, r.three/r.one)
	}
	fmt.Println()
}

// newTenantWorkload makes n events, ids starting with prefix, in batches
// of batch events of tenants tenants each, the batches' tenants drawn in
// turn from 64, 3 features, timestamps within the last two hours.
func newTenantWorkload(b *testing.B, prefix string, batch, n, tenants int) *workload {
	b.Helper()
	w := &workload{batch: batch, prefix: prefix}
	base := time.Now().UTC().Add(-2 * time.Hour).Truncate(time.Second)
	for start, k := 0, 0; start < n; start, k = start+batch, k+1 {
		evs := make([]wireEvent, 0, batch)
		for i := start; i < min(start+batch, n); i++ {
			evs = append(evs, wireEvent{
				ID:        fmt.Sprintf("%s%07d", prefix, i),
				Tenant:    fmt.Sprintf("tenant-%d", (k*tenants+i%tenants)%64),
				Feature:   fmt.Sprintf("feature-%d", i%3),
				Value:     int64(i%100 + 1),
				Timestamp: base.Add(time.Duration(i) * 10 * time.Millisecond).Format(time.RFC3339Nano),
			})
		}
		body, err := json.Marshal(map[string]any{"events": evs})
		if err != nil {
			b.Fatal(err)
		}
		w.bodies = append(w.bodies, body)
		w.rows = append(w.rows, make([][]any, len(evs)))
	}
	return w
}
