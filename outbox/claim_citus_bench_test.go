package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// BenchmarkClaimCitusIdle is what a claim costs on a distributed database
// (32 shard groups) with nothing due: reading every group, one
// transaction each, against the probe that asks the lapsed quiet groups
// at once (ClaimOptions.Quiet). It needs `make citus`.
func BenchmarkClaimCitusIdle(b *testing.B) {
	ctx := context.Background()
	pool := testdb.NewDistributed(b)
	store, err := outbox.New(outbox.Config{}, nil)
	if err != nil {
		b.Fatal(err)
	}
	for _, policy := range []outbox.Policy{outbox.BestEffort, outbox.PerKey} {
		b.Run(policy.String()+"/every_group", func(b *testing.B) {
			for b.Loop() {
				if _, err := store.Claim(ctx, pool, outbox.ClaimOptions{Owner: "b", Limit: 10, Policy: policy}); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(policy.String()+"/probe", func(b *testing.B) {
			// Every group goes quiet, and its quiet lapses before each
			// claim: the claim is the probe alone.
			opts := outbox.ClaimOptions{Owner: "b", Limit: 10, Policy: policy, Quiet: 20 * time.Millisecond}
			store.Stir("")
			if _, err := store.Claim(ctx, pool, opts); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				b.StopTimer()
				time.Sleep(opts.Quiet)
				b.StartTimer()
				if _, err := store.Claim(ctx, pool, opts); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
