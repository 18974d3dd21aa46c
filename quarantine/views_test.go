package quarantine_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/quarantine"
)

// The quarantined items come by id, each with the version a requeue names:
// the greater of its feature's and its tenant's current versions.
func TestItemsCarryTheCurrentMappingVersion(t *testing.T) {
	t.Parallel()
	b := setup(t)
	api := b.Feature(t, "api", mappings.Sum, time.Hour)
	acme := b.Tenant(t, "acme", nil)
	b.MustIngest(t,
		ev("u1", "acme", "mystery", 3, ago(3*time.Hour)),
		ev("n1", "nobody", "api", 4, ago(3*time.Hour)),
		ev("ok", "acme", "api", 9, ago(3*time.Hour)))
	b.Pass(t)

	items, err := quarantine.Items(b.Ctx, b.Pool, quarantine.Filter{}, 500)
	require.NoError(t, err)
	require.Len(t, items, 2)
	require.Less(t, items[0].ID, items[1].ID)
	byReason := map[string]quarantine.Item{}
	for _, it := range items {
		byReason[it.Reason] = it
	}
	unmapped, noCustomer := byReason["feature_unmapped"], byReason["no_customer"]
	require.Equal(t, "acme", unmapped.Tenant)
	require.Equal(t, "mystery", unmapped.Feature)
	require.Equal(t, "3", unmapped.Value)
	require.Equal(t, acme.Version, unmapped.CurrentVersion, "the feature is unmapped: the tenant's version")
	require.Equal(t, "nobody", noCustomer.Tenant)
	require.Equal(t, api.Version, noCustomer.CurrentVersion, "the tenant is unmapped: the feature's version")
	for _, it := range items {
		require.Equal(t, b.itemOf(t, it.Tenant, map[string]string{"acme": "u1", "nobody": "n1"}[it.Tenant]).MappingVersion, it.ItemVersion)
		require.NotEmpty(t, it.Period)
	}

	only, err := quarantine.Items(b.Ctx, b.Pool, quarantine.Filter{Reason: "no_customer", Tenant: "nobody", Feature: "api", Period: noCustomer.Period[:7]}, 500)
	require.NoError(t, err)
	require.Equal(t, []quarantine.Item{noCustomer}, only)
	first, err := quarantine.Items(b.Ctx, b.Pool, quarantine.Filter{}, 1)
	require.NoError(t, err)
	require.Equal(t, items[:1], first)
	none, err := quarantine.Items(b.Ctx, b.Pool, quarantine.Filter{Period: "2001-01"}, 500)
	require.NoError(t, err)
	require.Empty(t, none)
	_, err = quarantine.Items(b.Ctx, b.Pool, quarantine.Filter{Period: "2001-13"}, 500)
	require.Error(t, err, "a malformed period")
}
