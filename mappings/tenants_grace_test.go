package mappings_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/mappings"
)

func grace(d time.Duration) *mappings.Duration { g := mappings.Duration(d); return &g }

// graces lists each tenant's invoice grace as text, "-" for nil.
func graces(ts []mappings.Tenant) []string {
	out := make([]string, len(ts))
	for i, t := range ts {
		out[i] = "-"
		if t.InvoiceGrace != nil {
			out[i] = t.InvoiceGrace.String()
		}
	}
	return out
}

// A tenant mapping's invoice grace is part of the mapping: stored, read
// back by every reader, a change is a new version, the same grace again is
// no change, and nil (the node's TALLY_INVOICE_GRACE) differs from 0s.
func TestTenantInvoiceGrace(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	put := func(g *mappings.Duration, by string) (mappings.Tenant, bool) {
		t.Helper()
		tn, changed, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_1", InvoiceGrace: g}, by)
		require.NoError(t, err)
		return tn, changed
	}

	v1, changed := put(grace(2*time.Hour), "alice")
	require.True(t, changed)
	require.Equal(t, grace(2*time.Hour), v1.InvoiceGrace)
	got, err := s.GetTenant(ctx, pool, "acme")
	require.NoError(t, err)
	require.Equal(t, v1, got)
	list, err := s.Tenants(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, []mappings.Tenant{v1}, list)
	pair, err := s.Lookup(ctx, pool, "acme", "api")
	require.NoError(t, err)
	require.Equal(t, grace(2*time.Hour), pair.Tenant.InvoiceGrace, "the stager reads it from the pair")

	same, changed := put(grace(120*time.Minute), "bob")
	require.False(t, changed, "the same grace is no change")
	require.Equal(t, v1.Version, same.Version)
	require.Equal(t, "alice", same.UpdatedBy)

	v2, changed := put(grace(90*time.Minute), "carol")
	require.True(t, changed, "another grace is a change")
	require.Greater(t, v2.Version, v1.Version)
	v3, changed := put(grace(0), "dan")
	require.True(t, changed, "0s is a grace of its own")
	require.Equal(t, grace(0), v3.InvoiceGrace)
	v4, changed := put(nil, "erin")
	require.True(t, changed, "back to the node's default")
	require.Nil(t, v4.InvoiceGrace)
	_, changed = put(nil, "fay")
	require.False(t, changed)
	v5, changed := put(grace(mappings.MaxInvoiceGrace), "gus")
	require.True(t, changed)
	require.Equal(t, grace(72*time.Hour), v5.InvoiceGrace, "Stripe's largest is taken")

	hist, err := s.TenantHistory(ctx, pool, "acme")
	require.NoError(t, err)
	require.Equal(t, []string{"2h0m0s", "1h30m0s", "0s", "-", "72h0m0s"}, graces(hist), "the history keeps each version's")
	pair, err = s.Lookup(ctx, pool, "acme", "api")
	require.NoError(t, err)
	require.Equal(t, grace(72*time.Hour), pair.Tenant.InvoiceGrace)
	got, err = s.GetTenant(ctx, pool, "acme")
	require.NoError(t, err)
	require.Equal(t, v5, got)

	entries, err := audit.List(ctx, pool, "tenant:acme", 10)
	require.NoError(t, err)
	require.Len(t, entries, 5, "one entry per change, none for the identical PUTs")
	require.Equal(t, fmt.Sprintf("v%d cus_1 calendar months grace 2h0m0s", v1.Version), entries[4].To)
	require.Equal(t, entries[4].To, entries[3].From)
	require.Equal(t, fmt.Sprintf("v%d cus_1 calendar months grace 1h30m0s", v2.Version), entries[3].To)
	require.Equal(t, fmt.Sprintf("v%d cus_1 calendar months grace 0s", v3.Version), entries[2].To)
	require.Equal(t, fmt.Sprintf("v%d cus_1 calendar months", v4.Version), entries[1].To, "no grace named: none shown")

	// Lookups of many pairs give each tenant its own grace.
	_, _, err = s.PutTenant(ctx, pool, "globex", mappings.TenantInput{StripeCustomerID: "cus_2", InvoiceGrace: grace(time.Hour)}, "x")
	require.NoError(t, err)
	_, _, err = s.PutTenant(ctx, pool, "initech", mappings.TenantInput{StripeCustomerID: "cus_3"}, "x")
	require.NoError(t, err)
	pairs, err := s.LookupMany(ctx, pool, map[[2]string]bool{{"acme", "api"}: true, {"globex", "api"}: true, {"initech", "api"}: true})
	require.NoError(t, err)
	require.Equal(t, grace(72*time.Hour), pairs[[2]string{"acme", "api"}].Tenant.InvoiceGrace)
	require.Equal(t, grace(time.Hour), pairs[[2]string{"globex", "api"}].Tenant.InvoiceGrace)
	require.Nil(t, pairs[[2]string{"initech", "api"}].Tenant.InvoiceGrace)
}

