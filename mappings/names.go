package mappings

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/tallymeter/tally/internal/pgdb"
)

// CustomerNamer reads a tenant mapping's customer with its name.
type CustomerNamer interface {
	// CustomerName is CheckCustomer that also returns the customer's name
	// as Stripe holds it ("" when it has none).
	CustomerName(ctx context.Context, account, customerID string) (string, error)
}

// TenantCustomer is a tenant's current customer and the name Stripe last
// gave it.
type TenantCustomer struct {
	Customer string
	// Account is the tenant mapping's connected account, "" for the
	// node's destination.
	Account string
	// Name is the customer's name as last read, "" when Stripe has none
	// or it was never read.
	Name string
}

// sqlNameStore keeps the name Stripe answered for a customer, NULL for
// none, stamped by the database's clock: the new row's read_at (its column
// default), as a distributed database refuses a function that is not
// IMMUTABLE in DO UPDATE SET, and the names are a reference table.
const sqlNameStore = `
INSERT INTO stripe_customer_names (account, customer, name) VALUES (@account, @customer, NULLIF(@name, ''))
ON CONFLICT (account, customer) DO UPDATE SET name = EXCLUDED.name, read_at = EXCLUDED.read_at`

// sqlTenantCustomers reads the current customer of each tenant named and
// its cached name: two primary-key lookups a tenant.
const sqlTenantCustomers = `
SELECT t.tenant, t.stripe_customer_id, coalesce(t.stripe_account, ''), coalesce(n.name, '')
FROM tenant_mappings t
LEFT JOIN stripe_customer_names n ON n.account = coalesce(t.stripe_account, '') AND n.customer = t.stripe_customer_id
WHERE t.tenant = ANY(@tenants)`

// sqlStaleNames lists the customers of current tenant mappings whose name
// was never read or was read longer than @ttl ago, never read first. It
// reads every tenant mapping: its cost grows with the tenants, not with
// usage.
const sqlStaleNames = `
SELECT a.account, a.customer
FROM (SELECT DISTINCT coalesce(stripe_account, '') AS account, stripe_customer_id AS customer FROM tenant_mappings) a
LEFT JOIN stripe_customer_names n ON n.account = a.account AND n.customer = a.customer
WHERE n.read_at IS NULL OR n.read_at < clock_timestamp() - @ttl::interval
ORDER BY n.read_at NULLS FIRST, a.account, a.customer
LIMIT @batch`

// storeName keeps the name of account's customer.
func storeName(ctx context.Context, q pgdb.Querier, account, customer, name string) error {
	_, err := q.Exec(ctx, sqlNameStore, pgx.NamedArgs{"account": account, "customer": customer, "name": name})
	return err
}

// TenantCustomers reads the current customer of each of tenants and its
// name as last read from Stripe; a tenant without a mapping is absent. It
// never asks Stripe: two index lookups a tenant.
func TenantCustomers(ctx context.Context, q pgdb.Querier, tenants []string) (map[string]TenantCustomer, error) {
	out := map[string]TenantCustomer{}
	if len(tenants) == 0 {
		return out, nil
	}
	rows, err := q.Query(ctx, sqlTenantCustomers, pgx.NamedArgs{"tenants": tenants})
	if err != nil {
		return nil, fmt.Errorf("mappings: reading the tenants' customers: %w", err)
	}
	var (
		tenant string
		c      TenantCustomer
	)
	if _, err := pgx.ForEachRow(rows, []any{&tenant, &c.Customer, &c.Account, &c.Name}, func() error {
		out[tenant] = c
		return nil
	}); err != nil {
		return nil, fmt.Errorf("mappings: reading the tenants' customers: %w", err)
	}
	return out, nil
}

// NamesRead says what one RefreshNames did.
type NamesRead struct {
	// Read is how many customers Stripe answered (a missing or deleted
	// one with no name).
	Read int
	// Unreadable is how many could not be asked; their names stay as they
	// were, to be read again on the next pass.
	Unreadable int
}

