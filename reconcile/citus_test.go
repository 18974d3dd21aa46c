package reconcile_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// citusItems is a distributed database with two tenants of two shard
// groups, each mapped to its own customer, and n accepted items of each
// one key (account acct_1, event calls), enqueued, claimed and accepted
// without staging: what reconciliation reads.
type citusItems struct {
	ctx     context.Context
	pool    *pgxpool.Pool
	store   *outbox.Store
	tenants []string
	ids     map[string][]int64 // by tenant
	names   map[int64]string   // identifiers
}

func newCitusItems(t *testing.T, n int) *citusItems {
	t.Helper()
	c := &citusItems{ctx: context.Background(), pool: testdb.NewDistributed(t), ids: map[string][]int64{}, names: map[int64]string{}}
	var err error
	c.store, err = outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)
	shards, err := c.store.Shards(c.ctx, c.pool)
	require.NoError(t, err)
	require.True(t, shards.Distributed())
	seen := map[int]bool{}
	for i := 0; len(c.tenants) < 2; i++ {
		tenant := fmt.Sprintf("ten%d", i)
		if g := shards.GroupOf(tenantbucket.Of(tenant)); !seen[g] {
			seen[g] = true
			c.tenants = append(c.tenants, tenant)
		}
	}
	maps := &mappings.Store{}
	ts := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour).Unix()
	for _, tenant := range c.tenants {
		_, _, err := maps.PutTenant(c.ctx, c.pool, tenant, mappings.TenantInput{StripeCustomerID: "cus_" + tenant}, "test")
		require.NoError(t, err)
		tx, err := c.pool.Begin(c.ctx)
		require.NoError(t, err)
		for k := range n {
			res, err := c.store.Enqueue(c.ctx, tx, outbox.NewItem{
				Identity: outbox.Identity{TenantKey: tenant, SubjectKind: outbox.SubjectUsageEvent, SubjectRef: fmt.Sprintf("event:calls:%d", k),
					Exporter: "stripe_meter_events", DestinationAccount: "acct_1", Mode: outbox.ModeTest, MappingVersion: 1},
				Payload: outbox.Payload{Customer: "cus_" + tenant, EventName: "calls", Value: int64(k + 1), Timestamp: ts + int64(k),
					Feature: "calls", Period: "2026-11-01T00:00:00Z"},
			})
			require.NoError(t, err)
			c.ids[tenant] = append(c.ids[tenant], res.ID)
		}
		require.NoError(t, tx.Commit(c.ctx))
	}
	// Leased, then accepted, by the item's bucket: the claim and the
	// outcome are the deliverer's statements, not what this reads.
	for _, tenant := range c.tenants {
		for _, id := range c.ids[tenant] {
			b := tenantbucket.Of(tenant)
			_, err := c.pool.Exec(c.ctx, `UPDATE outbox_item_states SET state = 'leased', lease_token = lease_token + 1,
				attempts = attempts + 1, first_attempt_at = statement_timestamp(), lease_owner = 'test', leased_at = statement_timestamp(),
				lease_expires_at = statement_timestamp() + interval '1 hour', updated_at = statement_timestamp()
				WHERE bucket = $1 AND id = $2 AND state = 'pending'`, b, id)
			require.NoError(t, err)
			_, err = c.pool.Exec(c.ctx, `UPDATE outbox_item_states SET state = 'accepted', provider_ref = $3,
				accepted_at = statement_timestamp() - interval '1 minute', lease_expires_at = NULL, updated_at = statement_timestamp()
				WHERE bucket = $1 AND id = $2 AND state = 'leased'`, b, id, fmt.Sprintf("ref_%d", id))
			require.NoError(t, err)
			var name string
			require.NoError(t, c.pool.QueryRow(c.ctx, `SELECT identifier FROM outbox_item_bodies WHERE bucket = $1 AND id = $2`, b, id).
				Scan(&name))
			c.names[id] = name
		}
	}
	return c
}

// A key's items are read by its customer's tenant's bucket: each key gets
// its own tenant's items, in timestamp order, and nothing of the other
// tenant's shard group.
func TestKeyItemsOfTenantsOfTwoGroupsOnCitus(t *testing.T) {
	t.Parallel()
	c := newCitusItems(t, 3)
	for _, tenant := range c.tenants {
		key := "acct_1|cus_" + tenant + "|calls"
		items, err := c.store.KeyItems(c.ctx, c.pool, outbox.KeyRange{OrderingKey: key, Customer: "cus_" + tenant, Mode: outbox.ModeTest,
			From: 0, To: 1 << 40, Settle: time.Millisecond})
		require.NoError(t, err)
		var ids []int64
		for _, it := range items {
			require.Equal(t, tenant, it.Tenant)
			require.Equal(t, outbox.StateAccepted, it.State)
			ids = append(ids, it.ID)
		}
		require.Equal(t, c.ids[tenant], ids)
		// Without the customer (its tenants unknown) every shard is read,
		// to the same end.
		everywhere, err := c.store.KeyItems(c.ctx, c.pool, outbox.KeyRange{OrderingKey: key, Mode: outbox.ModeTest, From: 0, To: 1 << 40,
			Settle: time.Millisecond})
		require.NoError(t, err)
		require.Equal(t, items, everywhere)
	}
	keys, err := c.store.SettledKeys(c.ctx, c.pool, outbox.KeyFilter{Account: "acct_1", Mode: outbox.ModeTest})
	require.NoError(t, err)
	require.Len(t, keys, 2, "every tenant's key, from every shard")
}