// A grace below 0, beyond 72 hours or not in whole seconds is refused as a
// field problem, with every other problem of the input, and nothing is
// stored.
func TestTenantInvoiceGraceValidation(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	v1, _, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_1", InvoiceGrace: grace(time.Hour)}, "x")
	require.NoError(t, err)
	const reason = "a duration from 0s to 72h (Stripe's largest finalization grace period), in whole seconds"
	for _, g := range []time.Duration{-time.Second, -time.Nanosecond, 72*time.Hour + time.Second, 72*time.Hour + time.Nanosecond,
		1500 * time.Millisecond, time.Hour + time.Microsecond, 1 << 62} {
		for _, tenant := range []string{"acme", "newco"} {
			_, _, err := s.PutTenant(ctx, pool, tenant, mappings.TenantInput{StripeCustomerID: "cus_1", InvoiceGrace: grace(g)}, "x")
			var ve *mappings.ValidationError
			require.ErrorAs(t, err, &ve, "%s", g)
			require.Equal(t, []mappings.FieldError{{Field: "invoice_grace", Reason: reason}}, ve.Fields, "%s", g)
		}
	}
	_, _, err = s.PutTenant(ctx, pool, "a b", mappings.TenantInput{StripeCustomerID: "acct_1", InvoiceGrace: grace(-time.Hour)}, "x")
	var ve *mappings.ValidationError
	require.ErrorAs(t, err, &ve)
	require.Equal(t, []string{"tenant", "stripe_customer_id", "invoice_grace"},
		[]string{ve.Fields[0].Field, ve.Fields[1].Field, ve.Fields[2].Field}, "every problem is named")
	refusal, ok := mappings.RefusalOf(err)
	require.True(t, ok)
	require.Equal(t, mappings.CodeInvalidMapping, refusal.Code)

	got, err := s.GetTenant(ctx, pool, "acme")
	require.NoError(t, err)
	require.Equal(t, v1, got, "nothing stored")
	_, err = s.GetTenant(ctx, pool, "newco")
	require.ErrorIs(t, err, mappings.ErrNotFound, "nothing stored")
	hist, err := s.TenantHistory(ctx, pool, "acme")
	require.NoError(t, err)
	require.Len(t, hist, 1)
	entries, err := audit.List(ctx, pool, "", 10)
	require.NoError(t, err)
	require.Len(t, entries, 1)

	require.True(t, mappings.ValidInvoiceGrace(0))
	require.True(t, mappings.ValidInvoiceGrace(72*time.Hour))
	require.False(t, mappings.ValidInvoiceGrace(time.Millisecond))
}

// The database holds invoice_grace to 0 through 72 hours in both tables,
// whoever writes it; a grace written in days reads back in hours.
func TestTenantInvoiceGraceInTheDatabase(t *testing.T) {
	t.Parallel()
	ctx, pool, s := context.Background(), testdb.New(t), &mappings.Store{}
	_, _, err := s.PutTenant(ctx, pool, "acme", mappings.TenantInput{StripeCustomerID: "cus_1"}, "x")
	require.NoError(t, err)
	for _, bad := range []string{"-1 second", "72 hours 1 second", "4 days", "1 month"} {
		_, err := pool.Exec(ctx, "UPDATE tenant_mappings SET invoice_grace = $1::interval", bad)
		require.ErrorContains(t, err, "tenant_mappings_invoice_grace_check", bad)
		_, err = pool.Exec(ctx, `INSERT INTO tenant_mapping_versions (version, tenant, stripe_customer_id, invoice_grace, changed_by)
			VALUES (nextval('mapping_version_seq'), 'acme', 'cus_1', $1::interval, 'x')`, bad)
		require.ErrorContains(t, err, "tenant_mapping_versions_invoice_grace_check", bad)
	}
	_, err = pool.Exec(ctx, "UPDATE tenant_mappings SET invoice_grace = '3 days'")
	require.NoError(t, err, "72 hours, in days")
	got, err := s.GetTenant(ctx, pool, "acme")
	require.NoError(t, err)
	require.Equal(t, grace(72*time.Hour), got.InvoiceGrace)
	_, err = pool.Exec(ctx, "UPDATE tenant_mappings SET invoice_grace = '1 day 30 minutes'")
	require.NoError(t, err)
	pair, err := s.Lookup(ctx, pool, "acme", "api")
	require.NoError(t, err)
	require.Equal(t, grace(24*time.Hour+30*time.Minute), pair.Tenant.InvoiceGrace)
}

