package outbox

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// citusItem is an eligible window item of tenant, numbered n.
func citusItem(tenant string, n int) NewItem {
	return NewItem{
		Identity: Identity{TenantKey: tenant, SubjectKind: SubjectUsageWindow,
			SubjectRef: fmt.Sprintf("usage:api_calls:2026-11-01T00:00:00Z:2026-11-30T00:00:00Z:2026-11-30T01:00:00Z#%d", n),
			Exporter:   "stripe_meter_events", DestinationAccount: "acct_123", Mode: ModeTest, MappingVersion: 1},
		Payload: Payload{Customer: "cus_" + tenant, EventName: "api_calls", Value: int64(n) + 1, Timestamp: 1796000000,
			Feature: "api_calls", Period: "2026-11-01T00:00:00Z"},
	}
}

// tenantsOfGroups returns a tenant of each of the first n shard groups.
func tenantsOfGroups(t *testing.T, shards *tenantbucket.Shards, n int) []string {
	t.Helper()
	require.GreaterOrEqual(t, shards.Groups(), n)
	out, found := make([]string, n), 0
	for i := 0; found < n; i++ {
		name := fmt.Sprintf("tenant-%d", i)
		if g := shards.GroupOf(tenantbucket.Of(name)); g < n && out[g] == "" {
			out[g], found = name, found+1
		}
	}
	return out
}

// insertMethod is the INSERT … SELECT method of sql's plan on a Citus
// coordinator, and the task counts of any distributed job it holds.
func insertMethod(t *testing.T, db *pgxpool.Pool, sql string, args ...any) (method string, jobs int) {
	t.Helper()
	var plan []map[string]any
	require.NoError(t, db.QueryRow(t.Context(), "EXPLAIN (FORMAT JSON, COSTS OFF) "+sql, args...).Scan(&plan))
	for _, n := range testdb.PlanNodes(plan[0]["Plan"]) {
		if m, ok := n["INSERT/SELECT method"].(string); ok {
			method = m
		}
		if q, ok := n["Distributed Query"].(map[string]any); ok && q["Job"] != nil {
			jobs++
		}
	}
	return method, jobs
}

// The enqueue's statements on a distributed database, with one shard
// group's items: the bodies and the states are INSERT … SELECT from
// unnest, which Citus evaluates on the coordinator and copies to the one
// shard of their rows ("pull to coordinator", no distributed job: no
// subplan, no other shard); the read of an existing item is one task.
func TestEnqueuePlansOnCitus(t *testing.T) {
	t.Parallel()
	pool := testdb.NewDistributed(t)
	shards, err := tenantbucket.ReadShards(t.Context(), pool)
	require.NoError(t, err)
	tenant := tenantsOfGroups(t, shards, 1)[0]
	it := citusItem(tenant, 1)
	require.NoError(t, it.validate())
	args := enqueueArgs([]NewItem{it}, []State{StatePending})

	method, jobs := insertMethod(t, pool, sqlEnqueueBodies, args)
	require.Equal(t, "pull to coordinator", method, "the bodies")
	require.Zero(t, jobs, "the bodies")
	method, jobs = insertMethod(t, pool, sqlEnqueueStates, pgx.NamedArgs{"ids": []int64{1}, "exporters": []string{it.Exporter},
		"modes": []string{string(it.Mode)}, "keys": []string{"acct_123|cus_x|api_calls"}, "created": []string{"2026-12-06T00:00:00Z"},
		"states": []string{string(StatePending)}, "reasons": []*string{nil}, "buckets": []int16{tenantbucket.Of(tenant)}})
	require.Equal(t, "pull to coordinator", method, "the states")
	require.Zero(t, jobs, "the states")

	id := it.Identity
	require.Equal(t, []int{1}, testdb.CitusTasks(t, pool, sqlEnqueueExisting, id.TenantKey, id.SubjectKind, id.SubjectRef,
		id.Exporter, id.DestinationAccount, string(id.Mode), id.MappingVersion, it.Payload, tenantbucket.Of(tenant)))
}

// Enqueue and EnqueueBatch on a distributed database, a batch of items of
// tenants in several shard groups: every item has its body and its state,
// an identity enqueued again lands on the existing item, and the
// transaction holds an id on the coordinator before it commits (the
// gauge's watermark waits for it) — as on one server.
func TestEnqueueOnCitus(t *testing.T) {
	t.Parallel()
	dist := testdb.NewDistributed(t)
	shards, err := tenantbucket.ReadShards(t.Context(), dist)
	require.NoError(t, err)
	tenants := tenantsOfGroups(t, shards, 3)
	for name, pool := range map[string]*pgxpool.Pool{"one server": testdb.New(t), "distributed": dist} {
		t.Run(name, func(t *testing.T) {
			ctx := t.Context()
			s, err := New(Config{}, nil)
			require.NoError(t, err)
			var items []NewItem
			for n := range 9 {
				it := citusItem(tenants[n%3], n)
				if n == 4 {
					it.Quarantine = ReasonNoCustomer
				}
				items = append(items, it)
			}
			var first []Enqueued
			require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				var assigned bool
				require.NoError(t, tx.QueryRow(ctx, `SELECT pg_current_xact_id_if_assigned() IS NOT NULL`).Scan(&assigned))
				require.False(t, assigned)
				first, err = s.EnqueueBatch(ctx, tx, items)
				require.NoError(t, err)
				require.NoError(t, tx.QueryRow(ctx, `SELECT pg_current_xact_id_if_assigned() IS NOT NULL`).Scan(&assigned))
				require.True(t, assigned, "the transaction holds an id on the coordinator")
				one, err := s.Enqueue(ctx, tx, citusItem(tenants[1], 100))
				require.NoError(t, err)
				require.True(t, one.Inserted)
				return nil
			}))
			for i, e := range first {
				require.True(t, e.Inserted, i)
				require.Equal(t, items[i].Payload.Identifier, e.Identifier)
				want := StatePending
				if i == 4 {
					want = StateQuarantined
				}
				require.Equal(t, want, e.State, i)
			}
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox_items`).Scan(&n))
			require.Equal(t, 10, n, "every body has its state row")

			require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				again, err := s.EnqueueBatch(ctx, tx, items)
				require.NoError(t, err)
				for i, e := range again {
					require.Equal(t, Enqueued{ID: first[i].ID, Identifier: first[i].Identifier, State: first[i].State,
						SamePayload: true}, e, i)
				}
				changed := citusItem(tenants[2], 2)
				changed.Payload.Value = 77
				one, err := s.Enqueue(ctx, tx, changed)
				require.NoError(t, err)
				require.Equal(t, Enqueued{ID: first[2].ID, Identifier: first[2].Identifier, State: StatePending}, one)
				return nil
			}))
		})
	}
}
