package outbox_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// BenchmarkClaimAcceptBreakdown shows where a claim and an accept of 100
// spend their time: on one connection, over 20,000 enqueued items, it claims
// and accepts 100 at a time, 90 times per policy, and prints the fastest
// claim, the fastest accept and the fastest run of each statement sent on
// its own (the fastest, not the mean, so that a loaded machine disturbs it
// least): a BestEffort claim's statement goes with its BEGIN and COMMIT as
// one pipeline (claimTrip) and shows only as the whole claim. It prints
// figures only; docs/performance.md reads them.
//
//	go test ./outbox -run '^$' -bench ClaimAcceptBreakdown -benchtime 1x
func BenchmarkClaimAcceptBreakdown(b *testing.B) {
	for _, policy := range []outbox.Policy{outbox.BestEffort, outbox.PerKey} {
		claim, accept, stmts := breakdown(b, policy)
		fmt.Printf("\n%v, batch 100: fastest claim %v, fastest accept %v\n", policy, claim, accept)
		names := make([]string, 0, len(stmts))
		for n := range stmts {
			names = append(names, n)
		}
		sort.Strings(names)
		for _, n := range names {
			fmt.Printf("  %-48s %v\n", n, stmts[n])
		}
	}
}

// breakdown runs 90 claims and accepts of 100 under policy on a fresh
// database and returns the fastest of each and of each statement.
func breakdown(b *testing.B, policy outbox.Policy) (claim, accept time.Duration, stmts map[string]time.Duration) {
	b.Helper()
	ctx := context.Background()
	pool, store := enqueuedForBench(b, 20000)
	cfg, err := pgx.ParseConfig(testdb.URLOf(b, pool))
	if err != nil {
		b.Fatal(err)
	}
	tracer := &fastestTracer{fastest: map[string]time.Duration{}}
	cfg.Tracer = tracer
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(ctx)
	fastest := func(d *time.Duration, v time.Duration) {
		if *d == 0 || v < *d {
			*d = v
		}
	}
	for range 90 {
		start := time.Now()
		leases, err := store.Claim(ctx, conn, outbox.ClaimOptions{Owner: "breakdown", Limit: 100, Policy: policy})
		if err != nil || len(leases) != 100 {
			b.Fatalf("claim: %d leases, %v", len(leases), err)
		}
		claimed := time.Now()
		outcomes := make([]outbox.Outcome, len(leases))
		for i, l := range leases {
			outcomes[i] = outbox.Outcome{Lease: l, Kind: outbox.Accepted, ProviderRef: "req_bench"}
		}
		if _, err := store.Record(ctx, conn, outcomes); err != nil {
			b.Fatal(err)
		}
		fastest(&claim, claimed.Sub(start))
		fastest(&accept, time.Since(claimed))
	}
	return claim, accept, tracer.fastest
}

// fastestTracer keeps the fastest run of each statement, named by its first
// words.
type fastestTracer struct{ fastest map[string]time.Duration }

type traceStart struct {
	name string
	at   time.Time
}

type traceKey struct{}

func (f *fastestTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	words := strings.Fields(d.SQL)
	return context.WithValue(ctx, traceKey{}, traceStart{strings.Join(words[:min(5, len(words))], " "), time.Now()})
}

func (f *fastestTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	s, ok := ctx.Value(traceKey{}).(traceStart)
	if !ok {
		return
	}
	if d := time.Since(s.at); f.fastest[s.name] == 0 || d < f.fastest[s.name] {
		f.fastest[s.name] = d
	}
}