// Migration 26 goes down and up again: the column and its CHECK are
// gone, then back, empty.
func TestMigrationOfTheInvoiceGrace(t *testing.T) {
	t.Parallel()
	ctx, pool := context.Background(), testdb.New(t)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS("../migrations"), goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	columns := func() int {
		t.Helper()
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.columns
			WHERE column_name = 'invoice_grace' AND table_name IN ('tenant_mappings', 'tenant_mapping_versions')`).Scan(&n))
		return n
	}
	require.Equal(t, 2, columns())
	_, err = p.ApplyVersion(ctx, 26, false)
	require.NoError(t, err)
	require.Zero(t, columns())
	_, err = p.ApplyVersion(ctx, 26, true)
	require.NoError(t, err)
	require.Equal(t, 2, columns())
}

// In JSON a tenant's invoice grace is Go's duration text, left out when
// nil; an input takes Go's duration text, null or nothing.
func TestTenantInvoiceGraceJSON(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	anchor := time.Date(2026, 1, 15, 0, 0, 0, 0, time.UTC)
	tn := mappings.Tenant{Tenant: "acme", StripeCustomerID: "cus_1", PeriodAnchor: &anchor, InvoiceGrace: grace(2 * time.Hour),
		Version: 7, UpdatedAt: at, UpdatedBy: "alice"}
	b, err := json.Marshal(tn)
	require.NoError(t, err)
	require.JSONEq(t, `{"tenant":"acme","stripe_customer_id":"cus_1","period_anchor":"2026-01-15T00:00:00Z","invoice_grace":"2h0m0s",
		"mapping_version":7,"updated_at":"2026-03-01T12:00:00Z","updated_by":"alice"}`, string(b))
	var back mappings.Tenant
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, tn, back)

	// Through a pointer, in a slice and in a map, as the CLI prints it.
	b, err = json.Marshal(map[string]any{"mapping": &tn, "history": []mappings.Tenant{tn}})
	require.NoError(t, err)
	require.Contains(t, string(b), `"history":[{"tenant":"acme","stripe_customer_id":"cus_1","period_anchor":"2026-01-15T00:00:00Z","invoice_grace":"2h0m0s","mapping_version":7,"updated_at":"2026-03-01T12:00:00Z","updated_by":"alice"}]`)

	tn.InvoiceGrace, tn.PeriodAnchor = nil, nil
	b, err = json.Marshal(tn)
	require.NoError(t, err)
	require.JSONEq(t, `{"tenant":"acme","stripe_customer_id":"cus_1","mapping_version":7,"updated_at":"2026-03-01T12:00:00Z","updated_by":"alice"}`, string(b))
	back = mappings.Tenant{InvoiceGrace: grace(time.Hour)}
	require.NoError(t, json.Unmarshal([]byte(`{"tenant":"acme","invoice_grace":null}`), &back))
	require.Nil(t, back.InvoiceGrace)
	require.Equal(t, "acme", back.Tenant)

	for body, want := range map[string]*mappings.Duration{
		`{"stripe_customer_id":"cus_1","invoice_grace":"2h"}`:   grace(2 * time.Hour),
		`{"stripe_customer_id":"cus_1","invoice_grace":"90m"}`:  grace(90 * time.Minute),
		`{"stripe_customer_id":"cus_1","invoice_grace":"0s"}`:   grace(0),
		`{"stripe_customer_id":"cus_1","invoice_grace":null}`:   nil,
		`{"stripe_customer_id":"cus_1"}`:                        nil,
		`{"stripe_customer_id":"cus_1","invoice_grace":"-1h"}`:  grace(-time.Hour), // parsed; validate refuses it
		`{"stripe_customer_id":"cus_1","invoice_grace":"1.5s"}`: grace(1500 * time.Millisecond),
	} {
		var in mappings.TenantInput
		require.NoError(t, json.Unmarshal([]byte(body), &in), body)
		require.Equal(t, "cus_1", in.StripeCustomerID, body)
		require.Equal(t, want, in.InvoiceGrace, body)
	}
	for _, body := range []string{`{"invoice_grace":"soon"}`, `{"invoice_grace":7200}`, `{"invoice_grace":""}`} {
		var in mappings.TenantInput
		require.Error(t, json.Unmarshal([]byte(body), &in), body)
	}
	in := mappings.TenantInput{StripeCustomerID: "cus_1", InvoiceGrace: grace(90 * time.Minute)}
	b, err = json.Marshal(in)
	require.NoError(t, err)
	require.JSONEq(t, `{"stripe_customer_id":"cus_1","period_anchor":null,"invoice_grace":"1h30m0s"}`, string(b))
	var again mappings.TenantInput
	require.NoError(t, json.Unmarshal(b, &again))
	require.Equal(t, in, again)
	b, err = json.Marshal(mappings.TenantInput{StripeCustomerID: "cus_1"})
	require.NoError(t, err)
	require.JSONEq(t, `{"stripe_customer_id":"cus_1","period_anchor":null,"invoice_grace":null}`, string(b))
}
