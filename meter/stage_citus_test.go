package meter

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
)

// tenantsOfGroups returns, for each of the first n shard groups, a tenant
// whose bucket is in it.
func tenantsOfGroups(t *testing.T, shards *tenantbucket.Shards, n int) []string {
	t.Helper()
	require.GreaterOrEqual(t, shards.Groups(), n)
	out := make([]string, n)
	for i := 0; ; i++ {
		name := fmt.Sprintf("tenant-%d", i)
		if g := shards.GroupOf(tenantbucket.Of(name)); g < n && out[g] == "" {
			out[g] = name
		}
		done := true
		for _, x := range out {
			done = done && x != ""
		}
		if done {
			return out
		}
	}
}

// Every staging statement that reads, locks or marks the ledger, given one
// shard group's buckets (and a tenant of it), is one task on one shard;
// the list of what is unstaged reads the shards of the groups it names.
func TestStagingPlansOnCitus(t *testing.T) {
	t.Parallel()
	pool := testdb.NewDistributed(t)
	ctx := t.Context()
	shards, err := tenantbucket.ReadShards(ctx, pool)
	require.NoError(t, err)
	require.True(t, shards.Distributed())
	group := shards.Buckets(0)
	tenant := tenantsOfGroups(t, shards, 1)[0]
	other := "other"
	for i := 0; shards.GroupOf(tenantbucket.Of(other)) != 0 || other == tenant; i++ {
		other = fmt.Sprintf("other-%d", i)
	}
	b, ob := tenantbucket.Of(tenant), tenantbucket.Of(other)
	from := time.Now().UTC().Truncate(time.Hour).Add(-3 * time.Hour)
	to := from.Add(time.Hour)
	for name, q := range map[string]struct {
		sql  string
		args []any
	}{
		"unstaged of a shard": {sqlUnstagedOfShard, []any{group}},
		"batch buckets": {sqlBatchBucketsOnShard, []any{pgx.NamedArgs{"tenants": []string{tenant, other}, "features": []string{"f1", "f2"},
			"widths": []time.Duration{time.Hour, time.Hour}, "tbuckets": []int16{b, ob}, "buckets": group,
			"grace": time.Minute, "origin": gridOrigin}}},
		"batch rows": {sqlBatchRowsOnShard, []any{pgx.NamedArgs{"tenants": []string{tenant, other}, "features": []string{"f1", "f2"},
			"froms": []time.Time{from, from}, "tos": []time.Time{to, to}, "tbuckets": []int16{b, ob}, "buckets": group,
			"grace": time.Minute}}},
		"group buckets": {sqlGroupBuckets, []any{pgx.NamedArgs{"width": time.Hour, "origin": gridOrigin, "tenant": tenant,
			"feature": "f1", "bucket": b}}},
		"event rows": {sqlEventRows, []any{pgx.NamedArgs{"tenant": tenant, "bucket": b, "feature": "f1", "wait": true,
			"origin": gridOrigin, "grace": time.Minute, "future": 5 * time.Minute, "limit": perEventBatch}}},
		"window rows": {sqlWindowRows, []any{pgx.NamedArgs{"tenant": tenant, "bucket": b, "feature": "f1", "from": from,
			"to": to, "grace": time.Minute}}},
		"absorb late":      {sqlAbsorbLateOnShard, []any{tenant, "f1", from, to, []int64{1, 2}, outbox.SubjectUsageWindow, "usage:f1:x", b}},
		"split rows":       {sqlSplitRows, []any{[]int64{1, 2, 3}, b}},
		"mark event rows":  {sqlMarkEventRows, []any{[]int64{1, 2}, []int64{7, 8}, b}},
		"mark closed rows": {sqlMarkClosedRows, []any{[]int64{1, 2}, []int64{7, 7}, b, to, time.Minute}},
		"mark window rows": {sqlMarkWindowRows, []any{pgx.NamedArgs{"rows": []int64{1, 2}, "items": []int64{7, 7},
			"buckets": []int16{b, ob}, "from": from, "to": to, "grace": time.Minute}}},
	} {
		require.Equal(t, []int{1}, testdb.CitusTasks(t, pool, q.sql, q.args...), name)
	}
	// A pass lists the unstaged usage of every group it owns in one read
	// of their shards, one task each.
	require.Equal(t, []int{shards.Groups()}, testdb.CitusTasks(t, pool, sqlUnstagedOfShard, tenantbucket.All()))
}

