package quarantine_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/tenantbucket"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// The quarantine report on a distributed database reads each shard group
// in turn and merges them: tenants of different groups, a requeued item's
// successor quarantined again (its events still named by its
// predecessor), one tenant's report, and the totals, as on one server.
func TestQuarantineReportOnCitus(t *testing.T) {
	t.Parallel()
	b := &bundle{Env: stagetest.NewOn(t, outbox.Config{}, testdb.NewDistributed(t))}
	b.requeuer = &quarantine.Requeuer{Outbox: b.Outbox, Stager: b.Stager}
	shards, err := tenantbucket.ReadShards(b.Ctx, b.Pool)
	require.NoError(t, err)
	require.True(t, shards.Distributed())
	var tenants []string
	seen := map[int]bool{}
	for i := 0; len(tenants) < 3; i++ {
		tenant := fmt.Sprintf("ten%d", i)
		if g := shards.GroupOf(tenantbucket.Of(tenant)); !seen[g] {
			seen[g] = true
			tenants = append(tenants, tenant)
		}
	}
	b.Feature(t, "api", mappings.Sum, time.Hour)
	for i, tenant := range tenants {
		// No tenant mapping: every item is quarantined without a customer.
		b.MustIngest(t, ev(tenant+"-a", tenant, "api", int64(i+1), ago(3*time.Hour)), ev(tenant+"-b", tenant, "api", 10, ago(3*time.Hour)))
	}
	b.Pass(t)

	// The first tenant's item is requeued once its customer is mapped, and
	// its successor is quarantined at its first claim.
	first := b.itemOf(t, tenants[0], tenants[0]+"-a")
	require.Equal(t, outbox.StateQuarantined, first.State)
	tn, _, err := b.Maps.PutTenant(b.Ctx, b.Pool, tenants[0], mappings.TenantInput{StripeCustomerID: "cus_x"}, "test")
	require.NoError(t, err)
	_, err = b.requeuer.Requeue(b.Ctx, b.Pool, first.ID, tn.Version, "test")
	require.NoError(t, err)
	l, err := b.Outbox.Claim(b.Ctx, b.Pool, outbox.ClaimOptions{Owner: "t", Limit: 10})
	require.NoError(t, err)
	require.Len(t, l, 1)
	require.NotEqual(t, first.ID, l[0].ID)
	require.NoError(t, b.Outbox.Quarantine(b.Ctx, b.Pool, l[0], outbox.ReasonCustomerNotFound, outbox.ErrorInfo{Code: "customer_not_found", Status: 400}))

	rep, err := quarantine.Quarantined(b.Ctx, b.Pool, quarantine.Filter{})
	require.NoError(t, err)
	require.Len(t, rep.Groups, len(tenants), "%+v", rep.Groups)
	var events int64
	for i, g := range rep.Groups {
		events += g.Events
		require.Equal(t, int64(1), g.Items)
		require.Equal(t, int64(2), g.Events, "the requeued item's events through its predecessor: %+v", g)
		if i > 0 {
			prev := rep.Groups[i-1]
			require.Less(t, prev.Reason+"\x00"+prev.Tenant, g.Reason+"\x00"+g.Tenant, "ordered as on one server")
		}
	}
	total := int64(0)
	for _, tot := range rep.Totals {
		total += tot.Events
	}
	require.Equal(t, events, total)

	one, err := quarantine.Quarantined(b.Ctx, b.Pool, quarantine.Filter{Tenant: tenants[1]})
	require.NoError(t, err)
	require.Len(t, one.Groups, 1)
	require.Equal(t, tenants[1], one.Groups[0].Tenant)
	require.Equal(t, int64(2), one.Groups[0].Events)
	require.Equal(t, quarantine.ValueOf(12), one.Groups[0].Value)
}