// A provider's error report naming accepted items of tenants in two shard
// groups locks and fails both, in one transaction, and records the
// evidence of each.
func TestRecordReportAcrossShardGroupsOnCitus(t *testing.T) {
	t.Parallel()
	c := newCitusItems(t, 1)
	a, b := c.ids[c.tenants[0]][0], c.ids[c.tenants[1]][0]
	rep := stripeapi.MeterErrorReport{ID: "evt_test_groups", Type: stripeapi.EventMeterErrorReport, Created: time.Now(),
		Meter: "mtr_x", ErrorCount: 3, Samples: []stripeapi.MeterErrorSample{
			{Identifier: c.names[a], Code: "no_meter", Message: "No active meter for event_name"},
			{Identifier: c.names[b], Code: "timestamp_too_far_in_past", Message: "Timestamp too far in the past"},
			{Identifier: "tly_someone_elses_event", Code: "no_meter"},
		}}
	res, err := reconcile.RecordReport(c.ctx, c.pool, c.store, rep)
	require.NoError(t, err)
	require.Equal(t, reconcile.ReportResult{Recorded: true, Failed: 2, Unmatched: 1}, res)
	states, err := c.store.StatesOf(c.ctx, c.pool, []int64{a, b})
	require.NoError(t, err)
	require.Equal(t, map[int64]outbox.State{a: outbox.StateQuarantined, b: outbox.StateRejected}, states)
	ev, err := reconcile.EvidenceOf(c.ctx, c.pool, []int64{a, b})
	require.NoError(t, err)
	require.Len(t, ev, 2)

	// Delivered again: nothing moves twice.
	res, err = reconcile.RecordReport(c.ctx, c.pool, c.store, rep)
	require.NoError(t, err)
	require.Equal(t, reconcile.ReportResult{}, res)
}

// Discrepancies are the coordinator's and their items the shards': each
// discrepancy names the tenants and features of its items, read apart,
// and a tenant's open ones are found through its own items.
func TestDiscrepancyItemsOnCitus(t *testing.T) {
	t.Parallel()
	c := newCitusItems(t, 2)
	run, err := reconcile.Queue(c.ctx, c.pool, reconcile.TriggerAPI, "test", reconcile.Options{})
	require.NoError(t, err)
	_, err = c.pool.Exec(c.ctx, `UPDATE reconcile_runs SET status = 'succeeded', started_at = clock_timestamp(),
		heartbeat_at = clock_timestamp(), finished_at = clock_timestamp() WHERE id = $1`, run)
	require.NoError(t, err)
	byTenant := map[string]int64{}
	for i, tenant := range c.tenants {
		var id int64
		require.NoError(t, c.pool.QueryRow(c.ctx, `INSERT INTO reconcile_discrepancies (run_id, destination_account, mode, event_name,
				meter, customer, hour, formula, expected, provider, difference, expected_items, uncertain_items, explained_by, explanation)
			VALUES ($1, 'acct_1', 'test', 'calls', 'mtr_1', $2, $3, 'sum', 3, 0, -3, ARRAY[$4::bigint], ARRAY[$5::bigint], '{}', 'unexplained')
			RETURNING id`, run, "cus_"+tenant, time.Now().UTC().Truncate(time.Hour).Add(-time.Duration(i)*time.Hour),
			c.ids[tenant][0], c.ids[tenant][1]).Scan(&id))
		byTenant[tenant] = id
	}
	ds, err := reconcile.OpenDiscrepancies(c.ctx, c.pool)
	require.NoError(t, err)
	require.Len(t, ds, 2)
	for _, d := range ds {
		tenant := d.Customer[len("cus_"):]
		require.Equal(t, byTenant[tenant], d.ID)
		require.Equal(t, []string{tenant}, d.Tenants)
		require.Equal(t, []string{"calls"}, d.Features)
	}
	for _, tenant := range c.tenants {
		page, err := reconcile.ListOpen(c.ctx, c.pool, reconcile.OpenQuery{Tenant: tenant})
		require.NoError(t, err)
		require.Len(t, page.Discrepancies, 1)
		require.Equal(t, byTenant[tenant], page.Discrepancies[0].ID)
	}
	page, err := reconcile.ListOpen(c.ctx, c.pool, reconcile.OpenQuery{Tenant: "nobody"})
	require.NoError(t, err)
	require.Empty(t, page.Discrepancies)

	// The completeness report's count of each period's open hours: the
	// open discrepancies joined with their items, every shard's.
	from, to := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC), time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	for _, tenant := range c.tenants {
		per, err := reconcile.DiscrepanciesByPeriod(c.ctx, c.pool, from, to, tenant)
		require.NoError(t, err)
		require.Len(t, per, 1)
		require.Equal(t, tenant, per[0].Tenant)
		require.Equal(t, int64(1), per[0].Hours)
	}
	all, err := reconcile.DiscrepanciesByPeriod(c.ctx, c.pool, from, to, "")
	require.NoError(t, err)
	require.Len(t, all, len(c.tenants), "every tenant's period, read across the shards")
}