// stagingEnv is a stager, an outbox and mappings on pool, addressed as
// stagetest addresses its items.
type stagingEnv struct {
	pool   *pgxpool.Pool
	stager *Stager
}

func newStagingEnv(t *testing.T, pool *pgxpool.Pool) *stagingEnv {
	t.Helper()
	ob, err := outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)
	target := Target{Exporter: "stripe_meter_events", Account: "acct_1", Mode: outbox.ModeTest,
		AcceptPast: 35 * 24 * time.Hour, AcceptFuture: 5 * time.Minute, MaxValue: stripeapi.MaxValue,
		InvoiceGrace: MaxInvoiceGrace, LateUsage: LateSend}
	return &stagingEnv{pool: pool,
		stager: &Stager{Outbox: ob, Grace: time.Minute, Target: func(context.Context) (Target, bool) { return target, true }}}
}

// load maps the features and the tenants (all but the last, whose usage
// is quarantined as no_customer) and writes usage of each tenant, hours
// back, one statement per tenant.
func (e *stagingEnv) load(t *testing.T, tenants []string, hour time.Time) {
	t.Helper()
	ctx := t.Context()
	// The mappings by hand: the mapping writer's upsert is not yet one
	// Citus takes on a reference table.
	exec := func(sql string, args ...any) {
		_, err := e.pool.Exec(ctx, sql, args...)
		require.NoError(t, err, sql)
	}
	for name, agg := range map[string]mappings.Aggregation{"calls": mappings.Sum, "seats": mappings.Last, "logins": mappings.Count} {
		exec(`INSERT INTO feature_mapping_versions (version, feature, event_name, aggregation, window_seconds, exporter,
			customer_payload_key, value_payload_key, changed_by)
			VALUES (nextval('mapping_version_seq'), $1, $1, $2, 3600, '', $3, $4, 'test')`,
			name, string(agg), mappings.DefaultCustomerPayloadKey, mappings.DefaultValuePayloadKey)
		exec(`INSERT INTO feature_mappings (feature, event_name, aggregation, window_seconds, exporter,
			customer_payload_key, value_payload_key, version, updated_by)
			VALUES ($1, $1, $2, 3600, '', $3, $4, currval('mapping_version_seq'), 'test')`,
			name, string(agg), mappings.DefaultCustomerPayloadKey, mappings.DefaultValuePayloadKey)
	}
	for _, tn := range tenants[:len(tenants)-1] {
		exec(`INSERT INTO tenant_mapping_versions (version, tenant, stripe_customer_id, changed_by)
			VALUES (nextval('mapping_version_seq'), $1, $2, 'test')`, tn, "cus_"+strings.ReplaceAll(tn, "-", ""))
		exec(`INSERT INTO tenant_mappings (tenant, stripe_customer_id, version, updated_by)
			VALUES ($1, $2, currval('mapping_version_seq'), 'test')`, tn, "cus_"+strings.ReplaceAll(tn, "-", ""))
	}
	for i, tn := range tenants {
		var rows [][]any
		for h := range 3 {
			for k := range 4 {
				at := hour.Add(time.Duration(h)*time.Hour + time.Duration(k)*time.Minute)
				for _, f := range []string{"calls", "seats", "logins", "unmapped"} {
					v := int64(i*10 + h*4 + k + 1)
					if f == "logins" {
						v = 1
					}
					rows = append(rows, []any{tn, fmt.Sprintf("%s-%d-%d", f, h, k), f, v, at, true, tenantbucket.Of(tn)})
				}
			}
		}
		_, err := e.pool.CopyFrom(ctx, pgx.Identifier{"usage_events"},
			[]string{"tenant", "event_id", "feature", "value", "occurred_at", "timestamp_given", "bucket"}, pgx.CopyFromRows(rows))
		require.NoError(t, err)
	}
}