// RefreshNames reads again from Stripe, one request each, the names of at
// most batch customers of current tenant mappings that were never read or
// were read longer than ttl ago, and keeps them. A customer Stripe does not
// have (or deleted) keeps no name; one that cannot be asked keeps the name
// it had.
func RefreshNames(ctx context.Context, q pgdb.Querier, namer CustomerNamer, ttl time.Duration, batch int) (NamesRead, error) {
	rows, err := q.Query(ctx, sqlStaleNames, pgx.NamedArgs{"ttl": ttl, "batch": batch})
	if err != nil {
		return NamesRead{}, fmt.Errorf("mappings: listing the names to read: %w", err)
	}
	type key struct{ account, customer string }
	stale, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (key, error) {
		var k key
		return k, r.Scan(&k.account, &k.customer)
	})
	if err != nil {
		return NamesRead{}, fmt.Errorf("mappings: listing the names to read: %w", err)
	}
	var res NamesRead
	for _, k := range stale {
		name, err := namer.CustomerName(ctx, k.account, k.customer)
		var ce *CustomerError
		switch {
		case errors.As(err, &ce):
			name = ""
		case err != nil:
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			res.Unreadable++
			continue
		}
		if err := storeName(ctx, q, k.account, k.customer, name); err != nil {
			return res, fmt.Errorf("mappings: keeping a customer's name: %w", err)
		}
		res.Read++
	}
	return res, nil
}

// NamesArgs is the River job that reads again the customer names older
// than its worker's TTL.
type NamesArgs struct{}

// Kind names the job.
func (NamesArgs) Kind() string { return "tally_customer_names" }

// NamesQueue is the River queue of the names job: one at a time, apart
// from staging (it waits for Stripe).
const NamesQueue = "customer_names"

// DefaultNamesTTL is how old a name may be before the job reads it again.
const DefaultNamesTTL = 24 * time.Hour

// DefaultNamesBatch is how many names one job reads at most.
const DefaultNamesBatch = 1000

// NamesWorker runs NamesArgs: RefreshNames with its TTL and batch.
type NamesWorker struct {
	river.WorkerDefaults[NamesArgs]
	DB    pgdb.Querier
	Namer CustomerNamer
	// TTL defaults to DefaultNamesTTL, Batch to DefaultNamesBatch.
	TTL    time.Duration
	Batch  int
	Logger *slog.Logger
}

// Work reads the stale names. Customers Stripe could not be asked about
// are logged as a count and read again on the next run.
func (w *NamesWorker) Work(ctx context.Context, _ *river.Job[NamesArgs]) error {
	ttl, batch := w.TTL, w.Batch
	if ttl <= 0 {
		ttl = DefaultNamesTTL
	}
	if batch <= 0 {
		batch = DefaultNamesBatch
	}
	res, err := RefreshNames(ctx, w.DB, w.Namer, ttl, batch)
	if err != nil {
		return err
	}
	if res.Unreadable > 0 {
		w.Logger.WarnContext(ctx, "customer names: Stripe could not be asked about some customers; their names are read again next hour",
			"read", res.Read, "unreadable", res.Unreadable)
	}
	return nil
}

// Timeout lets a run wait for Stripe for up to ten minutes (River's
// default is a minute).
func (w *NamesWorker) Timeout(*river.Job[NamesArgs]) time.Duration { return 10 * time.Minute }

// PeriodicNames is the names job every hour and when River's leader
// starts, unique in the cluster.
func PeriodicNames() *river.PeriodicJob {
	return river.NewPeriodicJob(river.PeriodicInterval(time.Hour), func() (river.JobArgs, *river.InsertOpts) {
		return NamesArgs{}, &river.InsertOpts{MaxAttempts: 1, Queue: NamesQueue, UniqueOpts: river.UniqueOpts{
			ByState: []rivertype.JobState{rivertype.JobStateAvailable, rivertype.JobStatePending,
				rivertype.JobStateRunning, rivertype.JobStateScheduled, rivertype.JobStateRetryable},
		}}
	}, &river.PeriodicJobOpts{ID: "tally_customer_names", RunOnStart: true})
}
