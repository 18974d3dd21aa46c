package quarantine_test

import (
	"bytes"
	"context"
	"encoding/csv"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// countEvents ingests n count events of tenant (one item each) and stages
// them: with the tenant unmapped, n items quarantined no_customer.
func (b *bundle) countEvents(t *testing.T, tenant string, n int) {
	t.Helper()
	events := make([]meter.Event, n)
	for i := range events {
		events[i] = ev(fmt.Sprintf("%s-%d", tenant, i), tenant, "logins", 1, ago(3*time.Hour))
	}
	b.MustIngest(t, events...)
	b.Pass(t)
}

// rows is every outbox row's state and version, and the audit log's
// length: what a dry run must leave as it found it.
func (b *bundle) rows(t *testing.T) string {
	t.Helper()
	var s string
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT coalesce(string_agg(concat_ws(' ', id, state, mapping_version, identifier,
			superseded_by, updated_at), E'\n' ORDER BY id), '') || E'\naudit ' || (SELECT count(*) FROM audit_log)
		FROM outbox_items`).Scan(&s))
	return s
}

func actions(res quarantine.BulkResult) map[int64]string {
	out := map[int64]string{}
	for _, it := range res.Items {
		out[it.ItemID] = it.Action + " " + it.Refusal
	}
	return out
}

func TestBulkRequeueRefusesWhatItCannotRequeueAndGoesOn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "logins", mappings.Count, time.Hour)
	b.countEvents(t, "acme", 3)
	b.countEvents(t, "beta", 3)
	b.Tenant(t, "beta", nil) // acme stays without a customer

	_, err := b.requeuer.RequeueMatching(b.Ctx, b.Pool, quarantine.BulkRequest{Limit: quarantine.MaxBulkLimit + 1})
	require.ErrorIs(t, err, quarantine.ErrBulkLimit)
	_, err = b.requeuer.RequeueMatching(b.Ctx, b.Pool, quarantine.BulkRequest{Filter: quarantine.Filter{Period: "2026-13"}})
	require.Error(t, err, "a malformed period")

	// No destination: every item refuses, nothing changes.
	before := b.rows(t)
	target := b.Target
	b.Stager.Target = func(context.Context) (meter.Target, bool) { return meter.Target{}, false }
	res, err := b.requeuer.RequeueMatching(b.Ctx, b.Pool, quarantine.BulkRequest{By: "test"})
	require.NoError(t, err)
	require.Equal(t, quarantine.BulkTotals{Refused: 6, RefusedBy: map[string]int{"export_stalled": 6}}, res.Totals)
	require.Equal(t, before, b.rows(t))
	b.Stager.Target = func(context.Context) (meter.Target, bool) { return target, true }

	// A page of two at a time: acme's refusals stay quarantined and do not
	// stop the pages that follow.
	var all []quarantine.BulkItem
	var after int64
	for pages := 0; ; pages++ {
		require.Less(t, pages, 4)
		res, err = b.requeuer.RequeueMatching(b.Ctx, b.Pool, quarantine.BulkRequest{After: after, Limit: 2, By: "test"})
		require.NoError(t, err)
		all = append(all, res.Items...)
		if res.NextAfter == nil {
			break
		}
		after = *res.NextAfter
	}
	require.Len(t, all, 6)
	var refused, readdressed int
	for _, it := range all {
		switch it.Action {
		case quarantine.ActionRefused:
			refused++
			require.Equal(t, "still_ineligible", it.Refusal)
		case quarantine.ActionReaddressed:
			readdressed++
			require.NotNil(t, it.Successor)
		}
	}
	require.Equal(t, 3, refused)
	require.Equal(t, 3, readdressed)
	left, err := quarantine.Items(b.Ctx, b.Pool, quarantine.Filter{}, 100)
	require.NoError(t, err)
	require.Len(t, left, 3)
	for _, it := range left {
		require.Equal(t, "acme", it.Tenant)
	}
}

// inPlaceItem makes an item of tenant acme and feature api that one
// attempt may have reached (a timeout) and that Stripe then refused: a
// requeue puts it back as it is (T9), a re-addressing is refused.
func (b *bundle) inPlaceItem(t *testing.T, id string) int64 {
	t.Helper()
	b.MustIngest(t, ev(id, "acme", "api", 5, ago(3*time.Hour)))
	b.Pass(t)
	l, err := b.Outbox.Claim(b.Ctx, b.Pool, outbox.ClaimOptions{Owner: "t", Limit: 1})
	require.NoError(t, err)
	require.Len(t, l, 1)
	_, err = b.Outbox.Retry(b.Ctx, b.Pool, l[0], outbox.ErrorInfo{Code: "timeout"}, false)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		l, err = b.Outbox.Claim(b.Ctx, b.Pool, outbox.ClaimOptions{Owner: "t", Limit: 1})
		return err == nil && len(l) == 1
	}, 5*time.Second, 5*time.Millisecond)
	require.NoError(t, b.Outbox.Quarantine(b.Ctx, b.Pool, l[0], outbox.ReasonMeterNotFound, outbox.ErrorInfo{Code: "meter_not_found", Status: 400}))
	return l[0].ID
}

// The dry run answers what the run then does, item by item, and leaves
// every row and the audit log as they were.
func TestBulkDryRunChangesNothingAndForetellsTheRun(t *testing.T) {
	t.Parallel()
	b := setupWith(t, outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	b.Feature(t, "api", mappings.Sum, time.Hour)
	b.Feature(t, "logins", mappings.Count, time.Hour)
	b.Tenant(t, "acme", nil)
	inPlace := b.inPlaceItem(t, "a1")
	b.countEvents(t, "beta", 4)
	b.countEvents(t, "gamma", 2) // gamma stays unmapped
	b.Tenant(t, "beta", nil)

	before := b.rows(t)
	dry, err := b.requeuer.RequeueMatching(b.Ctx, b.Pool, quarantine.BulkRequest{DryRun: true, By: "test"})
	require.NoError(t, err)
	require.True(t, dry.DryRun)
	require.Equal(t, before, b.rows(t), "the dry run changed nothing")
	require.Equal(t, quarantine.BulkTotals{Requeued: 1, Readdressed: 4, Refused: 2, RefusedBy: map[string]int{"still_ineligible": 2}}, dry.Totals)
	require.Equal(t, "requeued ", actions(dry)[inPlace])
	for _, it := range dry.Items {
		require.Nil(t, it.Successor, "a dry run keeps no successor")
	}
	again, err := b.requeuer.RequeueMatching(b.Ctx, b.Pool, quarantine.BulkRequest{DryRun: true, By: "test"})
	require.NoError(t, err)
	require.Equal(t, dry, again, "and can be repeated")

	run, err := b.requeuer.RequeueMatching(b.Ctx, b.Pool, quarantine.BulkRequest{By: "test"})
	require.NoError(t, err)
	require.False(t, run.DryRun)
	require.Equal(t, dry.Totals, run.Totals)
	require.Equal(t, actions(dry), actions(run))
	trail, err := audit.List(b.Ctx, b.Pool, "", 100)
	require.NoError(t, err)
	byAction := map[string]int{}
	for _, e := range trail {
		if strings.HasPrefix(e.Subject, "item:") {
			require.Equal(t, "test", e.Actor)
			byAction[e.Action]++
		}
	}
	require.Equal(t, map[string]int{audit.ActionRequeue: 1, audit.ActionReaddress: 4}, byAction, "one entry per item requeued or re-addressed")
}

// A mapping that changes between the read of the items and their requeues
// makes its items refuse (mapping_changed) while the rest proceed; the next
// call requeues them under the new version.
func TestBulkRequeueRefusesItemsWhoseMappingChangedMeanwhile(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "logins", mappings.Count, time.Hour)
	b.countEvents(t, "acme", 5)
	b.countEvents(t, "beta", 5)
	b.Tenant(t, "acme", nil)
	b.Tenant(t, "beta", nil)

	var changed mappings.Tenant
	res, err := b.requeuer.RequeueMatchingAfterRead(b.Ctx, b.Pool, quarantine.BulkRequest{By: "test"}, func(ctx context.Context) error {
		var err error
		changed, _, err = b.Maps.PutTenant(ctx, b.Pool, "beta", mappings.TenantInput{StripeCustomerID: "cus_beta2"}, "someone else")
		return err
	})
	require.NoError(t, err)
	require.Equal(t, quarantine.BulkTotals{Readdressed: 5, Refused: 5, RefusedBy: map[string]int{"mapping_changed": 5}}, res.Totals)
	left, err := quarantine.Items(b.Ctx, b.Pool, quarantine.Filter{}, 100)
	require.NoError(t, err)
	require.Len(t, left, 5)
	for _, it := range left {
		require.Equal(t, "beta", it.Tenant)
		require.Equal(t, changed.Version, it.CurrentVersion)
	}

	res, err = b.requeuer.RequeueMatching(b.Ctx, b.Pool, quarantine.BulkRequest{Filter: quarantine.Filter{Tenant: "beta"}, By: "test"})
	require.NoError(t, err)
	require.Equal(t, quarantine.BulkTotals{Readdressed: 5, RefusedBy: map[string]int{}}, res.Totals)
	var customers []string
	rows, err := b.Pool.Query(b.Ctx, `SELECT DISTINCT payload ->> 'customer' FROM outbox_items WHERE state = 'pending' AND tenant_key = 'beta'`)
	require.NoError(t, err)
	customers, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"cus_beta2"}, customers, "under the mapping as it is now")
}

// The item-level CSV: one row an item, with its customer and last error as
// stored, and no text cell a spreadsheet would read as a formula.
func TestItemsCSVNeutralisesFormulas(t *testing.T) {
	t.Parallel()
	b := setupWith(t, outbox.Config{BackoffBase: time.Millisecond, BackoffCap: time.Millisecond})
	b.Feature(t, "api", mappings.Sum, time.Hour)
	b.Tenant(t, "acme", nil)
	id := b.inPlaceItem(t, "a1")
	hostile := []string{"=HYPERLINK(\"http://x\")", "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"}
	period := b.itemOf(t, "acme", "a1").Payload.Period
	require.NoError(t, pgx.BeginFunc(b.Ctx, b.Pool, func(tx pgx.Tx) error {
		for i, bad := range hostile {
			_, err := b.Outbox.Enqueue(b.Ctx, tx, outbox.NewItem{
				Identity: outbox.Identity{TenantKey: bad, SubjectKind: outbox.SubjectUsageEvent, SubjectRef: fmt.Sprintf("event:x:%d", i),
					Exporter: "stripe_meter_events", DestinationAccount: "acct_1", Mode: outbox.ModeTest},
				Payload:    outbox.Payload{Value: -int64(i), Timestamp: time.Now().Unix(), Feature: bad, Customer: bad, Period: period},
				Quarantine: outbox.ReasonFeatureUnmapped,
			})
			if err != nil {
				return err
			}
		}
		return nil
	}))
	items, err := quarantine.Items(b.Ctx, b.Pool, quarantine.Filter{}, quarantine.MaxItemsCSV)
	require.NoError(t, err)
	var buf bytes.Buffer
	require.NoError(t, quarantine.ItemsCSV(&buf, items))
	records, err := csv.NewReader(&buf).ReadAll()
	require.NoError(t, err)
	require.Equal(t, []string{"id", "tenant", "feature", "customer", "destination_account", "reason", "last_error_code", "last_error_status", "last_error",
		"period", "value", "mapping_version", "current_mapping_version"}, records[0])
	require.Len(t, records, 2+len(hostile))
	first := records[1]
	require.Equal(t, []string{fmt.Sprint(id), "acme", "api", "cus_acme", "acct_1", "meter_not_found", "meter_not_found", "400"}, first[:8])
	require.Equal(t, "5", first[10])
	for i, rec := range records[2:] {
		require.Equal(t, "'"+hostile[i], rec[1], "the tenant cell")
		require.Equal(t, "'"+hostile[i], rec[2], "the feature cell")
		require.Equal(t, "'"+hostile[i], rec[3], "the customer cell")
		require.Equal(t, fmt.Sprint(-i), rec[10], "a value is a number, a negative one a correction")
		for _, cell := range rec {
			require.False(t, cell != "" && strings.ContainsRune("=+@\t\r", rune(cell[0])), "an unescaped cell: %q", cell)
		}
	}
}