// state is what staging left: every item, every ledger row's item, and
// the completeness counters, in an order independent of ids.
func (e *stagingEnv) state(t *testing.T) (items, rows, counters []string) {
	t.Helper()
	ctx := t.Context()
	read := func(sql string) []string {
		r, err := e.pool.Query(ctx, sql)
		require.NoError(t, err)
		out, err := pgx.CollectRows(r, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}
	items = read(`SELECT concat_ws(' ', tenant_key, subject_kind, subject_ref, state, quarantine_reason, payload ->> 'value', payload ->> 'timestamp')
		FROM outbox_items ORDER BY 1`)
	rows = read(`SELECT concat_ws(' ', u.tenant, u.event_id, o.subject_ref)
		FROM usage_events u LEFT JOIN outbox_items o ON o.id = u.item_id AND o.bucket = u.bucket ORDER BY 1`)
	counters = read(`SELECT concat_ws(' ', period, tenant, feature, account, sum(ingested_events), sum(ingested_value),
		sum(pending_events), sum(pending_value), sum(unstaged_events), sum(unstaged_value))
		FROM completeness_counters GROUP BY period, tenant, feature, account ORDER BY 1`)
	return items, rows, counters
}

// Staging a distributed database, batched and one window a transaction,
// of tenants in several shard groups, leaves the items, the ledger's marks
// and the completeness counters one server's staging leaves.
func TestStagingOnCitusIsOneServers(t *testing.T) {
	t.Parallel()
	dist := testdb.NewDistributed(t)
	shards, err := tenantbucket.ReadShards(t.Context(), dist)
	require.NoError(t, err)
	tenants := tenantsOfGroups(t, shards, 4)
	hour := time.Now().UTC().Truncate(time.Hour).Add(-4 * time.Hour)
	for _, batched := range []bool{true, false} {
		t.Run(fmt.Sprintf("batched %v", batched), func(t *testing.T) {
			t.Parallel()
			var want [3][]string
			for k, pool := range []*pgxpool.Pool{testdb.New(t), testdb.NewDistributed(t)} {
				e := newStagingEnv(t, pool)
				e.load(t, tenants, hour)
				res, err := e.stager.pass(t.Context(), pool, Part{}, batched)
				require.NoError(t, err)
				require.Equal(t, 4*3*4*4, res.Events, "every row staged")
				// Late rows of closed windows: a last window's older row
				// joins its item, a sum window's makes a supplement.
				for _, tn := range tenants {
					_, err := pool.Exec(t.Context(), `INSERT INTO usage_events (tenant, event_id, feature, value, occurred_at, timestamp_given, bucket)
						VALUES ($1, 'seats-late', 'seats', 99, $2, true, $3), ($1, 'calls-late', 'calls', 5, $4, true, $3)`,
						tn, hour.Add(time.Minute+time.Second), tenantbucket.Of(tn), hour.Add(30*time.Minute))
					require.NoError(t, err)
				}
				res, err = e.stager.pass(t.Context(), pool, Part{}, batched)
				require.NoError(t, err)
				require.Equal(t, 4*2, res.Events, "every late row staged")
				require.Equal(t, 4, res.Items, "a supplement per tenant")
				items, rows, counters := e.state(t)
				require.Len(t, items, 4*(3+3+12+12+1))
				for _, r := range rows {
					require.Len(t, strings.Fields(r), 3, "row %s has an item", r)
				}
				if k == 0 {
					want = [3][]string{items, rows, counters}
					continue
				}
				require.Equal(t, want[0], items)
				require.Equal(t, want[1], rows)
				require.Equal(t, want[2], counters)
				if batched {
					// The parts deal the groups out: a second pass finds nothing.
					for _, p := range Parts(3) {
						res, err := e.stager.pass(t.Context(), pool, p, batched)
						require.NoError(t, err)
						require.Zero(t, res.Events)
					}
				}
			}
		})
	}
}
